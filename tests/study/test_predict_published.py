"""The predictor against published DeepSpeed measurements (data/published/): what the set covers, that every point
is cited, and the error the model reaches (docs/predict.md says why the max goal is not met)."""

from __future__ import annotations

import re

import pytest

from labkit.study import published

GOAL_MEDIAN, GOAL_MAX = 0.25, 0.40


@pytest.fixture(scope="module")
def points():
    return published.load()


@pytest.fixture(scope="module")
def comparison(points):
    return published.compare(points)


def test_the_published_set_covers_what_the_issue_asks(points):
    assert len(points) >= 10
    assert points["source"].nunique() >= 4
    assert points["gpu"].nunique() >= 3
    assert (points["nodes"] == 1).any() and (points["nodes"] > 1).any()
    assert points["stage"].isin([1, 2]).any() and (points["stage"] == 3).any()
    assert (points["offload_optimizer"].astype(str) == "True").any()
    assert points["point_id"].is_unique


def test_every_point_is_cited_with_a_commit_or_a_table(points):
    for _, row in points.iterrows():
        locator = str(row["locator"])
        assert re.search(r"@[0-9a-f]{40}", locator) or "Table" in locator, row["point_id"]
        assert float(row["value"]) > 0


def test_every_point_is_predicted_in_its_own_metric(comparison):
    assert len(comparison) == len(published.load())
    assert (comparison["predicted"] > 0).all()
    assert comparison["error"].notna().all()


def test_the_megatron_flop_formula_matches_the_papers_eq_3():
    # 96 B s l h^2 (1 + s/6h + V/16lh) for B = 1
    per_sample = published.megatron_flops_per_sample(96, 12288, 2048, 51200)
    assert per_sample == pytest.approx(96 * 2048 * 96 * 12288**2 * (1 + 2048 / (6 * 12288) + 51200 / (16 * 96 * 12288)))


def test_eq3_reads_the_zeropp_tutorials_log_and_counts_passes_as_its_source_did(tmp_path, points):
    # The ZeRO++ tutorial's baseline log (data/published/README.md, source 7): 18B, 64 GPUs, global batch 64,
    # 9,955.9 ms per iteration, "TFLOPs: 7.65", Megatron-DeepSpeed's formula with the vocabulary padded to 50,304.
    per_sample = published.megatron_flops_per_sample(40, 6144, 512, 50304)
    assert per_sample * 64 / 9.9559 / 64 / 1e12 == pytest.approx(7.65, abs=0.005)
    row = points[points["point_id"] == "zpp-18b-800g-2k"].iloc[0].copy()
    sc21 = published.published_samples_per_s(row)
    assert sc21 == pytest.approx(47e12 * 384 / per_sample, rel=1e-9)  # the vocabulary padded, as Megatron-LM trains
    row["flops_formula"] = "megatron_eq3_by_checkpointing"  # checkpointing on: the same 4 passes
    assert published.published_samples_per_s(row) == pytest.approx(sc21)
    row["activation_checkpointing"] = False  # off: 3 passes, so the same TFLOP/s is 4/3 the samples
    assert published.published_samples_per_s(row) == pytest.approx(sc21 * 4 / 3)
    edit = {"metric": "tflops_per_gpu", "value": "40", "flops_formula": "megatron_eq3_by_checkpointing",
            "activation_checkpointing": ""}
    with pytest.raises(ValueError, match="with activation_checkpointing stated"):
        published.load(_write(tmp_path, points, edit))


# Met since 2026-11-30, thinly: 19.1% over 46 points. It was 25.7% over the 43 before three held-out, compute-bound
# points of BigScience's 1B3 on 8 V100s (data/published/README.md, source 11) came in within 7% (26.8% since ZeRO-3's
# communication is played hook by hook, 2026-12-01); the median sits in a gap of the sorted errors (16.9% and 21.3%,
# then 26.8%, 28.1%): two more points past 25% would fail it again.
def test_the_issues_median_goal_on_the_published_points(comparison):
    assert comparison["error"].abs().median() <= GOAL_MEDIAN


@pytest.mark.xfail(strict=True, reason="the model does not reach the issue's goal for every point (<= 40%; it "
                                       "reaches 193%, 24 of 46 points within 25%, 34 within 40%). Over 40%: ZeRO-3 "
                                       "at 640-2240 A100s (SC21) and at micro-batch 1 on 16 V100 (autotuning), both "
                                       "with DeepSpeed's ZeRO-3 before v0.6.0 (a device synchronize per fetch, "
                                       "rewritten in #1453); ZeRO-3 on 384 V100 at 400-800 Gb/s (the ZeRO++ blog; "
                                       "those steps are about compute plus all the communication, the model hides "
                                       "part of it, hook by hook); GPT-2 large and XL end to end (a training "
                                       "loop's own work outside DeepSpeed's calls); ZeRO-1 of DeepSpeed 2020 at "
                                       "micro-batch 1 (the ZeRO tutorial's 1.5B on 8 V100, not explained); "
                                       "docs/predict.md has the arithmetic. strict: this test fails the day the model "
                                       "meets the goal, so the goal is then enforced here",
                   raises=AssertionError)  # a failing check, not an error in the test
def test_the_issues_goal_for_every_published_point(comparison):
    assert comparison["error"].abs().max() <= GOAL_MAX


def test_every_published_zero3_point_ran_slower_than_predicted(comparison):
    """What predict.ZERO3_CAVEAT tells every ZeRO-3 prediction across GPUs: the day a published ZeRO-3 point runs
    faster than predicted, the caveat is wrong and this fails."""
    zero3 = comparison[comparison["strategy"].str.startswith("z3") & (comparison["gpus"] > 1)]
    assert len(zero3) == 18  # the figure docs/predict.md and the README give; a point added changes both
    slower = [(row["predicted"] < row["published"]) if row["metric"] == "step_time_s"
              else (row["predicted"] > row["published"]) for _, row in zero3.iterrows()]
    assert all(slower), zero3.loc[[not s for s in slower], ["point_id", "metric", "published", "predicted"]]


# The sources whose ZeRO-3 is DeepSpeed's before v0.6.0 (2021: one parameter gathered at a time, a device sync each;
# docs/predict.md, "The worst points"): SC21's table and the autotuning results (DeepSpeed 0.5.x).
ZERO3_BEFORE_0_6 = ("megatron-sc21", "deepspeedexamples-autotuning")


def test_where_the_model_hides_communication_the_published_runs_hid_less(comparison, points):
    """What predict.ZERO3_CAVEAT says of step_time_s_if_nothing_hides: where the model hides communication behind
    compute (ZeRO-3 across GPUs alone, in the published set), DeepSpeed 0.6 and later's runs were within 18% of the
    same step with none hidden, where the prediction misses them by up to 66%. Not the model: a check of it."""
    hides = comparison[comparison["predicted_if_nothing_hides"] != comparison["predicted"]]
    zero3 = comparison[comparison["strategy"].str.startswith("z3") & (comparison["gpus"] > 1)]
    assert set(hides["point_id"]) == set(zero3["point_id"])
    later = hides[~hides["source"].isin(ZERO3_BEFORE_0_6)]
    before = hides[hides["source"].isin(ZERO3_BEFORE_0_6)]
    assert len(later) == 11 and later["source"].nunique() == 3 and later["gpu"].nunique() == 3 and len(before) == 7
    assert later["error_if_nothing_hides"].abs().max() <= 0.18
    # docs/predict.md's table: median / max |error|, predicted and with nothing hidden
    for rows, figures in ((later, (0.321, 0.658, 0.120, 0.177)), (before, (0.973, 1.932, 0.587, 1.591))):
        errors, nothing = rows["error"].abs(), rows["error_if_nothing_hides"].abs()
        assert [errors.median(), errors.max(), nothing.median(), nothing.max()] == pytest.approx(figures, abs=0.001)
    # only where the network bounds the step (100 Gb/s between nodes) is the prediction the nearer of the two
    nearer = later["error"].abs() < later["error_if_nothing_hides"].abs()
    assert set(later.loc[nearer, "point_id"]) == {"zpp-18b-100g-1k", "zpp-18b-100g-2k"}
    # in step times: between the two at 100-200 Gb/s and Azure's 175B; past the one with nothing hidden elsewhere
    steps = {row["point_id"]: published.batches(row)[2] / published.published_samples_per_s(row)
             for _, row in points.iterrows()}
    lower, upper = (later.set_index("point_id")[c].to_dict() for c in ("step_time_s", "step_time_s_if_nothing_hides"))
    between = {p for p in lower if lower[p] <= steps[p] <= upper[p]}
    assert between == {"zpp-18b-100g-1k", "zpp-18b-100g-2k", "zpp-18b-200g-2k", "azure-175b-256-s512-mb32"}
    past = {p: steps[p] / upper[p] - 1 for p in lower if p not in between}
    zpp = [v for p, v in past.items() if p.startswith("zpp")]
    azure = [v for p, v in past.items() if p.startswith("azure")]
    assert 0.04 <= min(zpp) <= max(zpp) <= 0.11 and 0.09 <= min(azure) <= max(azure) <= 0.18


def test_the_h100_examples_published_peak_memory_is_its_optimizer_steps(points):
    """DeepSpeedExamples' BF16 master-weights README (data/published/README.md, source 5) prints what torch's
    allocator counted per rank on its 4 H100s: 25.74 GiB allocated after the steps, 31.38 GiB at the peak
    (`torch.cuda.max_memory_allocated`, train.py's format_memory: GiB). The peak is the optimizer step's: the states
    and the step's flattened and fp32 copies of a 1e9-element sub-group (`memory.optimizer_step_bytes`), not the
    micro-step's activations (activation checkpointing, micro-batch 1). The shape stands in for the example's own
    model with 3% fewer parameters (its untied output projection), so the states come out that much short."""
    from labkit.core import memory
    from labkit.study import predict as P

    gib = 2**30
    args = published.setup(points[points["point_id"] == "dsx-bf16mw-6.9b-baseline"].iloc[0])
    pred = P.predict(**args)
    assert pred.step_peak_bytes > pred.device_bytes  # the step, not the micro-step, sets the peak
    assert pred.step_peak_bytes / gib == pytest.approx(31.38, rel=0.05)
    numels = [n for module in args["workload"].module_layout() for n in module]
    kept = pred.step_peak_bytes - memory.optimizer_step_bytes(3, numels, 4, "bf16")  # states and bucket
    assert kept / gib == pytest.approx(25.74, rel=0.05)


def test_the_rules_fill_what_a_source_leaves_out(points):
    h100 = points[points["point_id"] == "dsx-bf16mw-6.9b-baseline"].iloc[0]
    args = published.setup(h100)
    assert args["cluster"].intra == "auto" and args["cluster"].link().name == "nvlink4"  # not stated: the GPU's own
    assert args["workload"].shape.dropout == 0.0  # the code has no dropout layers: the row says 0
    megatron = published.setup(points[points["point_id"] == "ds-megatron-1.5b"].iloc[0])
    assert megatron["workload"].shape.dropout == 0.1  # not stated: both codes' default
    assert megatron["workload"].shape.vocab == 50304  # Megatron-LM pads to a multiple of 128
    assert megatron["micro_batch"] == 32 and megatron["grad_accum"] == 1  # no micro-batch stated: global / GPUs
    zeropp = published.setup(points[points["point_id"] == "zpp-18b-800g-2k"].iloc[0])
    assert zeropp["micro_batch"] == 4 and zeropp["grad_accum"] == 1  # no global batch stated: micro x GPUs


def test_a_llama_style_row_is_built_from_its_own_columns(tmp_path, points):
    qwen = published.setup(points[points["point_id"] == "zfb-qwen2.5-1.5b-z2"].iloc[0])["workload"].shape
    assert (qwen.arch, qwen.kv_heads, qwen.ffn, qwen.tied) == ("qwen2", 2, 8960, True)
    assert 1.54e9 < qwen.n_params() < 1.55e9  # Qwen2.5-1.5B's 1.54B parameters (its model card)
    edit = {"arch": "qwen2", "ffn": "", "kv_heads": "3", "tied_embeddings": "maybe"}
    with pytest.raises(ValueError) as err:
        published.load(_write(tmp_path, points, edit))
    assert "tied_embeddings must be True or False" in str(err.value)
    with pytest.raises(ValueError, match="shape: a qwen2 transformer needs ffn"):
        published.load(_write(tmp_path, points, {**edit, "tied_embeddings": ""}))
    assert qwen.attention == "sdpa"  # qwen2's default: the kernel transformers loads, as the script did
    fused = published.load(_write(tmp_path, points, {"attention": "sdpa"}))  # a GPT-2 row that ran SDPA
    assert published.setup(fused.iloc[0])["workload"].shape.attention == "sdpa"
    with pytest.raises(ValueError, match=r"ds-megatron-1\.5b: shape: transformer attention must be one of eager, sdpa"):
        published.load(_write(tmp_path, points, {"attention": "flash"}))


def test_a_rows_zero_settings_reach_the_prediction(tmp_path, points):
    dsx = published.setup(points[points["point_id"] == "dsx-bf16mw-6.9b-baseline"].iloc[0])
    assert dsx["zero"] == {"overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": 50_000_000,
                           "stage3_param_persistence_threshold": 0}  # its configs/baseline.json
    assert published.setup(points[points["point_id"] == "zfb-qwen2.5-1.5b-z2"].iloc[0])["zero"] == {}
    zpp = points[points["point_id"] == "zpp-18b-400g-1k"].iloc[0].copy()
    stated = published.compare(points[points["point_id"] == "zpp-18b-400g-1k"])
    zpp["zero"] = ""
    defaults = published.compare(zpp.to_frame().T)
    assert stated["predicted"].iloc[0] != defaults["predicted"].iloc[0]  # 1e7-element reduce buckets, not 5e8
    with pytest.raises(ValueError, match=r"ds-megatron-1\.5b: zero: zero settings refused by DeepSpeed"):
        published.load(_write(tmp_path, points, {"zero": "no_such_setting=1"}))
    with pytest.raises(ValueError, match=r"zero: .*zero_quantized_weights"):
        published.load(_write(tmp_path, points, {"zero": "zero_quantized_weights=true", "stage": "3"}))
    # The row's own offload cell, as it reads ("False" is not offloaded), against an offload alias in its settings.
    with pytest.raises(ValueError, match=r"zero: the zero settings turn the optimizer's offload on"):
        published.load(_write(tmp_path, points, {"zero": "cpu_offload=true", "offload_optimizer": "False"}))
    assert published.load(_write(tmp_path, points, {"zero": "cpu_offload=true", "offload_optimizer": "True"}))[
        "zero"].iloc[0] == "cpu_offload=true"


def test_a_row_without_micro_or_global_batch_is_refused(points):
    row = points.iloc[0].copy()
    row["micro_batch"], row["global_batch"] = float("nan"), float("nan")
    with pytest.raises(ValueError, match="neither micro_batch nor global_batch"):
        published.setup(row)


def _write(tmp_path, points, edit):
    """points.csv with its first row edited (`edit`: column -> cell) and every other row dropped."""
    row = points.iloc[[0]].copy()
    for column, cell in edit.items():
        if cell is None:
            row = row.drop(columns=column)
        else:
            row[column] = cell
    path = tmp_path / "points.csv"
    row.to_csv(path, index=False)
    return path


def test_a_table_of_other_points_gets_every_bad_cell_named_at_once(tmp_path, points):
    path = _write(tmp_path, points, {"gpu": "V200", "stage": "4", "micro_batch": "0", "offload_optimizer": "yes",
                                     "metric": "tflops_per_gpu", "flops_formula": "", "value": "-1"})
    with pytest.raises(ValueError) as err:
        published.load(path)
    text = str(err.value)
    assert "6 problem(s)" in text
    for says in ("unknown GPU 'V200'", "stage must be 0, 1, 2 or 3", "micro_batch must be a whole number >= 1",
                 "offload_optimizer must be True or False", "tflops_per_gpu needs flops_formula", "value must be > 0"):
        assert says in text, says
    assert text.count("ds-megatron-1.5b:") == 6  # each named by its point
    # numbers that do not read: infinity, a fraction where a count belongs; "2.0" reads as 2
    with pytest.raises(ValueError) as err:
        published.load(_write(tmp_path, points, {"value": "inf", "gpus": "64.5", "stage": "1.0"}))
    text = str(err.value)
    assert "2 problem(s)" in text and "value must be a finite number" in text and "gpus must be a whole number" in text


def test_what_combines_cells_is_checked_where_the_cells_it_reads_read(tmp_path, points):
    edit = {"hidden": "1601", "stage": "0", "offload_optimizer": "True", "dropout": "1"}
    with pytest.raises(ValueError) as err:
        published.load(_write(tmp_path, points, edit))
    text = str(err.value)
    assert "2 problem(s)" in text
    assert "shape: hidden (1601) must be a multiple of heads (16)" in text  # the first shape problem stops the shape
    assert "strategy: stage 0 with offload_optimizer" in text
    with pytest.raises(ValueError, match="shape: transformer dropout must be in"):
        published.load(_write(tmp_path, points, {"dropout": "1"}))


def test_one_pass_names_every_problem_of_a_row(tmp_path, points):
    # a cell that does not read and checks that combine other cells, in one pass: only the batch check, which reads
    # the micro-batch of 0, is not run; the cluster names its link and its node count together
    edit = {"hidden": "770", "heads": "12", "gpu": "T4", "gpus": "3", "gpus_per_node": "2", "nodes": "",
            "intra": "nvlink4", "precision": "bf16", "stage": "0", "offload_optimizer": "True", "micro_batch": "0",
            "global_batch": "7", "metric": "samples_per_s", "value": "5"}
    with pytest.raises(ValueError) as err:
        published.load(_write(tmp_path, points, edit))
    text = str(err.value)
    assert "5 problem(s)" in text and "batches:" not in text
    for says in ("micro_batch must be a whole number >= 1", "shape: hidden (770) must be a multiple of heads (12)",
                 "T4 cannot have nvlink4", "gpus 3 is not a multiple of gpus_per_node 2",
                 "strategy: stage 0 with offload_optimizer", "precision: T4 has no bf16"):
        assert says in text, says


def test_a_table_must_have_points_with_names_of_their_own(tmp_path, points):
    two = tmp_path / "two.csv"
    points.iloc[[0, 0, 1]].assign(point_id=["a", "a", ""]).to_csv(two, index=False)
    with pytest.raises(ValueError) as err:
        published.load(two)
    text = str(err.value)
    assert "point_id repeated: a" in text and "row 4: point_id is empty" in text
    points.iloc[[]].to_csv(tmp_path / "none.csv", index=False)
    with pytest.raises(ValueError, match="no points"):
        published.load(tmp_path / "none.csv")


def test_a_point_on_many_nodes_without_its_network_is_refused(tmp_path, points):
    path = _write(tmp_path, points, {"inter_gbps": ""})
    with pytest.raises(ValueError, match="more than one node needs inter_gbps"):
        published.load(path)
    with pytest.raises(ValueError, match=r"gpus 64 != gpus_per_node 16 x nodes 3"):
        published.load(_write(tmp_path, points, {"nodes": "3"}))
    with pytest.raises(ValueError) as err:
        published.load(_write(tmp_path, points, {"intra": "nvlink9", "precision": "bf16"}))
    text = str(err.value)
    assert "cluster: unknown link 'nvlink9'" in text and "precision: V100-32GB has no bf16 tensor-core peak" in text
    with pytest.raises(ValueError, match="missing column"):
        published.load(_write(tmp_path, points, {"value": None}))
    # a link the GPU kind cannot have, and a misspelt column (its cells would otherwise fall to a rule's default)
    with pytest.raises(ValueError, match="V100-32GB cannot have pcie5"):
        published.load(_write(tmp_path, points, {"intra": "pcie5"}))
    with pytest.raises(ValueError, match=r"unknown column.*'micro_bach'"):
        published.load(_write(tmp_path, points, {"micro_batch": None, "micro_bach": "4"}))


def test_a_point_published_in_tokens_is_checked_as_its_samples(tmp_path, points):
    row = points.iloc[0]
    assert row["metric"] == "samples_per_s"
    samples, seq, gpus = float(row["value"]), int(row["seq"]), int(row["gpus"])
    errors = [published.compare(published.load(_write(tmp_path, points, edit)))["error"].iloc[0] for edit in (
        {}, {"metric": "tokens_per_s", "value": str(samples * seq)},
        {"metric": "tokens_per_s_per_gpu", "value": str(samples * seq / gpus)})]
    assert errors[1] == pytest.approx(errors[0]) and errors[2] == pytest.approx(errors[0])


def test_empty_and_absent_optional_cells_are_filled_by_the_rules(tmp_path, points):
    # one node, the network and node count left empty, the optional columns absent
    edit = {"gpus": "16", "nodes": "", "inter_gbps": "", "global_batch": "512", "offload_optimizer": None,
            "intra": None, "dropout": None, "notes": None, "model": None, "code": None,
            "activation_checkpointing": None}
    row = published.load(_write(tmp_path, points, edit)).iloc[0]
    assert row["nodes"] == 1 and row["inter_gbps"] == 0.0 and str(row["offload_optimizer"]) == "False"
    args = published.setup(row)
    assert args["cluster"].world_size == 16 and args["strategy"] == "z1"
    assert (args["micro_batch"], args["grad_accum"]) == (32, 1)
    assert args["workload"].shape.vocab == 50257  # no code given: not padded as Megatron-LM's
    compared = published.compare(published.load(_write(tmp_path, points, edit)))
    assert compared["predicted"].iloc[0] > 0
    with pytest.raises(ValueError, match="global_batch 500 is not micro_batch 32 x accumulation x gpus 16"):
        published.load(_write(tmp_path, points, {**edit, "global_batch": "500", "micro_batch": "32"}))


@pytest.mark.slow  # two benchmark processes (~5 s each)
def test_the_benchmark_checks_a_table_of_other_points(tmp_path, points):
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_predict.py"
    good = tmp_path / "good.csv"
    points.iloc[[0, 2]].to_csv(good, index=False)
    run = subprocess.run([sys.executable, str(bench), "--points", str(good), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "ds-megatron-1.5b" in run.stdout and "ds-offload-10b" in run.stdout and "2 points" in run.stdout
    # the file's check alone: the checks that do not depend on it are not printed
    assert "GEMM roofline" not in run.stdout and "The lab's runs on a GPU" not in run.stdout
    # ... which the benchmark without --points prints: the lab's own H100 and H200 points
    # (data/reference-*/answer-partial), each predicted from its config, and calibrated on the other run of
    # its strategy where there is one (calibrate.gpu_comparison), one row per training (not per learning rate)
    from labkit.study.calibrate import gpu_comparison

    gpu_rows = gpu_comparison(bench.parents[1] / "data")
    h100 = gpu_rows[gpu_rows["gpu"] == "H100-SXM"]
    assert len(h100) == 3 and set(h100["strategy"]) == {"torch", "z0"}
    assert list(h100["calibrated_on_micro_batch"].fillna(0)) == [4096, 512, 0]
    h200 = gpu_rows[gpu_rows["gpu"] == "H200-SXM"]
    assert set(h200["strategy"]) == {"torch", "z0", "z2", "z3", "z2-offload"}
    assert not h200.duplicated(["strategy", "micro_batch", "grad_accum"]).any()  # the LR study's reruns: once
    bad = _write(tmp_path, points, {"precision": "fp8"})
    run = subprocess.run([sys.executable, str(bench), "--points", str(bad)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 2 and "precision must be one of fp16, bf16, fp32, got 'fp8'" in run.stderr
    assert "Published GPU points" not in run.stdout  # refused before anything is predicted

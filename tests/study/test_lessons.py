"""The pure helpers the lesson notebooks call (no runs launched): samplers, DeepSpeed's
sharded loader, the deepspeed preset, `lessons.check` and the figures."""

from __future__ import annotations

import pandas as pd
import pytest

from labkit import RunConfig
from labkit.models.data import make_dataset, make_sampler
from labkit.study import figures, lessons


def test_deepspeed_example_takes_the_stage_given_and_turns_nothing_on():
    config = RunConfig(example="deepspeed", stage=1, world_size=1)
    assert (config.stage, config.offload_optimizer) == (1, False)
    assert RunConfig(example="deepspeed").stage == 0
    assert config.ds_config()["zero_optimization"] == {"stage": 1}


def test_make_sampler_modes():
    dataset = make_dataset(64, 3, 2, seed=0)
    shards = [set(make_sampler(dataset, distributed_sampler=True, world_size=2, rank=r, seed=0)[0]) for r in (0, 1)]
    assert not shards[0] & shards[1] and len(shards[0] | shards[1]) == 64
    own = [list(make_sampler(dataset, distributed_sampler=False, world_size=2, rank=r, seed=0)[0]) for r in (0, 1)]
    assert own[0] != own[1] and sorted(own[0]) == list(range(64))
    same = [list(make_sampler(dataset, distributed_sampler=False, world_size=2, rank=r, seed=0,
                              same_seed_every_rank=True)[0]) for r in (0, 1)]
    assert same[0] == same[1]


def test_sampler_overlap_counts_distinct_samples_per_global_batch():
    table = lessons.sampler_overlap(256, 16, 4, steps=3)
    worth = table.groupby("mode")["micro-batches' worth"].mean()
    assert worth["DistributedSampler"] == 4
    assert worth["no sampler, same seed on every rank"] == 1
    assert 1 < worth["no sampler, seed per rank"] <= 4


def test_deepspeed_training_data_loader_shards():
    shards = lessons.deepspeed_loader_shards(100, 4, 5)
    assert (shards["sampler"] == "DistributedSampler").all()
    assert (shards["samples per epoch"] == 25).all() and (shards["shared with another rank"] == 0).all()


@pytest.mark.parametrize("call,message", [
    # A dataset smaller than micro-batch x ranks x steps: a bare StopIteration before.
    (lambda: lessons.sampler_overlap(16, 64, 2), r"dataset_size must be >= micro_batch x world_size x steps = "
                                                r"64 x 2 x 4 = 512 .*got 16"),
    (lambda: lessons.sampler_overlap(256, 16, 0), r"world_size must be a whole number >= 1, got 0"),  # rows of zeros
    (lambda: lessons.sampler_overlap(256, 16, -2), r"world_size must be a whole number >= 1, got -2"),
    (lambda: lessons.sampler_overlap(256, 0, 2), r"micro_batch must be a whole number >= 1, got 0"),
    (lambda: lessons.sampler_overlap(256, 16, 2, steps=0), r"steps must be a whole number >= 1, got 0"),
    (lambda: lessons.sampler_overlap("256", 16, 2), r"dataset_size must be a whole number >= 1 and <= 10,000,000, "
                                                   r"got '256'"),
    # 4 TB of samples asked for, the machine swapping before a MemoryError
    (lambda: lessons.sampler_overlap(10**12, 16, 2), r"dataset_size must be a whole number >= 1 and <= 10,000,000, "
                                                    r"got 1000000000000"),
    (lambda: lessons.deepspeed_loader_shards(10**12, 4, 5), r"dataset_size .* <= 10,000,000, got 1000000000000"),
    (lambda: lessons.deepspeed_loader_shards(1024, 0, 8), r"world_size must be a whole number >= 1, got 0"),  # KeyError
    (lambda: lessons.deepspeed_loader_shards(100, 4, 0), r"micro_batch must be a whole number >= 1, got 0"),  # ZeroDiv.
    (lambda: lessons.deepspeed_loader_shards(0, 4, 5), r"dataset_size must be a whole number >= 1 .*got 0"),  # zeros
    (lambda: lessons.deepspeed_batch_check({"train_batch_size": "64"}, 1),  # DeepSpeed's TypeError before
     r"ds_config\['train_batch_size'\] must be an integer \(or absent\), got '64'"),
    (lambda: lessons.deepspeed_batch_check({"train_batch_size": 64}, 0),
     r"world_size must be a whole number >= 1, got 0"),
])
def test_lesson_helpers_refuse_sizes_out_of_range_naming_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_lesson_helpers_take_the_smallest_sizes_in_range():
    assert len(lessons.sampler_overlap(16, 4, 2, steps=2)) == 6  # exactly 2 global batches: 3 modes x 2 steps
    assert lessons.deepspeed_batch_check({"train_batch_size": 64, "train_micro_batch_size_per_gpu": None}, 1) \
        .startswith("DeepSpeed accepts it")
    # a key of 0: DeepSpeed divides by it before its own assertions; said, as the ranks would fail, not raised here
    assert lessons.deepspeed_batch_check({"train_batch_size": 64, "gradient_accumulation_steps": 0}, 1) \
        .startswith("DeepSpeed fails on it: ZeroDivisionError")


def test_check_prints_or_raises_in_the_ci_profile(capsys, monkeypatch):
    monkeypatch.setenv("LABKIT_PROFILE", "ci")
    lessons.check(True, "it holds")
    assert capsys.readouterr().out == "Check: it holds -- holds\n"
    with pytest.raises(AssertionError, match="Check failed: it does not"):
        lessons.check(False, "it does not", {"detail": 1})


def test_a_failed_check_warns_and_goes_on_outside_ci(capsys, monkeypatch):
    """A workshop's Run All never halts on a number measured otherwise: the claim, the measured detail and
    "this came out differently on your machine", and the notebook goes on."""
    monkeypatch.setenv("LABKIT_PROFILE", "full")
    lessons.check(False, "ZeRO-3 fits more", pd.DataFrame({"fits": [3, 2]}))  # no exception: it goes on
    out = capsys.readouterr().out
    assert "this came out differently on your machine" in out and "ZeRO-3 fits more" in out and "fits" in out
    # The ci profile on a GPU is no CI run of the reference numbers either.
    from labkit.runtime import devices

    gpu = devices.Devices(accelerator="cuda", device_count=1, max_ranks=1, backend="nccl", bf16=True, fp16=True,
                          device_name="NVIDIA L4", total_memory_bytes=24 * 2**30)
    monkeypatch.setattr(devices, "detect_devices", lambda: gpu)
    monkeypatch.setenv("LABKIT_PROFILE", "ci")
    assert lessons.strict_checks() is False
    lessons.check(False, "a CPU number")
    assert "this came out differently on your machine" in capsys.readouterr().out


def test_check_group_folds_what_holds_but_not_what_does_not(capsys, monkeypatch):
    monkeypatch.setenv("LABKIT_PROFILE", "full")
    with lessons.check_group("More checks"):
        lessons.check(True, "one")
        lessons.check(False, "two", "measured 3")
        lessons.check(True, "three")
    out = capsys.readouterr().out
    # The warning is shown at once; the passing checks come together at the end of the block.
    assert out.index("two") < out.index("Check: one -- holds") < out.index("Check: three -- holds")
    monkeypatch.setenv("LABKIT_PROFILE", "ci")
    with pytest.raises(AssertionError, match="two"), lessons.check_group("More checks"):
        lessons.check(False, "two")
    lessons.reveal("Answer", "first\n\nsecond")
    assert capsys.readouterr().out.endswith("Answer: first\n\nsecond\n")


def test_zero3_tensors_match_the_persistence_rule():
    tensors = lessons.zero3_tensors(RunConfig(example="zero3", hidden=1024, depth=2))
    assert tensors.loc[~tensors["persistent"], "module"].unique().tolist() == ["layers.0", "layers.2"]
    higher = lessons.zero3_tensors(RunConfig(example="zero3", hidden=1024, depth=2), threshold=200_000)
    assert higher.loc[~higher["persistent"], "module"].unique().tolist() == ["layers.2"]


def test_reuse_kept_gathered_follows_deepspeeds_look_ahead():
    tensors = lessons.zero3_tensors(RunConfig(example="zero3", hidden=1024, depth=2))
    kept = {distance: lessons.reuse_kept_gathered(tensors, distance).to_dict() for distance in (0, 500_000, 10**9)}
    assert kept[0] == {"layers.0": False, "layers.2": False}  # every module gathered again for its backward
    assert kept[500_000] == {"layers.0": False, "layers.2": True}  # 03's exercise: the 1M-element layer lies between
    assert kept[10**9] == {"layers.0": True, "layers.2": True}  # DeepSpeed's default
    # The default keeps a model whole only below about 0.5B parameters (twice what follows the first layer):
    # 03's full profile (471M) stays whole, one more 8192-wide layer (538M) releases the first.
    full = lessons.zero3_tensors(RunConfig(example="zero3", hidden=8192, depth=8, precision="bf16"))
    deeper = lessons.zero3_tensors(RunConfig(example="zero3", hidden=8192, depth=9, precision="bf16"))
    assert full["elements"].sum() < 0.5e9 < deeper["elements"].sum()
    assert lessons.reuse_kept_gathered(full, 10**9).all()
    assert not lessons.reuse_kept_gathered(deeper, 10**9)["layers.0"]
    assert lessons.reuse_kept_gathered(deeper, 10**9).drop("layers.0").all()


@pytest.mark.parametrize(("precision", "up"), [("fp32", 4), ("bf16", 2)])
def test_offload_traffic_sends_fp32_gradients_down_and_parameters_up_in_the_training_dtype(tmp_path, precision, up):
    import json

    from labkit import Run

    run = Run(RunConfig(example="offload", precision=precision, world_size=1))
    run.run_dir = tmp_path
    census = {"event": "step", "step": 1, "param_bytes": up * 1000, "optim_bytes": 8 * 1000}  # Adam: 8 B/element
    (tmp_path / "rank0.jsonl").write_text(json.dumps(census) + "\n")
    traffic = lessons.offload_traffic(run)
    assert traffic == {"partition_elements": 1000, "to_host_bytes": 4 * 1000, "to_device_bytes": up * 1000}


def _closing_decorator(function):  # as DeepSpeed's instrument_w_nvtx: no functools.wraps, no __wrapped__
    def wrapped_fn(*args, **kwargs):
        return function(*args, **kwargs)
    return wrapped_fn


@_closing_decorator
def _decorated(x):
    y = x + 1  # the line to find
    return y


def test_source_line_finds_a_line_through_decorators_with_and_without_wraps():
    import inspect
    import re

    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    found = lessons.source_line(_decorated, "y = x + 1")
    lines, first = inspect.getsourcelines(_decorated.__closure__[0].cell_contents)
    number = first + next(i for i, line in enumerate(lines) if "y = x + 1" in line)
    assert re.fullmatch(rf"\S*tests/study/test_lessons.py:{number}: y = x \+ 1  # the line to find", found), found
    # A DeepSpeed method under instrument_w_nvtx, as notebook 02 cites it.
    line = lessons.source_line(DeepSpeedZeroOptimizer_Stage3._offload_grad_partition_at_boundary,
                               "fp32_grad_tensor.copy_(")
    assert line.startswith("runtime/zero/stage3.py:") and "master_weights_and_grads_dtype" in line
    with pytest.raises(ValueError, match="another DeepSpeed version"):
        lessons.source_line(_decorated, "not in there")


def test_zero_partition_figure_one_bar_per_stage_and_rank():
    rows = pd.DataFrame([{"stage": s, "rank": r, "param_MiB": 4.0 / (2 if s == 3 else 1), "grad_MiB": 4.0,
                          "optim_MiB": 8.0, "master_MiB": 0.0} for s in (0, 3) for r in (0, 1)])
    fig = figures.zero_partition_figure(rows)
    assert [trace.name for trace in fig.data] == ["parameters", "gradients", "optimizer states", "fp32 master"]
    assert list(fig.data[0].x[0]) == ["stage 0", "stage 0", "stage 3", "stage 3"]
    assert list(fig.data[0].y) == [4.0, 4.0, 2.0, 2.0]


def test_holdings_figure_splits_host_parts():
    held = pd.DataFrame({"param_MiB": [1.0, 1.0], "grad_MiB": [1.0, 1.0], "optim_MiB": [2.0, 2.0],
                         "master_MiB": [1.0, 1.0], "host_optim_MiB": [0.0, 3.0], "host_grad_MiB": [0.0, 1.0]},
                        index=["plain", "offload"])
    bars = {trace.name: list(trace.y) for trace in figures.holdings_figure(held).data}
    assert bars["optimizer states + fp32 master"] == [3.0, 0.0]
    assert bars["optimizer states + fp32 master, on the host"] == [0.0, 3.0]
    assert bars["gradients, on the host"] == [0.0, 1.0]


def test_capacity_figure_draws_the_fit_through_the_probes():
    from labkit.study.maxbatch import MaxBatchResult, Probe

    mib = 2**20
    # 10 MiB of model states, 1 MiB per step plus 0.5 MiB per sample of activations.
    probes = [Probe(b, "finished", 10 * mib + mib + b * mib // 2, mib + b * mib // 2, None, False) for b in (4, 8)]
    probes.append(Probe(40, "oom", 31 * mib, None, None, False))
    result = MaxBatchResult(strategy="pytorch", world_size=1, budget_bytes=30 * mib, emulated=True,
                            max_micro_batch=8, first_oom=40, probes=probes)
    assert result.predicted_max_micro_batch == 38
    traces = {trace.name: trace for trace in figures.capacity_figure(result, 30 * mib, emulated=True).data}
    fit = traces["model states + activation fit"]
    assert fit.y[0] == pytest.approx(11.0)
    assert fit.y[1] == pytest.approx(11.0 + 0.5 * fit.x[1])
    assert list(traces["out of memory (bytes counted when it failed)"].x) == [40]


def test_curve_gap_and_loss_curves_mark_a_divergence():
    import math

    curves = pd.DataFrame([{"run": run, "samples": s, "eval_loss": loss}
                           for run, losses in {"a": [2.0, 1.0, 0.5], "b": [2.0, 1.1, 0.55],
                                               "c": [2.0, float("inf"), float("nan")]}.items()
                           for s, loss in zip((256, 512, 768), losses, strict=True)])
    assert lessons.curve_gap(curves, "a", "a") == 0.0
    assert lessons.curve_gap(curves, "a", "b") == pytest.approx(2 / 3 * abs(math.log(1 / 1.1)))
    assert lessons.curve_gap(curves, "a", "c") == float("inf")
    fig = figures.loss_curves(curves, title="t")
    assert [trace.name for trace in fig.data] == ["a", "b", "c (diverged)"]
    assert list(fig.data[2].x) == [256]  # only the finite point is drawn
    assert "from 512 samples" in fig.layout.annotations[0].text


def test_lr_lessons_build_comparable_runs():
    sgd = lessons.sgd_scaling_configs("mlp")
    base, linear, kept = sgd.values()
    assert {c.optimizer for c in sgd.values()} == {"sgd"}
    assert linear.global_batch == kept.global_batch == 4 * base.global_batch
    assert linear.peak_lr == pytest.approx(4 * base.peak_lr) and kept.peak_lr == base.peak_lr
    # The same samples, measured at the same sample counts.
    assert len({c.steps * c.global_batch for c in sgd.values()}) == 1
    assert len({c.eval_every * c.global_batch for c in sgd.values()}) == 1
    cold, warm = lessons.warmup_configs("mlp").values()
    assert cold.peak_lr == warm.peak_lr and cold.warmup_steps_effective == 0 < warm.warmup_steps_effective
    with pytest.raises(ValueError, match="no LR lesson settings"):
        lessons.sgd_scaling_configs("resnet")


@pytest.mark.slow
def test_launch_all_shows_one_bar_over_the_runs_and_each_runs_step_and_status(runs_root, capsys):
    import io

    stream = io.StringIO()
    ok = RunConfig(example="zero3", world_size=2, micro_batch=8, steps=3, hidden=32, dataset_size=256)
    bad = RunConfig(example="zero3", world_size=2, micro_batch=8, steps=3, hidden=32, dataset_size=256,
                    device_memory_budget_bytes=1000)  # the emulated capacity: out of memory at step 1
    runs = lessons.launch_all({"small": ok, "too big": bad}, file=stream)
    assert {label: run.status for label, run in runs.items()} == {"small": "finished", "too big": "oom"}
    text = stream.getvalue().replace("\r", "\n")  # tqdm redraws a text bar in place
    assert "runs: 100%" in text and "2/2" in text
    assert any(line.startswith("small: 100%") and "3/3" in line and "finished" in line for line in text.splitlines())
    assert any(line.startswith("too big:") and "oom: rank" in line for line in text.splitlines())
    assert "initializing" in text or "first step" in text or "step 1/3" in text  # the phase before the end
    assert "2 run(s) in" in capsys.readouterr().out


@pytest.mark.slow
def test_build_ops_streams_the_builds_output_under_a_bar():
    import io

    from labkit.runtime.ops import BUILDERS

    stream = io.StringIO()
    built = lessons.build_ops(file=stream)
    text = stream.getvalue()
    if "CUDA ops not built" in text:
        pytest.skip("a GPU without an nvcc matching torch: nothing to build (labkit.runtime.ops)")
    for name in BUILDERS:  # each builder's line, as the child printed it (built, loaded from the cache, or skipped)
        line = next(line for line in text.splitlines() if line.startswith(f"{name}: ") and ("ready in" in line
                                                                                          or "skipped" in line))
        assert line in built
    assert "DeepSpeed ops: 100%|" in text.replace("\r", "\n")


def test_skipped_multi_rank_names_what_one_gpu_skips_and_why():
    from labkit.runtime.devices import Devices

    one_gpu = Devices("cuda", 1, 1, "nccl", True, True, "NVIDIA H100 80GB HBM3", 80 * 2**30)
    text = lessons.skipped_multi_rank([1, 2, 4], parts=("section 2's runs", "section 5's link fit"), devices=one_gpu)
    assert text is not None and "the runs on 2, 4 ranks are skipped (one rank per GPU)" in text
    assert "section 2's runs; section 5's link fit" in text and "Run this notebook on 2+ GPUs" in text
    two_gpus = Devices("cuda", 2, 2, "nccl", True, True, "NVIDIA H100 80GB HBM3", 80 * 2**30)
    capped = lessons.skipped_multi_rank([1, 2, 4], parts=("section 2's runs",), devices=two_gpus)
    assert capped is not None and "4 ranks are skipped" in capped and "section 2" not in capped  # 2 ranks still run
    assert lessons.skipped_multi_rank([2], parts=("anything",), devices=two_gpus) is None


def test_comm_log_splits_steps_at_deepspeeds_step_lines_not_at_millisecond_stamps(tmp_path):
    """Notebook 03 failed now and then (3 all-gathers counted, not 4): a step's first all-gather, logged in
    the millisecond its previous step's record ended, was counted in that step. DeepSpeed's "step=N" lines
    (steps_per_print 1) sit in the same log, in order."""
    import datetime
    import json

    from labkit import Run

    assert lessons.comms_logger_overrides()["steps_per_print"] == 1
    config = RunConfig(example="zero3", world_size=1, steps=2, hidden=32)
    (tmp_path / "logs").mkdir()
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    t0 = 1_800_000_000.0
    records = [{"event": "start", "time_s": 0.0, "wall_time": t0}, {"event": "ready", "time_s": 1.0},
               {"event": "step", "step": 1, "time_s": 1.0205}, {"event": "step", "step": 2, "time_s": 1.0404}]
    (tmp_path / "rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    def line(at: float, text: str) -> str:
        stamp = datetime.datetime.fromtimestamp(t0 + at).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]  # ms, as logging
        return f"[{stamp}] [INFO] [logging.py:123:log_dist] [Rank 0] {text}\n"

    def op(at: float, name: str) -> str:
        return line(at, f"comm op: {name} | [Caller Func: f] | time (ms): 0.10 | msg size: 4.0 KB | algbw (Gbps): 1")

    log = (line(0.9, "step=0, skipped=0, lr=[0.001], mom=[(0.9, 0.999)]") + op(0.95, "broadcast")
           + op(1.005, "all_gather_into_tensor") + op(1.010, "reduce_scatter_tensor")
           + op(1.0203, "all_gather_into_tensor")  # step 1's post-step gather
           + line(1.0205, "step=1, skipped=0, lr=[0.001], mom=[(0.9, 0.999)]")
           + op(1.0207, "all_gather_into_tensor")  # step 2's first: the same millisecond as step 1's record
           + op(1.030, "reduce_scatter_tensor") + line(1.0404, "step=2, skipped=0, lr=[0.001], mom=[(0.9, 0.999)]"))
    (tmp_path / "logs" / "20261124000000_rank0.log").write_text(log)
    phases = lessons.comm_log(Run.load(tmp_path))["phase"].tolist()
    assert phases == ["setup", 1, 1, 1, 2, 2]
    # The same log without DeepSpeed's step lines: by timestamp, step 2's first all-gather lands in step 1.
    (tmp_path / "logs" / "20261124000000_rank0.log").write_text("".join(
        text for text in log.splitlines(keepends=True) if "step=" not in text))
    assert lessons.comm_log(Run.load(tmp_path))["phase"].tolist() == ["setup", 1, 1, 1, 1, 2]


def test_line_chart_draws_one_column_given_by_name_and_refuses_a_misspelled_one():
    table = pd.DataFrame({"world_size": [1, 2, 4], "median_step_time_s": [0.1, 0.2, 0.3]})
    fig = lessons.line_chart(table, "world_size", "median_step_time_s", title="t", yaxis="s")
    assert [trace.name for trace in fig.data] == ["median_step_time_s"]  # a string is one column, not 18 letters
    with pytest.raises(ValueError, match=r"no column 'median_step_time' in the table; it has \['world_size', "):
        lessons.line_chart(table, "world_size", ["median_step_time"], title="t", yaxis="s")  # an empty chart before
    with pytest.raises(ValueError, match=r"no column 'worldsize'"):
        lessons.line_chart(table, "worldsize", ["median_step_time_s"], title="t", yaxis="s")

"""The answer made trustworthy: fair timing, both ways to grow the batch, credit where it is due,
time to the same held-out loss. Pure checks first, then one real end-to-end `answer --profile smoke`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd
import pytest

from labkit import RunConfig
from labkit.core.config import ConfigError
from labkit.study.sweep import Sweep, UnfairTiming, check_fair, fair_parallel, plan


# -- fair timing ------------------------------------------------------------------------------------
def test_fair_parallel_counts_threads_ranks_and_devices():
    two_ranks = plan(["z0"], [32], [2], base=dict(hidden=32, dataset_size=512))
    # Default threads: cores // ranks, so one 2-rank run fills the machine.
    assert fair_parallel(two_ranks, cores=8) == 1
    one_thread = plan(["z0"], [32], [2], base=dict(hidden=32, dataset_size=512, threads_per_rank=1))
    assert fair_parallel(one_thread, cores=8) == 4
    check_fair(one_thread, 4, cores=8)
    with pytest.raises(UnfairTiming, match="at most 4 at a time"):
        check_fair(one_thread, 5, cores=8)
    # GPU: one run per device set.
    assert fair_parallel(two_ranks, cores=8, devices=8, is_cpu=False) == 4
    with pytest.raises(UnfairTiming, match="2 ranks on 2 devices"):
        check_fair(two_ranks, 2, cores=64, devices=2, is_cpu=False)


def test_a_timed_sweep_that_would_oversubscribe_is_refused_before_launching(tmp_path):
    points = plan(["z0", "z3"], [32], [2], base=dict(hidden=32, dataset_size=512))
    with pytest.raises(UnfairTiming, match="share the machine"):
        Sweep(points, tmp_path / "sweep", parallel=2, progress=False)
    assert not (tmp_path / "sweep").exists()
    Sweep(points, tmp_path / "untimed", parallel=2, progress=False, timed=False)  # memory probes may overlap


def test_answer_refuses_unfair_parallel_before_anything_starts(tmp_path):
    from labkit.study.answer import answer

    with pytest.raises(UnfairTiming):
        answer("smoke", tmp_path / "out", parallel=(os.cpu_count() or 1) + 1, progress=False)
    assert not (tmp_path / "out").exists()


def test_no_profiles_point_trains_on_the_whole_dataset_a_step_and_the_answer_refuses_one(tmp_path, monkeypatch):
    """On an H200 the workshop profile's x16 accumulation made the global batch 65,536, its whole dataset: a step an
    epoch, the held-out loss rose from 0.87 to 6.8 while the training loss went to 2e-7, the target never reached
    (data/reference-h200/). No profile has such a point on the machines it is meant for; one is refused at once."""
    import dataclasses

    from labkit.runtime import devices as devices_module
    from labkit.runtime.devices import Devices
    from labkit.study import answer as answer_module
    from labkit.study.answer_profiles import GPT_MODELS, with_model

    for name, profile in answer_module.PROFILES.items():
        for model in (None, "gpt") if name in GPT_MODELS else (None,):
            sized = with_model(profile, model)
            if profile.world_sizes is not None:  # CPU profiles: their own ranks
                assert answer_module.whole_dataset_points(answer_module.points(sized)) == [], (name, model)
                continue
            for gpus in (1, 2, 4, 8):  # GPU profiles: every device of a node
                stand_in = Devices("cuda", gpus, gpus, "nccl", True, True, "NVIDIA H200", 141 * 2**30)
                monkeypatch.setattr(devices_module, "detect_devices", lambda d=stand_in: d)
                assert answer_module.whole_dataset_points(answer_module.points(sized)) == [], (name, model, gpus)
    monkeypatch.undo()
    old = dataclasses.replace(answer_module.PROFILES["smoke"], accum_growth=(1, 2, 64))  # 8 x 64 x 2 = 1024
    monkeypatch.setitem(answer_module.PROFILES, "smoke", old)
    with pytest.raises(ConfigError, match=r"whole dataset \(1024 samples\) or more.*8 x 64 x 2 ranks"):
        answer_module.answer("smoke", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


# -- three ways to grow the batch -------------------------------------------------------------------
def test_ci_points_grow_the_batch_three_ways_and_share_a_point():
    from labkit.study.answer import PROFILES, growth_of, points

    profile = PROFILES["ci"]
    configs = points(profile)
    tags = {(c.example, c.stage, bool(c.offload_optimizer), c.world_size, c.micro_batch, c.grad_accum, c.lr_scaling):
            growth_of(c, profile) for c in configs}
    # More ranks at micro-batch 64 per rank: 1 and 2 ranks; the 2-rank point is also on the micro-batch grid
    # and the accumulation series' first point.
    assert tags[("zero3", 0, False, 1, 64, 1, "sqrt")] == "ranks"
    assert tags[("zero3", 0, False, 2, 64, 1, "sqrt")] == "grad_accum+micro_batch+ranks"
    assert tags[("zero3", 3, False, 1, 64, 1, "sqrt")] == "ranks"
    # More accumulation at micro-batch 64 on 2 ranks: 1, 4, 16 for stage 0, ZeRO-2 and ZeRO-3.
    for stage in (0, 2, 3):
        assert [tags[("zero3", stage, False, 2, 64, a, "sqrt")] for a in (4, 16)] == ["grad_accum"] * 2
    assert tags[("zero3", 2, False, 2, 64, 1, "sqrt")] == "grad_accum+micro_batch"
    # Plain PyTorch at the same per-rank micro-batches as the 2-rank grid (one process).
    assert {c.micro_batch for c in configs if c.example == "pytorch"} == {16, 64, 256}
    # The LR study at seven global batches, 32-2048, past the grid's largest micro-batch by accumulation
    # (at 256 per rank, which the grid ran); its points off the grid grow no way of the card's.
    study = {(c.global_batch, c.lr_scaling): (c.micro_batch, c.grad_accum) for c in configs
             if c.stage == 0 and c.world_size == 2 and (c.micro_batch != 64 or c.grad_accum == 1)}
    assert set(study) == {(b, s) for b in (32, 64, 128, 256, 512, 1024, 2048) for s in ("none", "linear", "sqrt")}
    assert study[(2048, "none")] == (256, 4) and study[(256, "linear")] == (128, 1)
    assert tags[("zero3", 0, False, 2, 256, 4, "none")] == "" and tags[("zero3", 0, False, 2, 32, 1, "sqrt")] == ""
    # Every timed CPU rank gets cores // 2 threads: one 2-rank run fills a 2-core machine.
    assert {c.threads_per_rank for c in configs} == {max(1, (os.cpu_count() or 1) // 2)}
    assert all(c.eval_every and c.warmup_samples and not c.warmup_steps for c in configs)


# -- warmup in samples ------------------------------------------------------------------------------
def test_warmup_in_samples_is_the_same_share_of_data_at_every_batch():
    base = dict(example="pytorch", dataset_size=4096, lr=1e-3, base_batch=64, warmup_samples=512)
    small, big = RunConfig(micro_batch=32, **base), RunConfig(micro_batch=256, **base)
    assert small.warmup_steps_effective == 16 and big.warmup_steps_effective == 2
    assert small.lr_at(8) == pytest.approx(small.peak_lr / 2) and big.lr_at(1) == pytest.approx(big.peak_lr / 2)
    assert RunConfig(micro_batch=32, **{**base, "warmup_samples": 0}, warmup_steps=4).warmup_steps_effective == 4
    with pytest.raises(ConfigError, match="warmup_samples"):
        RunConfig(micro_batch=32, warmup_steps=4, **base)


def test_eval_set_is_held_out_and_labelled_by_the_same_teacher():
    import torch

    from labkit.models.data import make_dataset, make_eval_set

    train = make_dataset(256, 100, 10, 0)
    held = make_eval_set(128, 256, 100, 10, 0)
    assert torch.equal(held.tensors[0], make_eval_set(128, 256, 100, 10, 0).tensors[0])  # fixed
    assert not any(torch.equal(x, train.tensors[0][0]) for x in held.tensors[0])
    # Same teacher: a point of the training set, relabelled through the eval path, gets its label.
    from labkit.models.data import _inputs_and_teacher, _labels

    _, w1, w2 = _inputs_and_teacher(256, 100, 10, 0)
    assert torch.equal(_labels(train.tensors[0], w1, w2), train.tensors[1])
    assert len(set(held.tensors[1].tolist())) > 1


# -- critical batch ---------------------------------------------------------------------------------
def test_weighted_critical_batch_fit_with_a_bootstrap_interval():
    from labkit.study.noise_scale import critical_batch_fit

    s_min, b_crit = 40.0, 256.0
    batches = [32, 64, 128, 256, 512]
    exact = critical_batch_fit(batches, [s_min * (1 + b_crit / b) for b in batches])
    assert exact["b_crit"] == pytest.approx(b_crit) and exact["s_min"] == pytest.approx(s_min)
    assert exact["b_crit_low"] == pytest.approx(b_crit) == exact["b_crit_high"]  # no residuals, no spread
    noisy = critical_batch_fit(batches, [s * f for s, f in zip([s_min * (1 + b_crit / b) for b in batches],
                                                               (1.08, 0.93, 1.05, 0.95, 1.06), strict=True)])
    assert noisy["b_crit_low"] < noisy["b_crit"] < noisy["b_crit_high"]
    assert noisy["b_crit_low"] < b_crit < noisy["b_crit_high"]
    assert critical_batch_fit([64], [10]) is None
    assert "b_crit_low" not in critical_batch_fit([64, 128], [100, 60])  # two points: exact, no interval


def test_noise_scale_spread_over_the_run():
    from labkit.study.noise_scale import noise_scale_spread

    # B_simple = trace / g2; early probes have B ~ 50, late ones B ~ 200.
    def probe(b_simple):
        g2, trace = 1.0, b_simple
        return (g2 + trace / 16, g2 + trace / 32, 16, 32)

    spread = noise_scale_spread([probe(50)] * 4 + [probe(200)] * 4, parts=2)
    assert spread["b_simple_parts"] == pytest.approx([50, 200])
    assert spread["b_simple_low"] == pytest.approx(50) and spread["b_simple_high"] == pytest.approx(200)
    assert spread["b_simple"] == pytest.approx(125)
    with pytest.raises(ValueError, match="parts must be a whole number >= 1, got 0"):  # a ZeroDivisionError before
        noise_scale_spread([probe(50)] * 4, parts=0)


# -- credit where it is due -------------------------------------------------------------------------
def _two_way_results(z3_factor: float = 1.0) -> pd.DataFrame:
    """Stage 0 and ZeRO-3 whose time to target falls 4x with the batch, ZeRO-3 a bit slower per step."""
    rows = []

    def row(strategy, growth, ranks, micro, step, steps):
        rows.append({"strategy": strategy, "growth": growth, "world_size": ranks, "micro_batch": micro,
                     "grad_accum": 1, "global_batch": ranks * micro, "lr_scaling": "sqrt", "status": "finished",
                     "median_step_time_s": step, "time_per_epoch_s": step * 8192 / (ranks * micro),
                     "steps_to_target": steps, "threads_per_rank": 1, "concurrent_runs": 0})

    for strategy, slow in (("z0", 1.0), ("z3", 1.3)):
        row(strategy, "micro_batch", 2, 16, 0.010 * slow, 200)
        row(strategy, "micro_batch+ranks", 2, 64, 0.020 * slow, 60)
        row(strategy, "micro_batch", 2, 256, 0.040 * slow * (z3_factor if strategy == "z3" else 1), 25)
        row(strategy, "ranks", 1, 64, 0.020 * slow, 120)
    row("torch", "micro_batch+ranks", 1, 64, 0.018, 120)
    return pd.DataFrame(rows)


def test_a_saving_stage_0_shows_too_is_not_credited_to_zero():
    from labkit.study.growth import credit_sentences, credit_table, growth_table

    results = _two_way_results()
    ranks = growth_table(results, "ranks")
    assert set(ranks.world_size) == {1, 2} and set(ranks.micro_batch) == {64}
    micro = growth_table(results, "micro_batch")
    assert set(micro.micro_batch) == {16, 64, 256} and set(micro[micro.strategy != "torch"].world_size) == {2}
    credit_text = "\n".join(credit_sentences(results))
    assert "ZeRO-3 0.50x changed it by the same factor" in credit_text and "not to ZeRO" in credit_text
    credit = credit_table(results)
    z3 = credit[(credit.strategy == "z3") & (credit.world_size == 2)]
    assert z3.step_time_vs_z0.round(3).tolist() == [1.3, 1.3, 1.3]
    one = credit[(credit.strategy == "z0") & (credit.world_size == 1)]
    assert one.step_time_vs_torch.round(3).tolist() == [round(0.020 / 0.018, 3)]
    # ZeRO-3 slower at the big batch than stage 0: its ratio is larger, said with the direction of both.
    worse = "\n".join(credit_sentences(_two_way_results(z3_factor=2.0)))
    assert "ZeRO-3 1.00x (stayed flat where stage 0's fell): a larger ratio than stage 0's." in worse


def test_growth_sentences_use_the_cards_verdict_words():
    """A 4x faster time to target reads "faster", never "yes, flat" (the old verdict said yes for any ratio
    <= 1.1); a ratio within the band reads "flat"."""
    from labkit.study.growth import growth_sentences

    text = "\n".join(growth_sentences(_two_way_results(), "micro_batch"))
    # Stage 0: 200 x 0.010 s -> 25 x 0.040 s = 0.50x; time per step 4x; time per epoch 0.25x.
    assert ("ZeRO-0 (DDP): global batch 32 -> 512 (micro-batch 16 -> 256 on 2 rank(s)): time per step slower "
            "(4.00x), time per epoch faster (0.25x), time to the target eval loss faster (0.50x) (200 -> 25 steps)."
            in text)
    flat = _two_way_results()
    flat.loc[(flat.strategy == "z0") & (flat.micro_batch == 256), "steps_to_target"] = 52  # 0.40 s * 52 = 1.04x
    assert "time to the target eval loss flat (1.04x)" in "\n".join(growth_sentences(flat, "micro_batch"))
    assert "Answer for" not in text  # the answer is the card's


def test_credit_needs_the_same_batches_as_stage_0_and_a_lower_ratio_says_where_it_ends():
    from labkit.study.growth import credit_sentences

    results = _two_way_results()
    # ZeRO-1 measured at one batch only (the memory-only point): its ratio is 1 by definition, no growth.
    one = results[(results.strategy == "z0") & (results.micro_batch == 64) & (results.world_size == 2)]
    results = pd.concat([results, one.assign(strategy="z1")], ignore_index=True)
    text = "\n".join(credit_sentences(results))
    assert "ZeRO-1" not in text, text
    # ZeRO-3 slow at the small batch only: its ratio falls further than stage 0's, yet it ends slower.
    slow_start = results.copy()
    first = (slow_start.strategy == "z3") & (slow_start.micro_batch == 16)
    slow_start.loc[first, "median_step_time_s"] *= 4
    text = "\n".join(credit_sentences(slow_start))
    assert "fell further than stage 0's" in text and "at the largest batch still 1.30x stage 0's time" in text


def test_credit_says_grew_less_when_both_grew():
    """"Fell further than stage 0" was printed when both times grew; a smaller growth reads "grew less"."""
    from labkit.study.growth import credit_sentences

    results = _two_way_results()
    big = results.micro_batch == 256
    results.loc[big, "steps_to_target"] = 200  # both grow: stage 0 4x, ZeRO-3 less (slow at the small batch)
    results.loc[(results.strategy == "z3") & (results.micro_batch == 16), "median_step_time_s"] *= 2
    text = "\n".join(credit_sentences(results))
    assert "stage 0 alone changed the time to target 4.00x" in text
    assert "ZeRO-3 2.00x (grew less than stage 0's)" in text and "fell further" not in text


# -- end to end ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_answer_smoke_end_to_end(tmp_path):
    """`answer --profile smoke`: real runs, timed one at a time, both growth ways, eval-loss target, report."""
    from labkit.launch.summary import rank_records, steps_of
    from labkit.study.answer import answer

    out = tmp_path / "answer"
    report = answer("smoke", out, progress=False)
    results = pd.read_csv(out / "results.csv")
    assert (results.status == "finished").all(), results[["strategy", "status", "cause"]]
    assert (results.concurrent_runs == 0).all()
    assert (results.threads_per_rank == max(1, (os.cpu_count() or 1) // 2)).all()
    assert {"ranks", "micro_batch", "grad_accum", "grad_accum+micro_batch+ranks"} <= set(results.growth)
    assert (results.target_measured_on == "eval_loss").all()
    machine = json.loads((out / "machine.json").read_text())
    assert machine["cpu_cores"] == os.cpu_count() and machine["timed_parallel"] == 1
    # The target is the first held-out evaluation at or below it, and the run stopped there.
    for row in results[results.steps_to_target.notna()].itertuples():
        evals = [r for r in steps_of(rank_records(row.run_dir, 1)[0]) if r.get("eval_loss") is not None]
        first = next(r["step"] for r in evals if r["eval_loss"] <= row.target_loss)
        assert first == row.steps_to_target == row.steps_completed
        # Near the target every step is evaluated: the step before it was, and missed it.
        assert row.steps_to_target - 1 in {r["step"] for r in evals}
        # Eval time is recorded on its own, not inside the step's clock.
        assert all(r["eval_s"] > 0 for r in evals)
    # The card: written beside the results, every way measured (smoke: 1 -> 2 ranks, micro-batch 8 -> 16,
    # accumulation 1 -> 2), each verdict its ratio's, and first in the report.
    from labkit.study.verdict import verdict

    card = json.loads((out / "answer_card.json").read_text())
    cells = [c for way in card["ways"].values() for c in way.values()]
    assert len(cells) == 9 and all(c["verdict"] == verdict(c["ratio"]) for c in cells if c["ratio"] is not None)
    assert all(card["ways"][way]["per_step"]["ratio"] is not None for way in ("ranks", "micro_batch", "grad_accum"))
    assert card["measured_on"]["profile"] == "smoke"
    page = report.read_text()
    assert page.index("class='answer-card'") < page.index("<h2>")
    assert "Growing the batch by more ranks at a fixed per-rank micro-batch" in page
    assert "Growing the batch by a bigger micro-batch on fixed ranks" in page
    assert "concurrent_runs 0 for every row" in page
    # The predictor checked on this machine: each multi-rank point of the ranks way predicted from its 1-rank run,
    # with the link measured here as training meets it (every timed call kept).
    from labkit.study import calibrate

    links = json.loads((out / calibrate.ANSWER_LINKS).read_text())
    assert links["busy_s"] > 0 and links["statistic"] == "mean" and links["raw"]
    check = calibrate.answer_check(out, links)
    assert len(check) == len(calibrate.answer_pairs(results)) >= 1
    assert (check["predicted_exposed_comm_s"] > 0).all() and check["error"].notna().all()
    section = page[page.index("id='predicted-this-machine'"):]
    assert section.count("<td>predicted ") == len(check) and "No check" not in section.split("</section>")[0]
    # `labkit report` rebuilds the card and the report from these tables, measuring nothing: the check kept (its
    # runs and link fit are here), the card the same, machine.json's measurement untouched but for the rebuild's date.
    from labkit.study.answer import rebuild_report

    card_before, machine_before = (out / "answer_card.json").read_text(), machine
    rebuilt = rebuild_report(out).read_text()
    assert (out / "answer_card.json").read_text() == card_before
    machine = json.loads((out / "machine.json").read_text())
    assert machine.pop("report_regenerated") and machine == machine_before
    assert json.loads((out / calibrate.ANSWER_LINKS).read_text()) == links  # not measured again
    kept = rebuilt[rebuilt.index("id='predicted-this-machine'"):].split("</section>")[0]
    assert kept == section.split("</section>")[0] and "rebuilt from those measurements" in rebuilt
    (out / calibrate.ANSWER_LINKS).write_text("not json")  # a kept file it cannot read: no check, and why
    rebuilt = rebuild_report(out).read_text()
    assert "No check: JSONDecodeError" in rebuilt[rebuilt.index("id='predicted-this-machine'"):]


def test_results_dir_for_reads_the_committed_reference_then_a_sweep_run_here(tmp_path, monkeypatch):
    """Notebooks 04 and 04a find their answer here: the profile's committed reference, a sweep run in the run
    store, the MLP's ci reference last; an error naming the command when there is none."""
    from labkit.study.answer import results_dir_for

    monkeypatch.setenv("LABKIT_RUNS_DIR", str(tmp_path))
    data = Path(__file__).resolve().parents[2] / "data"
    assert results_dir_for("ci") == data / "reference-ci"
    assert results_dir_for("ci", "gpt") == data / "reference-ci-gpt"
    assert results_dir_for("full") == data / "reference-ci"  # no full answer anywhere: the ci one (banner says so)
    (tmp_path / "answer-full").mkdir()
    (tmp_path / "answer-full" / "results.csv").write_text("strategy\n")
    assert results_dir_for("full") == tmp_path / "answer-full"
    with pytest.raises(FileNotFoundError, match=r"python -m labkit answer --profile full --model gpt` or else"):
        results_dir_for("full", "gpt", also=" or else")  # the GPT never falls back to the MLP's results


@pytest.mark.parametrize("name", ["reference-ci", "reference-ci-gpt"])
def test_the_committed_references_card_and_predictions_are_this_labkits(name):
    """data/reference-*'s answer_card.json and report.html's predicted section are what this labkit builds from the
    committed tables: a change to the card or to labkit.study.predict that leaves them stale fails here
    (`labkit report data/<name>` rebuilds both, measuring nothing)."""
    from labkit.study import card
    from labkit.study.answer import predicted_section

    reference = Path(__file__).resolve().parents[2] / "data" / name
    tables = {n: pd.read_csv(reference / f"{n}.csv") for n in ("results", "maxbatch", "noise")}
    built = card.build_card(tables["results"], maxbatch=tables["maxbatch"], noise=tables["noise"],
                            machine=json.loads((reference / "machine.json").read_text()))
    assert built == json.loads((reference / "answer_card.json").read_text()), f"run `labkit report data/{name}`"
    section = predicted_section(reference)
    assert "Predicted on other hardware" in section and "No prediction" not in section
    assert section in (reference / "report.html").read_text(), f"run `labkit report data/{name}`"


def test_labkit_report_refuses_what_is_not_a_finished_answer_before_writing(tmp_path, capsys):
    """`labkit report DIR`: exit 2 naming what is missing or wrong, and nothing in DIR written."""
    import shutil

    from labkit.cli import main

    reference = Path(__file__).resolve().parents[2] / "data" / "reference-ci"
    machine = json.loads((reference / "machine.json").read_text())
    results = pd.read_csv(reference / "results.csv")
    breakages = {
        "has no noise.csv: not the results dir of a finished `labkit answer`": lambda d: (d / "noise.csv").unlink(),
        "machine.json names the profile 'huge', not one of ci, ": lambda d: (d / "machine.json").write_text(
            json.dumps({**machine, "profile": "huge"})),
        "does not say which accelerator the answer ran on": lambda d: (d / "machine.json").write_text(
            json.dumps({k: v for k, v in machine.items() if k != "accelerator"})),
        "results.csv has no `growth` column": lambda d: results.drop(columns=["growth"]).to_csv(
            d / "results.csv", index=False),
        "a table is not an answer's (AttributeError: 'DataFrame' object has no attribute 'status')":
            lambda d: results.drop(columns=["status"]).to_csv(d / "results.csv", index=False),
        "a table is not an answer's (": lambda d: (d / "activation.csv").write_text("a,b\n1,2\n"),
        "no such directory": lambda d: shutil.rmtree(d),
        # The file named: these said only "No columns to parse from file", "'utf-8' codec can't decode ...", and
        # "machine.json names the profile None".
        "results.csv is empty (EmptyDataError": lambda d: (d / "results.csv").write_text(""),
        "results.csv is not a CSV table (UnicodeDecodeError": lambda d: (d / "results.csv").write_bytes(
            b"\xff\xfe\x00\x01status\n\xff"),
        "noise.csv is empty (EmptyDataError": lambda d: (d / "noise.csv").write_text(""),
        "machine.json is malformed: not JSON (": lambda d: (d / "machine.json").write_text('{"profile": "ci",'),
        "machine.json is malformed: a JSON list": lambda d: (d / "machine.json").write_text("[1]"),
        # machine.json's names and results.csv's times: these said "a table is not an answer's (TypeError" and
        # "a ratio of times must be finite and positive, got nan", naming neither file nor field.
        "machine.json: `profile` must be a string, as `labkit answer` writes it, got ['ci']":
            lambda d: (d / "machine.json").write_text(json.dumps({**machine, "profile": ["ci"]})),
        "machine.json: `model` must be a string": lambda d: (d / "machine.json").write_text(
            json.dumps({**machine, "model": 5})),
        "results.csv: median_step_time_s must be a time above 0 for every finished point; row(s) 2 (file lines)":
            lambda d: results.assign(median_step_time_s=[0.0, *results["median_step_time_s"][1:]]).to_csv(
                d / "results.csv", index=False),
    }
    assert main(["report", ""]) == 2  # was read as the working directory
    assert "the results dir is an empty path" in capsys.readouterr().err
    for n, (message, breakage) in enumerate(breakages.items()):
        copy = tmp_path / str(n)
        shutil.copytree(reference, copy)
        breakage(copy)
        before = {p.name: p.read_bytes() for p in copy.iterdir()} if copy.exists() else {}
        assert main(["report", str(copy)]) == 2
        assert message in capsys.readouterr().err
        assert ({p.name: p.read_bytes() for p in copy.iterdir()} if copy.exists() else {}) == before


def test_labkit_answer_refuses_bad_parallel_out_and_reference_before_the_sweep(tmp_path, capsys, monkeypatch):
    """`--parallel 0` / `-1` started the full sweep (0 read as the default, -1 as 1); `--reference` at a file, or
    where no directory can be made, failed only after every point was measured (publish() makes it last); `--out`
    at a file said "[Errno 17] File exists" naming no flag, after the devices loaded. Now exit 2 at once."""
    from labkit.cli import main
    from labkit.study import answer as answer_module

    def no_sweep(*_args, **_kwargs):
        raise AssertionError("the sweep started")

    the_answer = answer_module.answer
    monkeypatch.setattr(answer_module, "answer", no_sweep)
    a_file = tmp_path / "reference.csv"
    a_file.write_text("kept")
    cases = {
        ("--parallel", "0"): "error: parallel: --parallel must be at least 1 (timed runs at once), got 0",
        ("--parallel", "-1"): "error: parallel: --parallel must be at least 1 (timed runs at once), got -1",
        ("--reference", str(a_file)): f"error: reference: --reference {a_file} is a file, not a directory",
        ("--reference", str(a_file / "sub")): f"error: reference: --reference {a_file / 'sub'} cannot be made: "
                                              f"{a_file} is a file, not a directory",
        ("--reference", "/proc/labkit-no-such/ref"): "error: reference: --reference /proc/labkit-no-such/ref cannot "
                                                     "be made: no directory can be created in /proc",
        ("--out", str(a_file)): f"error: out: --out {a_file} is a file, not a directory",
    }
    for args, message in cases.items():
        assert main(["answer", "--profile", "ci", "--out", str(tmp_path / "out"), *args]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    assert a_file.read_text() == "kept" and not (tmp_path / "out").exists()
    # The Python API too: 0 is no longer "the default".
    from labkit.runtime import devices

    monkeypatch.setattr(devices, "detect_devices", no_sweep)
    with pytest.raises(ConfigError, match="parallel: must be at least 1"):
        the_answer("ci", tmp_path / "out", parallel=0)



def test_labkit_answer_refuses_an_unknown_labkit_profile_naming_it(tmp_path, capsys, monkeypatch):
    """`LABKIT_PROFILE=bogus labkit answer` raised a ValueError traceback (exit 1): now exit 2 naming the variable
    and the profiles, before the sweep."""
    from labkit.cli import main
    from labkit.study import answer as answer_module

    def no_sweep(*_args, **_kwargs):
        raise AssertionError("the sweep started")

    monkeypatch.setattr(answer_module, "answer", no_sweep)
    monkeypatch.setenv("LABKIT_PROFILE", "bogus")
    assert main(["answer", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "error: LABKIT_PROFILE: must be one of ci, workshop, full, got 'bogus'" in err, err
    assert "Traceback" not in err and not (tmp_path / "out").exists()

def test_a_rebuilt_reports_check_says_what_it_lacks(tmp_path):
    """The check on this machine in a rebuilt report (`calibrate.kept_report_section`) measures nothing: without the
    ranks way's runs, or with them but no link fit kept, it says which; an answer without a ranks way says that."""
    from labkit.study import calibrate

    reference = Path(__file__).resolve().parents[2] / "data" / "reference-ci"
    assert "the runs of its ranks way are not in this results dir" in calibrate.kept_report_section(reference)
    results = pd.read_csv(reference / "results.csv")
    results.to_csv(tmp_path / "results.csv", index=False)
    pairs = calibrate.answer_pairs(results)
    assert pairs
    for one, many in pairs:
        for row in (one, many):
            (tmp_path / "runs" / str(row["run_id"])).mkdir(parents=True, exist_ok=True)
    section = calibrate.kept_report_section(tmp_path)
    assert f"no link fit kept ({calibrate.ANSWER_LINKS})" in section
    assert not (tmp_path / calibrate.ANSWER_LINKS).exists()  # not measured
    results[~results["growth"].astype(str).str.contains("ranks")].to_csv(tmp_path / "results.csv", index=False)
    assert "this answer has no ranks way to check" in calibrate.kept_report_section(tmp_path)

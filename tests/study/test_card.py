"""The answer card (labkit.study.card): its JSON shape, verdicts that always agree with their ratios, the
conditions computed from the data, unmeasured ways and points, the committed references, and the report
that opens with it."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from labkit.study import card
from labkit.study.verdict import verdict
from tests.conftest import REPO

DATASET = 8192
CELL_KEYS = {"verdict", "ratio", "from_batch", "to_batch", "condition"}


def _row(growth, ranks, micro, accum, step, steps, status="finished", strategy="z0"):
    batch = ranks * micro * accum
    finished = status == "finished"
    return {"strategy": strategy, "growth": growth, "world_size": ranks, "micro_batch": micro, "grad_accum": accum,
            "global_batch": batch, "lr_scaling": "sqrt", "status": status, "target_loss": 0.8,
            "steps_completed": steps if finished and steps == steps else 600,
            "median_step_time_s": step if finished else None,
            "samples_per_s": batch / step if finished else None,
            "time_per_epoch_s": step * DATASET / batch if finished else None,
            "steps_to_target": steps if finished else None, "threads_per_rank": 1, "concurrent_runs": 0}


def _results(changes: dict | None = None) -> pd.DataFrame:
    """Stage 0 grown three ways; `changes` = {(growth, micro, accum, ranks): (step, steps)} overrides a point."""
    points = {("ranks", 64, 1, 1): (0.010, 100),
              ("grad_accum+micro_batch+ranks", 64, 1, 2): (0.015, 60),
              ("micro_batch", 16, 1, 2): (0.008, 200),
              ("micro_batch", 256, 1, 2): (0.030, 25),
              ("grad_accum", 64, 4, 2): (0.050, 30),
              ("grad_accum", 64, 16, 2): (0.180, 20)}
    points.update(changes or {})
    rows = [_row(growth, ranks, micro, accum, step, steps)
            for (growth, micro, accum, ranks), (step, steps) in points.items()]
    return pd.DataFrame(rows)


def _cells(built):
    return [(way, clock, c) for way, cells in built["ways"].items() for clock, c in cells.items()]


def test_the_card_has_the_issues_shape_and_every_verdict_agrees_with_its_ratio():
    built = card.build_card(_results(), machine={"device": "test CPU", "accelerator": "cpu", "cpu_cores": 2,
                                                 "devices": 1, "profile": "ci", "model": "mlp", "date": "today"})
    assert set(built["ways"]) == {"ranks", "micro_batch", "grad_accum"}
    for way, clock, c in _cells(built):
        assert set(built["ways"][way]) == {"per_step", "per_epoch", "to_target"}
        assert set(c) == CELL_KEYS, (way, clock)
        assert c["verdict"] == verdict(c["ratio"]), (way, clock, c)
    assert built["measured_on"] == {"device": "test CPU", "accelerator": "cpu", "count": 2, "profile": "ci",
                                    "model": "mlp", "date": "today"}
    assert built["strategy"] == "z0" and built["flat_band"] == 0.1
    json.dumps(built)  # what answer_card.json holds
    micro = built["ways"]["micro_batch"]
    assert (micro["per_step"]["from_batch"], micro["per_step"]["to_batch"]) == (32, 512)
    assert micro["per_step"]["ratio"] == pytest.approx(0.030 / 0.008, abs=1e-4)
    assert micro["to_target"]["ratio"] == pytest.approx(25 * 0.030 / (200 * 0.008), abs=1e-4)
    accum = built["ways"]["grad_accum"]
    assert (accum["per_step"]["from_batch"], accum["per_step"]["to_batch"]) == (128, 2048)
    # 16 micro-steps of 11.25 ms against one of 15 ms: the condition gives the per-micro-step time it reads.
    assert "a step runs 16 micro-steps instead of 1 (16x), 15.0 ms -> 11.2 ms per micro-step" in \
        accum["per_step"]["condition"]


@pytest.mark.parametrize("clock", ["per_step", "per_epoch", "to_target"])
@pytest.mark.parametrize("wanted, expected", [(0.5, "faster"), (0.8999, "faster"), (0.9, "flat"), (1.1, "flat"),
                                              (1.10004, "flat"), (1.1002, "slower"), (3.0, "slower")])
def test_every_verdict_and_ratio_combination(clock, wanted, expected):
    """The largest micro-batch's point is set so that one clock's ratio is `wanted`; the cell says it."""
    first_step, first_steps = 0.008, 200
    step, steps = 0.030, 25
    if clock == "per_step":
        step = wanted * first_step
    elif clock == "per_epoch":
        step = wanted * first_step * 16  # 16x the batch: an epoch has 16x fewer steps
    else:
        steps = wanted * first_step * first_steps / step
    built = card.build_card(_results({("micro_batch", 256, 1, 2): (step, steps)}))
    c = built["ways"]["micro_batch"][clock]
    assert c["ratio"] == pytest.approx(wanted, abs=1e-4)
    assert c["verdict"] == expected == verdict(c["ratio"])


def test_a_ratio_just_past_the_band_rounds_with_its_verdict():
    """The stored ratio is rounded; the verdict is the rounded ratio's, so the two never disagree."""
    assert card.cell(1.10004, 1, 2, "x") == {"verdict": "flat", "ratio": 1.1, "from_batch": 1, "to_batch": 2,
                                             "condition": "x"}
    assert card.cell(1.1001, 1, 2, "x")["verdict"] == "slower"
    assert card.cell(float("nan"), 1, 2, "x")["verdict"] is None


def test_conditions_are_computed_from_the_data():
    built = card.build_card(_results())
    ranks = built["ways"]["ranks"]
    # 10 ms on one rank, 15 ms on two with the same 64 samples per rank: communication not hidden.
    assert ranks["per_step"]["verdict"] == "slower"
    assert ranks["per_step"]["condition"].startswith("communication not hidden behind compute: the same 64 samples "
                                                     "per rank, 1 -> 2 ranks, step 10.0 ms -> 15.0 ms (+5.0 ms")
    hidden = card.build_card(_results({("grad_accum+micro_batch+ranks", 64, 1, 2): (0.0105, 60)}))
    assert hidden["ways"]["ranks"]["per_step"]["condition"].startswith("communication hidden behind compute")
    # Samples/s 4,000 -> 8,533 -> 17,067: still rising at the largest micro-batch.
    micro = built["ways"]["micro_batch"]["per_step"]["condition"]
    assert micro.startswith("device not saturated: samples/s still rising with the micro-batch (4,000 -> 8,533 -> "
                            "17,067)")
    saturated = card.build_card(_results({("micro_batch", 256, 1, 2): (0.060, 25)}))
    assert saturated["ways"]["micro_batch"]["per_step"]["condition"].startswith("device saturated")
    assert built["ways"]["micro_batch"]["to_target"]["condition"].startswith("steps 200 -> 25 for 16x the batch")


def test_to_target_sets_the_batch_against_the_noise_scale():
    noise = pd.DataFrame([{"strategy": "z0", "global_batch": 32, "lr_scaling": "sqrt", "step": s, "loss": 2 - s / 100,
                           "grad_norm_small_sq": 1.0 + 100 / 16, "grad_norm_big_sq": 1.0 + 100 / 32,
                           "noise_b_small": 16, "noise_b_big": 32, "noise_scale": 100.0} for s in range(40)])
    built = card.build_card(_results(), noise=noise)
    assert "batch 32-512 across B_simple ~ 100 (noise.csv)" in built["ways"]["micro_batch"]["to_target"]["condition"]
    assert "batch 128-2048 above B_simple ~ 100" in built["ways"]["grad_accum"]["to_target"]["condition"]
    big = noise.assign(grad_norm_small_sq=1.0 + 5000 / 16, grad_norm_big_sq=1.0 + 5000 / 32)
    built = card.build_card(_results(), noise=big)
    assert "batch 64-128 below B_simple ~ 5000" in built["ways"]["ranks"]["to_target"]["condition"]


def test_a_way_not_measured_has_no_verdict_and_says_why():
    one_device = _results()
    one_device = one_device[one_device.world_size == 2].assign(world_size=1)
    built = card.build_card(one_device)
    for c in built["ways"]["ranks"].values():
        assert c["verdict"] is None and c["ratio"] is None and c["condition"] == "1 device: ranks cannot grow"
    no_accum = _results()
    no_accum = no_accum[no_accum.growth != "grad_accum"]
    built = card.build_card(no_accum)
    for c in built["ways"]["grad_accum"].values():
        assert c["verdict"] is None and c["condition"] == ("not measured: no ZeRO-0 (DDP) points grew the batch this "
                                                           "way (only batch 128 ran)")
    assert built["ways"]["micro_batch"]["per_step"]["verdict"] == "slower"


def test_a_capped_or_failed_point_is_said_not_hidden():
    # Capped: the largest micro-batch ran its 600 steps without reaching the target.
    capped = card.build_card(_results({("micro_batch", 256, 1, 2): (0.030, float("nan"))}))
    cell = capped["ways"]["micro_batch"]["to_target"]
    assert cell["verdict"] is None and cell["ratio"] is None
    assert cell["condition"] == "batch 512 did not reach the target loss 0.8 within its 600 steps: no time to target"
    assert capped["ways"]["micro_batch"]["per_step"]["verdict"] == "slower"  # the step time was still measured
    # Failed: the largest batch ran out of memory; the ratio runs to the largest batch that finished, and says so.
    results = _results()
    oom = (results.growth == "micro_batch") & (results.micro_batch == 256)
    for key in ("median_step_time_s", "samples_per_s", "time_per_epoch_s", "steps_to_target"):
        results.loc[oom, key] = None
    results.loc[oom, "status"] = "oom"
    cell = card.build_card(results)["ways"]["micro_batch"]["per_step"]
    assert (cell["from_batch"], cell["to_batch"]) == (32, 128)
    assert cell["ratio"] == pytest.approx(0.015 / 0.008, abs=1e-4)
    assert cell["condition"].endswith("(not in the ratio: batch 512 oom)")
    # Nothing but one point finished: no verdict.
    lone = results[~((results.growth == "micro_batch") & (results.micro_batch == 16))]
    cell = card.build_card(lone)["ways"]["micro_batch"]["to_target"]
    assert cell["verdict"] is None and "fewer than two ZeRO-0 (DDP) points finished (batch 512 oom)" in \
        cell["condition"]


def test_the_deepspeed_line_states_room_per_rank_and_its_cost_per_step():
    results = _results()
    z3 = results.assign(strategy="z3", median_step_time_s=results.median_step_time_s * 1.5)
    z3.loc[z3.grad_accum == 16, "median_step_time_s"] = 0.180 * 2.5  # every micro-step communicates
    results = pd.concat([results, z3], ignore_index=True)
    maxbatch = pd.DataFrame([{"strategy": "torch", "world_size": 1, "max_micro_batch": 288},
                             {"strategy": "z0", "world_size": 2, "max_micro_batch": 290},
                             {"strategy": "z3", "world_size": 2, "max_micro_batch": 640}])
    line = card.deepspeed_line(results, maxbatch)
    assert line.startswith("The card reads ZeRO-0 (DDP): DeepSpeed's data parallelism")
    assert ("ZeRO-3 fits 640 samples per rank where stage 0 fits 290 (2.21x), at 1.50x stage 0's time per step and "
            "2.50x with 16 accumulation micro-steps") in line
    # No stage-0 search: plain PyTorch's stands in (stage 0 holds the same unpartitioned states per rank).
    line = card.deepspeed_line(results, maxbatch[maxbatch.strategy != "z0"])
    assert "where stage 0 (plain PyTorch's search: the same unpartitioned states) fits 288 (2.22x)" in line


def test_the_card_as_html_and_the_two_regimes():
    built = card.build_card(_results())
    page = card.card_html(built, "MLP")
    for words in (*card.WAY_NAMES.values(), "time per step", "time per epoch", "time to the same loss",
                  "&plusmn;10%", "DeepSpeed's part"):
        assert words in page
    assert page.count("<tr>") == 4 and ">slower</b>" in page and ">faster</b>" in page
    both = card.cards_side_by_side({"MLP": built, "GPT": built})
    assert both.count("class='answer-card'") == 2
    table = card.card_markdown(built).splitlines()
    assert len(table) == 5
    assert table[2].startswith("| more ranks (fixed micro-batch per rank) | **slower** 1.50x (64 -> 128)")


# -- the committed references ------------------------------------------------------------------------
def _reference(name):
    folder = REPO / "data" / name
    read = {f: pd.read_csv(folder / f"{f}.csv") for f in ("results", "maxbatch", "noise")}
    machine = json.loads((folder / "machine.json").read_text())
    return folder, read, machine


@pytest.mark.parametrize("name", ["reference-ci", "reference-ci-gpt"])
def test_the_committed_card_is_the_one_its_results_give(name):
    folder, read, machine = _reference(name)
    built = card.build_card(read["results"], maxbatch=read["maxbatch"], noise=read["noise"], machine=machine)
    assert json.loads((folder / card.CARD_FILE).read_text()) == json.loads(json.dumps(built))
    for way, clock, c in _cells(built):
        assert c["verdict"] is not None and c["verdict"] == verdict(c["ratio"]), (way, clock)


def test_the_references_show_opposite_regimes():
    """The MLP's time to target falls with the micro-batch, the GPT's grows: the sentences say why, from
    steps and time per step."""
    sentences = {}
    for name in ("reference-ci", "reference-ci-gpt"):
        _, read, _ = _reference(name)
        r = card.regime(read["results"], read["noise"])
        sentences[name] = card.regime_sentence(name, r)
    assert "time to the same loss faster" in sentences["reference-ci"]
    assert "mostly fixed overhead" in sentences["reference-ci"]
    assert "time to the same loss slower" in sentences["reference-ci-gpt"]
    assert "past the critical batch" in sentences["reference-ci-gpt"] and "saturated" in sentences["reference-ci-gpt"]


def test_the_report_opens_with_the_card(tmp_path):
    from labkit.study.report import build_report

    _, read, machine = _reference("reference-ci")
    page = build_report(read["results"], tmp_path / "report.html", maxbatch=read["maxbatch"], noise=read["noise"],
                        machine=machine, devices=None).read_text()
    body = page.split("<body>", 1)[1]
    assert body.index("class='answer-card'") < body.index("<h2>")  # the card before every section
    assert body.index("class='answer-card'") < body.index("Plotly.newPlot")
    assert "The answer card (answer_card.json)" in body
    # What the card says is not said again in the conclusions.
    assert "Answer for" not in body and "Cost per step of ZeRO" not in body and "What ZeRO changes" not in body

"""This machine: 2-rank step times predicted from 1-rank runs (data/predict-ci/, measured by
`benchmarks/bench_predict.py --measure`), and the ZeRO-3 host cost the predictor reads from there."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from labkit.study import calibrate as C
from labkit.study import comms
from labkit.study import predict as P

DATA = Path(__file__).resolve().parents[2] / "data" / "predict-ci"
SECOND_PASS = DATA.parent / "predict-ci-2"
GOAL_MEDIAN, GOAL_MAX = 0.15, 0.30


def test_the_calibration_data_has_every_strategy_and_micro_batch_at_1_and_2_ranks():
    runs = pd.read_csv(DATA / "runs.csv")
    for statistic in C.STATISTICS:
        table = runs[runs["statistic"] == statistic]
        assert set(table["strategy"]) == {"z0", "z1", "z2", "z3", "z2-offload"}
        for (_, _), group in table.groupby(["strategy", "micro_batch"]):
            assert sorted(group["world_size"]) == [1, 2]
        assert all(json.loads(c)["threads_per_rank"] == 1 for c in table["config"])  # one core per rank
    fit = json.loads((DATA / "links.json").read_text())
    assert {"all_reduce", "all_gather"} <= set(fit["fits"])


@pytest.mark.parametrize("statistic", C.STATISTICS)
def test_every_2_rank_point_is_predicted(statistic):
    table = C.cpu_comparison(DATA, statistic)
    assert len(table) == 15
    assert (table["predicted_2_rank_s"] > table["predicted_exposed_comm_s"]).all()
    assert (table["predicted_exposed_comm_s"] > 0).all()


@pytest.mark.parametrize("data", [DATA, SECOND_PASS], ids=["predict-ci", "predict-ci-2"])
def test_the_issues_goal_on_this_machine(data):
    """A regression check on two committed passes (measured one after the other on the quiet machine), both read with
    the first's link grid; a run's time is its steps x their mean step (docs/predict.md, "This machine")."""
    errors = C.cpu_comparison(data, "mean", links=DATA / "links_grid.json")["error"].abs()
    assert errors.median() <= GOAL_MEDIAN and errors.max() <= GOAL_MAX


def test_the_link_grid_is_read_at_each_runs_own_compute_per_collective():
    grid = json.loads((DATA / "links_grid.json").read_text())
    raw = pd.DataFrame(grid["raw"])
    assert sorted(raw["busy_s"].unique()) == sorted(comms.TRAINING_BUSY_GRID_S)
    assert raw.groupby(["busy_s", "op", "msg_bytes"]).size().min() == comms.TRAINING_GRID_REPS
    # what the docs teach from it: a call waits longer when the other rank computed longer before it
    fits = comms.fit_settings(raw, 2, "mean")
    short, long = (comms.read_settings(fits, b)["all_reduce"]["alpha_s"] for b in (0.25e-3, 4e-3))
    assert long > 2 * short
    table = C.cpu_comparison(DATA)  # the grid by default
    assert table["compute_per_collective_s"].between(0.25e-3, 8e-3).all()
    assert table["compute_per_collective_s"].nunique() == len(table)  # each run read at its own


def test_the_link_fit_is_the_one_training_meets_and_keeps_every_call():
    fit = json.loads((DATA / "links.json").read_text())
    assert fit["busy_s"] > 0 and fit["statistic"] == "mean"  # compute between calls, no barrier
    raw = pd.DataFrame(fit["raw"])
    assert raw.groupby(["op", "msg_bytes"]).size().min() >= 10
    # the comparison refits the calls by the runs' statistic: the fastest calls give a smaller latency than the mean
    fastest, mean = (comms.fit_links(raw, 2, s)["all_reduce"] for s in ("fastest", "mean"))
    assert fastest.alpha_s < mean.alpha_s


def test_the_zero3_host_cost_is_read_from_the_measured_file():
    host = json.loads((DATA / "host.json").read_text())
    assert P.zero3_fetch_s() == host["zero3_fetch_s"] == min(host["observations_s"]) > 0


# -- ZeRO-3's host work as the ranks grow (calibrate.ZERO3_RANKS_PROBE, data/predict-ci/zero3_ranks.json) ----------
def test_the_rank_scaling_fit_reads_the_fixed_and_per_rank_parts_back():
    one, per_fetch, per_rank_param = 0.5e-3, 20e-6, 4e-6
    # the probe's module: 1 fetch that gathers per micro-step (its backward's finds them kept), 2 parameters
    synthetic = {n: one + per_fetch + 2 * per_rank_param * n for n in (2, 4, 8)} | {1: one}
    fit = C.fit_rank_scaling(synthetic)
    assert fit["one_rank_per_module_s"] == one
    assert fit["per_fetch_s"] == pytest.approx(per_fetch)
    assert fit["per_rank_per_param_fetch_s"] == pytest.approx(per_rank_param)
    with pytest.raises(ValueError, match="at least two world sizes"):
        C.fit_rank_scaling({1: one, 2: synthetic[2]})


def test_the_probes_module_gathers_once_per_micro_step_as_the_fit_assumes():
    from labkit.study import zero3

    probe = [[64 * 64, 64]] * 72  # ZERO3_RANKS_PROBE's deeper stack of Linear(64, 64), persistence threshold 0
    r = zero3.replay(zero3.ModuleTrace.from_layout(probe), stage3_param_persistence_threshold=0)
    assert (r.gathering_fetches, r.gathered_params_fetched) == (
        72 * C.ZERO3_GATHERING_FETCHES_PER_MICRO_STEP, 72 * C.ZERO3_GATHERING_FETCHES_PER_MICRO_STEP
        * C.ZERO3_GATHERED_PER_MODULE)


def test_the_committed_rank_scaling_is_what_the_predictor_adds_at_several_ranks():
    ranks = json.loads((DATA / "zero3_ranks.json").read_text())
    assert ranks["format"] == "labkit-zero3-ranks/1" and "biased both ways" in ranks["source"]
    assert sorted(int(n) for n in ranks["per_module_s"]) == [1, 2, 4, 8]
    assert all(len(v) == int(n) for n, v in ranks["per_module_s_by_rank"].items())  # every rank's figure kept
    medians = {int(n): v for n, v in ranks["per_module_s"].items()}
    assert C.fit_rank_scaling(medians)["per_rank_per_param_fetch_s"] == ranks["per_rank_per_param_fetch_s"]
    assert C.fit_rank_scaling(medians)["per_fetch_s"] == ranks["per_fetch_s"]
    host = P.host_costs(P.find_gpu("A100-80GB"))
    assert host.zero3_gather_per_rank_param_s == max(ranks["per_rank_per_param_fetch_s"], 0.0)
    assert "zero3_ranks.json" in host.source


@pytest.mark.slow
def test_the_rank_scaling_probe_runs_real_ranks():
    per_rank = C.zero3_rank_probe(2, depths=(1, 2), steps=4)  # two real ranks on gloo, each reporting its figure
    assert len(per_rank) == 2 and all(isinstance(v, float) for v in per_rank)


def test_a_statistic_the_runs_lack_or_a_misspelled_folder_is_named():
    """Notebook 06's cells: "fastest" (a link fit's statistic, not the runs') gave an empty table and a KeyError in
    the next cell; a misspelled data folder gave None and a TypeError on it."""
    with pytest.raises(ValueError, match=r"runs\.csv has no 'fastest' rows; it has mean, median, p10"):
        C.cpu_comparison(DATA, "fastest")
    with pytest.raises(ValueError, match="no such directory"):
        C.gpu_comparison(DATA.parent / "dta")

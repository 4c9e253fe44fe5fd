"""This machine: 2-rank step times predicted from 1-rank runs (data/predict-ci/, measured by
`benchmarks/bench_predict.py --measure`), and the ZeRO-3 host cost the predictor reads from there."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from labkit.study import calibrate as C
from labkit.study import predict as P

DATA = Path(__file__).resolve().parents[2] / "data" / "predict-ci"
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
    assert (table["predicted_2_rank_s"] > table["predicted_comm_s"]).all()
    assert (table["predicted_comm_s"] > 0).all()


@pytest.mark.xfail(strict=True, reason="not met with the data in data/predict-ci/ (a quiet pass, load 1.2-1.4, "
                   "kept beside two loaded ones): median 16.7%, max 44.3%; ZeRO-3's 2-rank points are 31-44% short "
                   "(its per-module gathers on 2 ranks cost 3-5 ms more than the link fit predicts; "
                   "docs/predict.md). strict: re-measured to the goal, this fails and the mark must go")
def test_the_issues_goal_on_this_machine():
    errors = C.cpu_comparison(DATA, "p10")["error"].abs()
    assert errors.median() <= GOAL_MEDIAN and errors.max() <= GOAL_MAX


def test_the_zero3_host_cost_is_read_from_the_measured_file():
    host = json.loads((DATA / "host.json").read_text())
    assert P.zero3_fetch_s() == host["zero3_fetch_s"] == min(host["observations_s"]) > 0

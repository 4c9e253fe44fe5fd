"""The predictor against published DeepSpeed measurements (data/published/): what the set covers, that every point
is cited, and the error the model reaches (docs/predict.md says why the goal is not met)."""

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


@pytest.mark.xfail(strict=True, reason="the model does not reach the issue's goal on the published points "
                   "(median <= 25%, every point <= 40%; it reaches 38.9% / 269%). Over 40%: ZeRO-3 at 640-2240 "
                   "A100s (SC21; a cost growing with the ranks beyond NCCL's ring latency model), ZeRO-3 on 384 "
                   "V100 at 200-800 Gb/s (the ZeRO++ blog; the model hides more of the communication behind compute "
                   "than those runs did), ZeRO-3 at micro-batch 1 on 16 V100 (a per-module host cost of "
                   "2021's DeepSpeed) and GPT-2 XL end to end "
                   "(a training loop's own work outside DeepSpeed's calls); docs/predict.md has the arithmetic. "
                   "strict: this test fails the day the model meets the goal, so the goal is then enforced here")
def test_the_issues_goal_on_the_published_points(comparison):
    errors = comparison["error"].abs()
    assert errors.median() <= GOAL_MEDIAN and errors.max() <= GOAL_MAX


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


def test_a_row_without_micro_or_global_batch_is_refused(points):
    row = points.iloc[0].copy()
    row["micro_batch"], row["global_batch"] = float("nan"), float("nan")
    with pytest.raises(ValueError, match="neither micro_batch nor global_batch"):
        published.setup(row)

"""The stop at target (labkit.rank.target.TargetStop): on the held-out eval loss with eval_every, else on the ranks'
mean training loss over the window the run's summary reads."""

from __future__ import annotations

import pytest
import torch

from labkit.core.config import RunConfig
from labkit.launch.summary import time_to_target
from labkit.rank.target import TargetStop

LOSSES = [2.4, 2.1, 2.3, 1.9, 2.0, 1.8, 1.7, 2.2, 1.6, 1.5, 1.4]


def config_of(**fields) -> RunConfig:
    return RunConfig(**{"example": "pytorch", "world_size": 1, "micro_batch": 8, "steps": 40, **fields})


def one_rank(total: torch.Tensor) -> None:
    assert total.dtype == torch.float64 and total.shape == (1,)


def first_stop(stop: TargetStop, losses: list[float]) -> int | None:
    for step, loss in enumerate(losses, start=1):
        if stop(torch.tensor(loss), {}):
            return step
    return None


def test_without_stop_at_target_no_step_stops_the_run_and_the_ranks_never_communicate():
    stop = TargetStop(config_of(target_loss=5.0), world_size=2, all_reduce=lambda t: pytest.fail("all_reduce"))
    assert first_stop(stop, LOSSES) is None and not stop.reached


@pytest.mark.parametrize("target", [2.2, 2.0, 1.8, 1.7])
def test_the_run_stops_at_the_step_its_summary_reports_as_reaching_the_target(target):
    """The window is the summary's (labkit.launch.summary.time_to_target): the rank stops where the summary
    will say the target was reached."""
    stop = TargetStop(config_of(target_loss=target, stop_at_target=True), world_size=1, all_reduce=one_rank)
    records = {0: [{"event": "step", "step": s, "loss": loss, "time_s": float(s)}
                   for s, loss in enumerate(LOSSES, start=1)]}
    reached = time_to_target(records, target)  # the summary's own window
    assert reached is not None and first_stop(stop, LOSSES) == reached[0] and stop.reached


def test_the_ranks_decide_on_their_mean_loss_over_the_window():
    def with_a_peer_at_3(total: torch.Tensor) -> None:  # two ranks, the other one's loss 3.0
        total += 3.0

    stop = TargetStop(config_of(target_loss=2.0, stop_at_target=True), world_size=2, all_reduce=with_a_peer_at_3)
    assert not stop(torch.tensor(1.5), {})  # this rank alone is below the target; the ranks' mean, 2.25, is not
    assert not stop(torch.tensor(1.2), {})  # the window: (2.25 + 2.1) / 2
    assert stop(torch.tensor(0.2), {})  # (2.25 + 2.1 + 1.6) / 3 = 1.98
    assert stop.recent == pytest.approx([2.25, 2.1, 1.6]) and stop.reached


def test_with_evaluation_the_eval_loss_decides_and_the_ranks_need_not_communicate():
    stop = TargetStop(config_of(target_loss=2.0, stop_at_target=True, eval_every=5), world_size=2,
                      all_reduce=lambda t: pytest.fail("the eval loss is already the ranks' mean"))
    assert not stop(torch.tensor(0.1), {})  # no eval at this step: a low training loss does not stop the run
    assert not stop(torch.tensor(0.1), {"eval_loss": 2.01, "eval_s": 0.1})
    assert stop(torch.tensor(9.0), {"eval_loss": 2.0, "eval_s": 0.1}) and stop.reached

"""The stop at target (`stop_at_target`): whether the step just trained ends the run.

Ranks must stop at the same step, so they decide from one figure they share: with held-out evaluation
(`eval_every`), the eval loss (already the ranks' mean, labkit.rank.evaluation) at or below `target_loss`; without
it, the global mean training loss over the last TARGET_WINDOW steps, the window labkit.launch.summary.time_to_target
reads (one all_reduce per step, only when asked). RunConfig checked that stop_at_target comes with a target_loss.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from labkit.core.config import RunConfig

TARGET_WINDOW = 5  # steps: labkit.launch.summary.time_to_target's default window


class TargetStop:
    """Called after each step with the step's mean loss (a device tensor) and its eval figures (or {}); True once
    the target is met. `reached` says so afterwards (the done record's `stopped_at_target`)."""

    def __init__(self, config: RunConfig, *, world_size: int, all_reduce: Callable[[torch.Tensor], Any]):
        """`all_reduce`: the sum over ranks (deepspeed.comm.all_reduce)."""
        self.target = config.target_loss if config.stop_at_target else None
        self.on_eval = bool(config.eval_every)
        self.world_size, self.all_reduce = world_size, all_reduce
        self.recent: list[float] = []  # the ranks' mean training loss of the last TARGET_WINDOW steps
        self.reached = False

    def __call__(self, step_loss: torch.Tensor, evaluated: Mapping[str, float]) -> bool:
        if self.target is None:
            return False
        if self.on_eval:
            self.reached = bool(evaluated) and evaluated["eval_loss"] <= self.target
        else:
            agreed = step_loss.to(torch.float64).reshape(1)  # reading it waits for the device: only when asked
            self.all_reduce(agreed)
            self.recent = [*self.recent, agreed.item() / self.world_size][-TARGET_WINDOW:]
            self.reached = sum(self.recent) / len(self.recent) <= self.target
        return self.reached

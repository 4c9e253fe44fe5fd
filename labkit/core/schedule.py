"""The learning-rate schedule every rank follows, as plain functions of numbers.

`RunConfig.peak_lr`, `RunConfig.warmup_steps_effective` and `RunConfig.lr_at` (which the trainers
write into the optimizer before every step, labkit.rank.trainers) are these functions applied to
the run's fields, so a curve drawn from here is the schedule the ranks really use:

    from labkit.core import schedule
    peak = schedule.peak_lr(2e-3, global_batch=512, base_batch=64, scaling="sqrt")
    schedule.lr_by_samples([0, 256, 1024], lr=2e-3, global_batch=512, base_batch=64, scaling="sqrt",
                           warmup_samples=1024)

The rule: the LR `lr` was tuned at `base_batch`; at another global batch it is scaled (none, linear
for SGD, square root for Adam), then ramped linearly from peak/warmup to the peak over the warmup
steps and held constant after them.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

from labkit.runtime.arguments import whole_number

SCALINGS = ("none", "linear", "sqrt")


def peak_lr(lr: float, *, global_batch: int, base_batch: int, scaling: str = "none") -> float:
    """The LR after scaling `lr` (tuned at `base_batch`) for `global_batch`: times 1 ("none"),
    times the batch ratio ("linear", Goyal et al. 2017) or its square root ("sqrt", Malladi et al. 2022)."""
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
    if isinstance(lr, bool) or not isinstance(lr, numbers.Real) or not 0 < lr < math.inf:
        raise ValueError(f"lr must be a finite learning rate > 0, got {lr!r}")
    whole_number("global_batch", global_batch, 1)
    whole_number("base_batch", base_batch, 1)
    ratio = global_batch / base_batch
    return lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[scaling]


def warmup_steps_for(global_batch: int, *, warmup_steps: int = 0, warmup_samples: int = 0) -> int:
    """Warmup in optimizer steps: `warmup_steps`, or `warmup_samples` over the global batch (rounded
    up), so that every batch size warms up on the same number of samples."""
    whole_number("global_batch", global_batch, 1)
    whole_number("warmup_steps", warmup_steps, 0)
    whole_number("warmup_samples", warmup_samples, 0)
    if warmup_samples:
        return math.ceil(warmup_samples / global_batch)
    return warmup_steps


def lr_at(step: int, *, peak_lr: float, warmup_steps: int = 0) -> float:
    """The LR of optimizer step `step` (1-based): linear warmup to `peak_lr`, then constant."""
    whole_number("step", step, 1)
    whole_number("warmup_steps", warmup_steps, 0)
    if warmup_steps and step <= warmup_steps:
        return peak_lr * step / warmup_steps
    return peak_lr


def lr_by_samples(samples: Iterable[int], *, lr: float, global_batch: int, base_batch: int,
                  scaling: str = "none", warmup_steps: int = 0, warmup_samples: int = 0) -> list[float]:
    """The LR in force when the run has seen each number of `samples` (the step that reads sample
    `s` is step ceil(s / global_batch); sample 0 reads the first step's LR): the schedule on a
    samples axis, where runs at different batches can be set side by side."""
    peak = peak_lr(lr, global_batch=global_batch, base_batch=base_batch, scaling=scaling)
    warmup = warmup_steps_for(global_batch, warmup_steps=warmup_steps, warmup_samples=warmup_samples)
    return [lr_at(max(1, math.ceil(s / global_batch)), peak_lr=peak, warmup_steps=warmup) for s in samples]

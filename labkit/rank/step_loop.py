"""One optimizer step of the worker's loop, timed by a `StepClock` and never waiting for the device (nor for
its data: the step's micro-batches are made before its clock starts).

Factored out of `labkit.rank.worker` (a script) so that a test can run the real loop, with a real model
and trainer, and count the synchronising calls it makes (tests/rank/test_step_sync.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from labkit.rank.step_clock import SKIP, StepClock
from labkit.rank.trainers import SavedActivations, count_saved_activations


def train_step(trainer: Any, data: Iterator[tuple[torch.Tensor, ...]], clock: StepClock, *,
               step: int, grad_accum: int, measure: bool,
               on_census: Callable[[dict[str, int], int], None] = lambda census, activation_bytes: None,
               ) -> tuple[dict[str, int], int, float]:
    """grad_accum micro-batches and the optimizer step, timed by `clock` from its first forward. The step's
    micro-batches are taken from `data` (labkit.rank.batches: gathered, pinned, copied non_blocking) BEFORE the
    clock starts: making them is not the step's time. On `measure` steps (sampled: the census
    is costly) the saved-tensor hooks count activation bytes and the model states are counted at
    the peak, gradients held, before the step; `on_census` sees them there.
    Returns (census or {}, activation bytes, seconds spent on the census and the hooks)."""
    census: dict[str, int] = {}
    activation_bytes, census_s = 0, 0.0
    micro_batches = [next(data) for _ in range(grad_accum)]
    clock.begin()
    for micro, (inputs, labels) in enumerate(micro_batches):
        boundary = micro == grad_accum - 1
        with count_saved_activations() if measure else contextlib.nullcontext(SavedActivations()) as saved:
            loss = trainer.forward(inputs, labels)
        clock.mark("forward_s")
        trainer.backward(loss)
        clock.mark("backward_s")
        clock.add_loss(loss)
        activation_bytes = max(activation_bytes, saved.bytes)
        census_s += saved.seconds
        if boundary and measure:
            started = time.perf_counter()
            census = trainer.census()
            on_census(census, activation_bytes)
            census_s += time.perf_counter() - started
            clock.mark(SKIP)
        trainer.step(step, boundary)
        clock.mark("optimizer_s")
    return census, activation_bytes, census_s

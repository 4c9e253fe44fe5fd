"""Phase times and loss of each optimizer step, read without making the host wait for the device.

On a GPU, `accelerator.synchronize()` around each phase (or `loss.item()` every step) drains the
device queue and removes the host-device overlap that makes training fast. Instead each phase
boundary records a device event (`accelerator.Event(enable_timing=True)`), the step's mean loss is
reduced on the device and copied (non_blocking) into pinned host memory, and a step's figures are
read only once its last event has completed (`Event.query()`, which does not block): usually one
step later. On a synchronized device (DeepSpeed's CPU accelerator has no events) every op has
finished when it returns, so `time.perf_counter()` is exact and a step is ready at once.
On a GPU a rank that fails mid-run therefore loses the records of the last step or two, whose
events had not completed; on CPU nothing is pending.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

PHASES = ("forward_s", "backward_s", "optimizer_s")
SKIP = "skip"  # an interval that belongs to no phase (the census), still inside the step's time


@dataclass(kw_only=True)
class _OpenStep:
    """A step between begin() and end()."""

    marks: list[tuple[str, Any]] = field(default_factory=list)  # (phase that ended here, clock reading)
    losses: list[torch.Tensor] = field(default_factory=list)  # one per micro-step, on the device


@dataclass(kw_only=True)
class _Step:
    """A step that end() closed, waiting for its device work to complete."""

    marks: list[tuple[str, Any]]
    loss: torch.Tensor  # the mean, on the host (pinned) or a CPU tensor
    fields: dict[str, Any]


class StepClock:
    """Use: begin() · mark("forward_s") · add_loss(loss) · mark("backward_s") · ... · end(**fields);
    then ready() returns the records of the steps whose figures can be read without waiting."""

    def __init__(self, accelerator: Any):
        self.accelerator = accelerator
        self.device_events = not accelerator.is_synchronized_device()
        self._pending: deque[_Step] = deque()
        self._free: list[torch.Tensor] = []  # pinned one-value buffers, reused: pinning costs more than a step
        self._current: _OpenStep | None = None

    def _now(self) -> Any:
        if not self.device_events:
            return time.perf_counter()
        event = self.accelerator.Event(enable_timing=True)
        event.record()
        return event

    def _open(self) -> _OpenStep:
        if self._current is None:
            raise RuntimeError("StepClock: begin() a step before marking it, adding its loss or ending it")
        return self._current

    def begin(self) -> None:
        self._current = _OpenStep()
        self._current.marks.append(("", self._now()))

    def mark(self, phase: str) -> None:
        """The phase named (one of PHASES, or SKIP) ends now."""
        self._open().marks.append((phase, self._now()))

    def add_loss(self, loss: torch.Tensor) -> None:
        self._open().losses.append(loss.detach())

    def end(self, **fields: Any) -> torch.Tensor:
        """The step ends now; `fields` go into its record as they are. Returns the step's mean loss
        as a tensor on the device (reading it would wait for the device: only where asked to)."""
        step, self._current = self._open(), None
        mean = torch.stack(step.losses).float().mean() if len(step.losses) > 1 else step.losses[0].float()
        if not self.device_events:  # synchronized: the value is already there
            loss = mean
        else:  # queued before the step's last event: on the host once that event has completed
            loss = self._free.pop() if self._free else self.accelerator.pin_memory(torch.empty(()))
            loss.copy_(mean, non_blocking=True)
        step.marks.append(("", self._now()))
        # The micro-steps' losses are dropped with the open step: only the mean is kept.
        self._pending.append(_Step(marks=step.marks, loss=loss, fields=fields))
        return mean

    def annotate(self, **fields: Any) -> None:
        """Add `fields` to the record of the step that `end` closed last (work done after its clock
        stopped, such as an evaluation)."""
        self._pending[-1].fields.update(fields)

    def ready(self, *, wait: bool = False) -> list[dict[str, Any]]:
        """Records of the finished steps whose device work has completed, oldest first. With
        wait=True (at the end of a run, outside the timed loop) it waits for all of them."""
        out = []
        while self._pending:
            last = self._pending[0].marks[-1][1]
            if self.device_events and not last.query():
                if not wait:
                    break
                last.synchronize()
            out.append(self._read(self._pending.popleft()))
        return out

    def _read(self, step: _Step) -> dict[str, Any]:
        times = dict.fromkeys(PHASES, 0.0)
        for (_, start), (phase, end) in itertools.pairwise(step.marks):
            if phase in times:
                times[phase] += self._seconds(start, end)
        step_time_s = self._seconds(step.marks[0][1], step.marks[-1][1])
        loss = float(step.loss)
        if self.device_events:
            self._free.append(step.loss)
        return {"loss": loss, "step_time_s": step_time_s, **times, **step.fields}

    def _seconds(self, start: Any, end: Any) -> float:
        return end - start if not self.device_events else start.elapsed_time(end) / 1000.0

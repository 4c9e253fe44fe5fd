"""A rank's `done` record (labkit.core.schema.DoneRecord): how the run ended, the last census, the device's peak
FLOP/s (rank 0), the timed steps' wall time and labkit's own share of it, and the rank's memory readings.

`TimedSteps` times the run's steady part: steps from TIMED_FROM_STEP on (steps 1-2 pay for lazy allocations),
evaluation left out.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

TIMED_FROM_STEP = 3  # steps 1-2 pay for lazy allocations; `timed_s` in the done record starts after them


@dataclass(kw_only=True)
class TimedSteps:
    """Use: begin(step) before each step; end(step, ...) after it; fields() once the device's queued work is done."""

    from_step: int = TIMED_FROM_STEP
    started: float = 0.0  # perf_counter() as step `from_step` began
    steps: int = 0
    telemetry_s: float = 0.0  # the timed steps' census, memory readings and records: the instrumentation's cost
    eval_s: float = 0.0  # the timed steps' evaluations, left out of timed_s

    def begin(self, step: int) -> None:
        if step == self.from_step:
            self.started = time.perf_counter()

    def end(self, step: int, *, telemetry_s: float, eval_s: float) -> None:
        """Step `step` is over; `telemetry_s` and `eval_s`: what it spent on instrumentation and evaluation."""
        if step >= self.from_step:
            self.steps += 1
            self.telemetry_s += telemetry_s
            self.eval_s += eval_s

    def fields(self) -> dict[str, Any]:
        """The done record's timing fields, timed_s up to now ({} when no step was timed)."""
        if not self.steps:
            return {}
        return {"timed_steps": self.steps, "timed_s": time.perf_counter() - self.started - self.eval_s,
                "telemetry_s": self.telemetry_s, "eval_s": self.eval_s}


def peak_flops(device_name: str, precision: str, device: str) -> dict[str, Any]:
    """Rank 0's `peak_flops` and `peak_flops_source`: achieved FLOP/s means little without the device's peak next
    to it. The datasheet's figure for a known GPU (by `device_name`), else a matmul measured on `device`."""
    from labkit.runtime.devices import datasheet_peak_flops, measured_matmul_flops

    datasheet = datasheet_peak_flops(device_name, precision)
    if datasheet:
        return {"peak_flops": datasheet, "peak_flops_source": "datasheet"}
    measured, how = measured_matmul_flops(device, precision)
    return {"peak_flops": measured, "peak_flops_source": how}


def done_fields(*, steps: int, stopped_at_target: bool, n_params: int, optimizer_impl: str,
                census: Mapping[str, int], peak: Mapping[str, Any], timed: Mapping[str, Any],
                telemetry_thread_cpu_s: float, fsyncs: int, memory: Mapping[str, int]) -> dict[str, Any]:
    """The done record's fields, in the order they are written: how the run ended, the last census, the peak
    (rank 0), `TimedSteps.fields()`, the telemetry thread's own cost (outside the loop's timing:
    bench_observer_cpu.py reports it) and the memory readings."""
    return {"steps": steps, "stopped_at_target": stopped_at_target, "n_params": n_params,
            "optimizer_impl": optimizer_impl, **census, **peak, **timed,
            "telemetry_thread_cpu_s": round(telemetry_thread_cpu_s, 6), "fsyncs": fsyncs, **memory}

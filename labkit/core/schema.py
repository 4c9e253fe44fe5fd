"""The records a rank writes to `rank<N>.jsonl`, one JSON object a line, keys with their units: `_s` seconds,
`_bytes` bytes, `_flops` FLOP/s. Written by `labkit.rank` (telemetry, step clock, census, worker), read by the
supervisor, the summary, the dashboard and every study; the key names and the byte sums are defined here once.

Every record has `rank` and `time_s` (since the rank started) and an `event`: `start`, `ready`, `step` (or `beat`
with per-step records off), `done`, `error`. A step record carries the step's census on sampled steps
(`census_every`); the `done` record carries the last census the rank took.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict

# A census (labkit.rank.census): bytes of model state one rank keeps alive, counted from its tensors.
STATE_KEYS = ("param_bytes", "grad_bytes", "optim_bytes", "master_bytes")
# The part of those that optimizer offload keeps on the host: optimizer states + master, and gradient partitions.
HOST_KEYS = ("host_optim_bytes", "host_grad_bytes")
# Communication buckets and offload staging copies: not model states, reported apart.
CENSUS_KEYS = (*STATE_KEYS, *HOST_KEYS, "buffer_bytes")
# The rank's memory readings (labkit.rank.telemetry.RankTelemetry.memory); device_* on accelerators but the CPU.
MEMORY_KEYS = ("rss_bytes", "peak_rss_bytes", "device_allocated_bytes", "device_peak_bytes", "device_reserved_bytes")


class Census(TypedDict, total=False):
    param_bytes: int       # parameters (the partition under ZeRO-3, plus its persistent params)
    grad_bytes: int        # gradients (partitions under ZeRO-2/3), host ones included
    optim_bytes: int       # optimizer states (Adam's moments; none for SGD), host ones included
    master_bytes: int      # fp32 master weights of mixed precision, host ones included
    host_optim_bytes: int  # optimizer states + master kept on the host by offload
    host_grad_bytes: int   # gradient partitions kept on the host by offload
    buffer_bytes: int      # communication buckets and offload staging copies


class StepRecord(Census, total=False):
    event: str             # "step"
    rank: int
    time_s: float          # since the rank started
    step: int              # optimizer step, 1-based
    loss: float            # the step's mean loss over its micro-batches
    lr: float
    epoch: float           # samples seen / samples per epoch
    step_time_s: float     # the step's time on the device's clock
    forward_s: float
    backward_s: float
    optimizer_s: float
    samples_per_s: float   # global batch / step_time_s
    activation_bytes: int  # the peak of saved activations so far
    eval_loss: float       # on eval steps (eval_every)
    eval_s: float
    rss_bytes: int
    peak_rss_bytes: int
    device_allocated_bytes: int
    device_peak_bytes: int
    device_reserved_bytes: int


class DoneRecord(Census, total=False):
    event: str                   # "done"
    rank: int
    time_s: float
    steps: int                   # the last step trained
    stopped_at_target: bool      # stop_at_target met
    n_params: int
    optimizer_impl: str
    timed_steps: int             # steps from TIMED_FROM_STEP (labkit.rank.done) on
    timed_s: float               # their wall time, evaluation left out
    telemetry_s: float           # labkit's own instrumentation within timed_s
    eval_s: float
    telemetry_thread_cpu_s: float
    fsyncs: int
    peak_flops: float            # rank 0: the device's peak FLOP/s, datasheet or measured
    peak_flops_source: str
    peak_rss_bytes: int
    device_peak_bytes: int


def _value(census: Mapping[str, Any], key: str) -> float:
    value = census.get(key)
    return value if value else 0  # absent, None (a run without a census) and 0 alike


def state_bytes(census: Mapping[str, Any]) -> float:
    """The model states one rank keeps, wherever they are: parameters, gradients, optimizer states, master."""
    return sum(_value(census, key) for key in STATE_KEYS)


def host_bytes(census: Mapping[str, Any]) -> float:
    """The part of the model states that optimizer offload keeps on the host."""
    return sum(_value(census, key) for key in HOST_KEYS)


def device_bytes(census: Mapping[str, Any], activation_bytes: float = 0) -> float:
    """What one rank keeps on its device: the model states not on the host, plus saved activations. The emulated
    capacity check counts this (communication buffers and ZeRO-3's transiently gathered params are left out)."""
    return state_bytes(census) - host_bytes(census) + (activation_bytes or 0)

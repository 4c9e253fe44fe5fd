"""TEMPORARY STAND-IN, written on branch predict23 only because branch comms23 had not committed its module yet.

The real `labkit.study.comms` (what DeepSpeed 0.19.8 sends, with source lines, bucket counts, the comms-log
reader and the link benchmark) is being written on branch comms23; `git merge comms23` REPLACES this file (take
theirs on conflict). This stand-in keeps only the interface the predictor uses, with one aggregated collective per
kind (count 1), from the facts in the team brief.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Collective:
    op: str            # all_reduce | all_gather | reduce_scatter
    bytes: float       # all_reduce: the tensor; all_gather: the gathered output; reduce_scatter: the input
    count: int
    per: str           # micro_step | step
    phase: str         # forward | backward | optimizer
    dtype: str
    overlappable: bool


def collectives(stage: int, n_params: int, world_size: int, *, precision: str, grad_accum: int = 1,
                offload_optimizer: bool = False, persistent_params: int = 0, **_: object) -> list[Collective]:
    if world_size < 2:
        return []
    size = 4 if precision == "fp32" else 2
    dtype = "fp32" if precision == "fp32" else precision
    full = size * n_params
    if stage == 0:
        return [Collective("all_reduce", full, 1, "step", "backward", dtype, False)]
    if stage in (1, 2):
        per = "step" if stage == 1 else "micro_step"
        return [Collective("all_reduce", full, 1, per, "backward", dtype, False),
                Collective("all_gather", full, 1, "step", "optimizer", dtype, False)]
    sharded = size * max(0, n_params - persistent_params)
    return [Collective("all_gather", sharded, 1, "micro_step", "forward", dtype, True),
            Collective("all_gather", sharded, 1, "micro_step", "backward", dtype, True),
            Collective("reduce_scatter", full, 1, "micro_step", "backward", dtype, True)]


def ring_bytes_sent(c: Collective, world_size: int) -> float:
    factor = 2 * (world_size - 1) / world_size if c.op == "all_reduce" else (world_size - 1) / world_size
    return factor * c.bytes

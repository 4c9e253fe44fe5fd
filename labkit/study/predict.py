"""Predicted step time of DeepSpeed 0.19.8 on hardware this machine does not have ("What about my GPUs?").

One optimizer step of one rank, per strategy (plain PyTorch DDP, ZeRO 0-3, ZeRO-Offload), as a sum of parts the
learner can see (docs/predict.md states the model, its sources and what it leaves out):

* compute: every op of the real model's forward and backward (+ the recomputed forward under activation
  checkpointing), counted on the meta device and timed with a roofline on the GPU kind (`labkit.study.flops`);
  the optimizer's update as memory traffic over the parameters the rank owns;
* communication: what DeepSpeed sends per micro-step and per step (`labkit.study.comms.collectives`, with the
  source lines there), timed with an alpha-beta ring over the slowest link each collective crosses
  (`labkit.runtime.hardware.Cluster.bus_bytes_per_s`); what DeepSpeed can overlap (`Collective.overlappable`)
  hides behind the compute of the phase it runs in, the rest is exposed;
* offload: gradients down in fp32 and parameters up in the training dtype over the GPU's PCIe link, and CPU
  Adam's pass over the rank's fp32 states in host memory;
* memory: `labkit.study.memory` for the model states plus the activations counted on the meta device: fits,
  and the largest micro-batch that fits;
* time to the same loss: steps from S(B) = S_min (1 + B_crit / B).

Every number this module returns is a PREDICTION; `Prediction.to_dict()` says so (`"predicted": true`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from labkit.runtime.hardware import GB, GPU, GPUS, Cluster
from labkit.study import flops, memory

HARDWARE = GPUS   # the GPU presets (labkit.runtime.hardware), as the issue names them

# strategy -> (ZeRO stage or None for plain PyTorch DDP, optimizer offloaded to the host)
STRATEGIES: dict[str, tuple[int | None, bool]] = {
    "torch": (None, False), "z0": (0, False), "z1": (1, False), "z2": (2, False), "z3": (3, False),
    "z1-offload": (1, True), "z2-offload": (2, True), "z3-offload": (3, True),
}
PRECISIONS = ("fp16", "bf16", "fp32")

# The optimizer's pass over each parameter it updates, in bytes of memory traffic. DeepSpeed's fused Adam (GPU)
# and its CPU Adam (csrc/adam/cpu_adam_impl.cpp, 0.19.8) read the fp32 master, gradient, exp_avg and exp_avg_sq
# (16 B) and write master, exp_avg, exp_avg_sq (12 B) and the training-dtype copy of the parameter (2 B).
ADAM_BYTES_PER_PARAM = 30
# CPU Adam is memory-bound on the host. Default host: a 2-socket server with 6 channels of DDR4-2666 per socket,
# 2 x 6 x 21.3 GB/s = 256 GB/s (Intel ARK, Xeon Platinum 8168: the DGX-2's CPUs); pass --host-memory-gb-per-s
# for yours. The node's host bandwidth is shared by its GPUs' ranks.
DEFAULT_HOST_MEMORY_GB_PER_S = 256.0
HOST_MEMORY_EFFICIENCY = flops.MEMORY_EFFICIENCY


class Workload(Protocol):
    name: str
    n_params: int
    persistent_params: int

    def costs(self, micro_batch: int, gpu: GPU, precision: str, checkpointing: bool) -> PhaseCosts: ...


@dataclass(frozen=True)
class PhaseCosts:
    forward_s: float          # one micro-batch's forward
    backward_s: float         # its backward (+ the recomputed forward under activation checkpointing)
    model_flops: float        # forward + backward, no recomputation
    hardware_flops: float     # what the GPU executes (recomputation counted, as Megatron-LM's SC21 paper does)
    activation_bytes: float   # saved for the backward


@dataclass(frozen=True)
class TransformerWorkload:
    shape: flops.Transformer
    name: str = "transformer"

    @property
    def n_params(self) -> int:
        return self.shape.n_params()

    @property
    def persistent_params(self) -> int:
        return self.shape.persistent_params()

    def costs(self, micro_batch: int, gpu: GPU, precision: str, checkpointing: bool) -> PhaseCosts:
        dtype = "fp32" if precision == "fp32" else precision
        layers = self.shape.layers
        c = flops.transformer_costs(self.shape, micro_batch, dtype)
        fwd = c.scaled(lambda x: flops.roofline_s(x.forward, gpu, precision), layers)
        bwd = c.scaled(lambda x: flops.roofline_s(x.backward, gpu, precision), layers)
        f_fwd = c.scaled(lambda x: x.flops("forward"), layers)
        f_bwd = c.scaled(lambda x: x.flops("backward"), layers)
        saved = c.scaled(lambda x: x.saved_bytes, layers)
        if checkpointing:
            # Full recomputation (Megatron-LM's --checkpoint-activations): each layer keeps only its input and the
            # backward recomputes one layer's forward at a time.
            per_layer = c.ops2.saved_bytes - c.ops1.saved_bytes
            base = c.ops1.saved_bytes - per_layer
            size = 4 if precision == "fp32" else 2
            saved = base + layers * micro_batch * self.shape.seq * self.shape.hidden * size + per_layer
            return PhaseCosts(fwd, bwd + fwd, f_fwd + f_bwd, 2 * f_fwd + f_bwd, saved)
        return PhaseCosts(fwd, bwd, f_fwd + f_bwd, f_fwd + f_bwd, saved)


@dataclass
class ModuleWorkload:
    """A lab model (`mlp`, `gpt`, `pkg.mod:build_model`) built from a RunConfig on the meta device."""

    config: Any
    name: str = "model"
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        from labkit.models import builders

        numels = builders.param_numels(self.config)
        self.n_params = sum(numels)
        self.persistent_params = builders.persistent_params(numels)
        self.name = self.config.model

    def census(self, micro_batch: int, precision: str) -> flops.Census:
        key = (micro_batch, precision)
        if key not in self._cache:
            import torch
            from torch.utils.data import default_collate

            from labkit.models import builders

            dataset = builders.build_dataset(self.config)
            sample = default_collate([dataset[0]] * micro_batch)
            dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]
            with torch.device("meta"):
                model = builders.build_model(self.config).to(dtype)
            inputs, labels = (t.to("meta").to(dtype) if t.is_floating_point() else t.to("meta") for t in sample)
            loss_fn = builders.loss_function(self.config)
            self._cache[key] = flops.module_census(model, lambda: loss_fn(model, inputs, labels).float())
        return self._cache[key]

    def costs(self, micro_batch: int, gpu: GPU, precision: str, checkpointing: bool) -> PhaseCosts:
        if checkpointing:
            raise ValueError("--activation-checkpointing is modelled for --transformer shapes (the lab's models "
                             "do not checkpoint)")
        c = self.census(micro_batch, precision)
        fwd, bwd = flops.roofline_s(c.forward, gpu, precision), flops.roofline_s(c.backward, gpu, precision)
        return PhaseCosts(fwd, bwd, c.flops(), c.flops(), c.saved_bytes)


# -- communication time ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClusterLinks:
    """Alpha-beta ring on a cluster's links: NCCL's ring latency + ring bytes / bus bandwidth."""

    cluster: Cluster

    def seconds(self, op: str, ring_bytes: float, world_size: int) -> float:
        return self.cluster.ring_latency_s(op, world_size) + ring_bytes / self.cluster.bus_bytes_per_s(world_size)


@dataclass(frozen=True)
class FittedLinks:
    """A link fit measured on this machine (`measure_links`): per op, alpha + ring bytes x beta."""

    fit: Any

    def seconds(self, op: str, ring_bytes: float, world_size: int) -> float:
        alpha, beta = _fit_for(self.fit, op)
        return alpha + ring_bytes * beta


def _fit_for(fit: Any, op: str) -> tuple[float, float]:
    """(alpha_s, beta_s_per_byte) of one op from a comms.LinkFit or its JSON dict (falls back to all_reduce's)."""
    table = fit if isinstance(fit, dict) else dataclasses.asdict(fit)
    ops = table.get("ops", table)
    entry = ops.get(op) or ops.get("all_reduce") or next(iter(ops.values()))
    return float(entry["alpha_s"]), float(entry["beta_s_per_byte"])


def collective_rows(stage: int | None, n_params: int, world_size: int, *, precision: str, grad_accum: int,
                    offload_optimizer: bool, persistent_params: int) -> list[Any]:
    """DeepSpeed 0.19.8's collectives for one rank (comms.collectives); plain PyTorch DDP sends stage 0's
    gradient all-reduce, but in buckets during the backward (overlapped: torch's DDP docs)."""
    if world_size < 2:
        return []
    from labkit.study import comms

    zero_stage = 0 if stage is None else stage
    rows = comms.collectives(zero_stage, n_params, world_size, precision=_comms_precision(precision),
                             grad_accum=grad_accum, offload_optimizer=offload_optimizer,
                             persistent_params=persistent_params)
    if stage is None:
        rows = [dataclasses.replace(c, overlappable=True, phase="backward") for c in rows]
    return list(rows)


def _comms_precision(precision: str) -> str:
    return precision


@dataclass(frozen=True)
class CommTime:
    total_s: float
    exposed_s: float
    rows: list[dict[str, Any]]


def comm_time(rows: Iterable[Any], links: Any, world_size: int, *, grad_accum: int,
              hide_behind: dict[str, float]) -> CommTime:
    """Seconds per optimizer step: every collective's count x (alpha-beta time of its ring bytes); overlappable
    ones hide behind the compute of their phase per micro-step (`hide_behind`: phase -> seconds per micro-step),
    the rest is exposed."""
    rows = list(rows)
    if not rows:
        return CommTime(0.0, 0.0, [])
    from labkit.study import comms

    total = exposed = 0.0
    per_phase: dict[str, float] = {}
    table = []
    for c in rows:
        repeats = c.count * (grad_accum if c.per == "micro_step" else 1)
        one = links.seconds(c.op, comms.ring_bytes_sent(c, world_size), world_size)
        seconds = repeats * one
        total += seconds
        if c.overlappable and c.phase in hide_behind:
            per_phase[c.phase] = per_phase.get(c.phase, 0.0) + seconds / grad_accum
        else:
            exposed += seconds
        table.append({"op": c.op, "phase": c.phase, "per": c.per, "count": c.count, "bytes": c.bytes,
                      "overlappable": bool(c.overlappable), "seconds_per_step": seconds})
    for phase, seconds in per_phase.items():
        exposed += grad_accum * max(0.0, seconds - hide_behind[phase])
    return CommTime(total, exposed, table)


# -- the prediction ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Prediction:
    strategy: str
    world_size: int
    micro_batch: int
    grad_accum: int
    global_batch: int
    step_time_s: float
    samples_per_s: float
    model_tflops_per_gpu: float
    hardware_tflops_per_gpu: float
    compute_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    comm_s: float
    exposed_comm_s: float
    offload_s: float
    device_bytes: float
    activation_bytes: float
    fits: bool
    max_micro_batch: int
    hardware: str
    collectives: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["predicted"] = True
        return out


def _partition(stage: int | None, world_size: int) -> int:
    return world_size if stage is not None and stage >= 1 else 1


def predict(workload: Workload, cluster: Cluster, *, strategy: str, micro_batch: int, grad_accum: int = 1,
            precision: str = "fp16", activation_checkpointing: bool = False,
            host_memory_gb_per_s: float = DEFAULT_HOST_MEMORY_GB_PER_S) -> Prediction:
    """One optimizer step of one rank of `workload` on `cluster` (module doc). Every figure is predicted."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if micro_batch < 1 or grad_accum < 1:
        raise ValueError("micro_batch and grad_accum must be >= 1")
    stage, offload = STRATEGIES[strategy]
    gpu, n = cluster.gpu, cluster.world_size
    gpu.peak(precision)  # a precision the GPU has no tensor cores for is refused here
    costs = workload.costs(micro_batch, gpu, precision, activation_checkpointing)
    owned = workload.n_params / _partition(stage, n)
    optimizer_s = 0.0 if offload else owned * ADAM_BYTES_PER_PARAM / (gpu.memory_bytes_per_s * flops.MEMORY_EFFICIENCY)
    compute_s = grad_accum * (costs.forward_s + costs.backward_s) + optimizer_s
    rows = collective_rows(stage, workload.n_params, n, precision=precision, grad_accum=grad_accum,
                           offload_optimizer=offload, persistent_params=workload.persistent_params)
    comm = comm_time(rows, ClusterLinks(cluster), n, grad_accum=grad_accum,
                     hide_behind={"forward": costs.forward_s, "backward": costs.backward_s})
    offload_s = _offload_s(stage, offload, owned, grad_accum, cluster, precision, host_memory_gb_per_s)
    step = compute_s + comm.exposed_s + offload_s
    global_batch = micro_batch * grad_accum * n
    states, fits, max_micro = _memory(workload, cluster, stage, offload, precision, micro_batch,
                                      activation_checkpointing)
    return Prediction(
        strategy=strategy, world_size=n, micro_batch=micro_batch, grad_accum=grad_accum, global_batch=global_batch,
        step_time_s=step, samples_per_s=global_batch / step,
        model_tflops_per_gpu=costs.model_flops * grad_accum / step / 1e12,
        hardware_tflops_per_gpu=costs.hardware_flops * grad_accum / step / 1e12,
        compute_s=compute_s, forward_s=costs.forward_s, backward_s=costs.backward_s, optimizer_s=optimizer_s,
        comm_s=comm.total_s, exposed_comm_s=comm.exposed_s, offload_s=offload_s,
        device_bytes=states + costs.activation_bytes, activation_bytes=costs.activation_bytes, fits=fits,
        max_micro_batch=max_micro, hardware=cluster.describe(), collectives=comm.rows)


def _offload_s(stage: int | None, offload: bool, owned: float, grad_accum: int, cluster: Cluster, precision: str,
               host_memory_gb_per_s: float) -> float:
    """ZeRO-Offload, not overlapped (DeepSpeed's default): the rank's gradient partition goes down in fp32 (stages
    2-3 every micro-step, stage 1 at the boundary), CPU Adam runs over it on the host, and the updated parameters
    come back up in the training dtype."""
    if not offload:
        return 0.0
    host = cluster.host_link()
    pcie = host.bytes_per_s * host.efficiency
    downs = grad_accum if stage in (2, 3) else 1
    param_size = 4 if precision == "fp32" else 2
    host_bw = host_memory_gb_per_s * GB * HOST_MEMORY_EFFICIENCY / cluster.gpus_per_node
    return downs * 4 * owned / pcie + owned * ADAM_BYTES_PER_PARAM / host_bw + param_size * owned / pcie


def _memory(workload: Workload, cluster: Cluster, stage: int | None, offload: bool, precision: str,
            micro_batch: int, checkpointing: bool) -> tuple[float, bool, int]:
    """(device bytes of the model states + bucket, fits, the largest micro-batch that fits): states from
    labkit.study.memory (DeepSpeed 0.19.8's accounting), activations counted on the meta device (linear in the
    micro-batch: measured at 1 sample)."""
    n = cluster.world_size
    mem_precision = "fp32" if precision == "fp32" else precision
    zero = 0 if stage is None else stage
    states = memory.model_state_bytes(workload.n_params, zero, n, mem_precision, offload,
                                      persistent_params=workload.persistent_params if zero == 3 else 0)
    device = states["device_bytes"] + (memory.reduce_bucket_bytes(zero, mem_precision) if stage else 0)
    per_sample = workload.costs(1, cluster.gpu, precision, checkpointing).activation_bytes
    room = cluster.gpu.memory_bytes - device
    max_micro = max(0, int(room // per_sample)) if per_sample > 0 else 0
    return device, micro_batch <= max_micro, max_micro


# -- time to the same loss --------------------------------------------------------------------------------------
def steps_to_target(global_batch: float, b_crit: float, s_min: float = 1.0) -> float:
    """S(B) = S_min (1 + B_crit / B) (McCandlish et al. 2018, eq. 2.11)."""
    if global_batch <= 0 or b_crit < 0:
        raise ValueError("global_batch must be > 0 and b_crit >= 0")
    return s_min * (1.0 + b_crit / global_batch)


def b_crit_from(results_dir: str | os.PathLike) -> float | None:
    """The lab's measured B_simple (pooled gradient noise scale over every probe of noise.csv), else None."""
    import pandas as pd

    from labkit.study.noise_scale import aggregate

    path = Path(results_dir) / "noise.csv"
    if not path.exists():
        return None
    noise = pd.read_csv(path)
    pooled = aggregate(noise[["grad_norm_small_sq", "grad_norm_big_sq", "noise_b_small", "noise_b_big"]]
                       .itertuples(index=False, name=None))
    return None if pooled is None else pooled.b_simple

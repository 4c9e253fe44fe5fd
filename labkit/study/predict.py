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
from labkit.runtime.hardware import gpu as find_gpu
from labkit.study import flops, memory
from labkit.study.verdict import FLAT_BAND, verdict

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
# ZeRO-3's host-side cost of one submodule fetch (DeepSpeed's pre-forward / pre-backward hooks, Python): measured
# on this lab's machine by `measure_zero3_fetch_s` (data/predict-ci/host.json says when and at what load); the host
# of a GPU node runs the same Python. A micro-step cannot be shorter than the host's work to issue it.
HOST_JSON = Path(__file__).resolve().parents[2] / "data" / "predict-ci" / "host.json"


def zero3_fetch_s() -> float:
    import json

    return float(json.loads(HOST_JSON.read_text())["zero3_fetch_s"]) if HOST_JSON.exists() else 0.0
HOST_MEMORY_EFFICIENCY = flops.MEMORY_EFFICIENCY


class Workload(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def n_params(self) -> int: ...

    @property
    def persistent_params(self) -> int: ...

    @property
    def param_modules(self) -> int: ...

    def module_layout(self) -> list[list[int]]: ...

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

    @property
    def param_modules(self) -> int:
        return self.shape.param_modules()

    def module_layout(self) -> list[list[int]]:
        return self.shape.module_layout()

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
        from labkit.study import comms

        self.layout = comms.module_layout(builders.meta_model(self.config))
        self.param_modules = len(self.layout)
        self.name = self.config.model

    def module_layout(self) -> list[list[int]]:
        return self.layout

    def census(self, micro_batch: int, precision: str) -> flops.Census:
        key = (micro_batch, precision)
        if key not in self._cache:
            import torch
            from torch.utils.data import default_collate

            from labkit.models import builders

            dataset = builders.build_dataset(self.config)
            sample = default_collate([dataset[0]] * micro_batch)
            dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]
            loss_fn = builders.loss_function(self.config)

            def census_on(device: str) -> flops.Census:
                with torch.device(device), torch.random.fork_rng(devices=[]):
                    model = builders.build_model(self.config).to(dtype)
                inputs, labels = (t.to(device).to(dtype) if t.is_floating_point() else t.to(device) for t in sample)
                return flops.module_census(model, lambda: loss_fn(model, inputs, labels).float())

            try:
                self._cache[key] = census_on("meta")
            except RuntimeError as exc:
                # A model whose forward reads a value (Hugging Face's packed-sequence check calls .item()) cannot
                # run on the meta device: count it on a real CPU copy instead (the lab's models are small).
                if "meta" not in str(exc):
                    raise
                self._cache[key] = census_on("cpu")
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


def collective_rows(stage: int | None, workload: Workload, world_size: int, *, precision: str, grad_accum: int,
                    offload_optimizer: bool) -> list[Any]:
    """DeepSpeed 0.19.8's collectives for one rank (comms.collectives, with the model's module layout: exact
    buckets, per-module ZeRO-3 gathers); plain PyTorch DDP sends stage 0's gradient all-reduce, but in buckets
    during the backward (overlapped: torch's DDP docs)."""
    if world_size < 2:
        return []
    from labkit.study import comms

    rows = comms.collectives(0 if stage is None else stage, workload.n_params, world_size, precision=precision,
                             grad_accum=grad_accum, offload_optimizer=offload_optimizer,
                             modules=workload.module_layout())
    if stage is None:
        rows = [dataclasses.replace(c, overlappable=True, phase="backward") for c in rows]
    return list(rows)


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
        repeats = c.per_step
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
    host_overhead_s: float
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
    # The host issues the GPU's work asynchronously; ZeRO-3's per-module fetch hooks are host work, so a micro-step
    # takes the longer of the device's compute and the host's hooks (2 fetches per module: forward and backward).
    host_s = 2 * workload.param_modules * zero3_fetch_s() if stage == 3 else 0.0
    if host_s > costs.forward_s + costs.backward_s:
        scale = host_s / (costs.forward_s + costs.backward_s)
        costs = dataclasses.replace(costs, forward_s=costs.forward_s * scale, backward_s=costs.backward_s * scale)
    owned = workload.n_params / _partition(stage, n)
    optimizer_s = 0.0 if offload else owned * ADAM_BYTES_PER_PARAM / (gpu.memory_bytes_per_s * flops.MEMORY_EFFICIENCY)
    compute_s = grad_accum * (costs.forward_s + costs.backward_s) + optimizer_s
    rows = collective_rows(stage, workload, n, precision=precision, grad_accum=grad_accum, offload_optimizer=offload)
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
        host_overhead_s=grad_accum * host_s,
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


# -- the predicted answer card ---------------------------------------------------------------------------------
WAYS = ("ranks", "micro_batch", "grad_accum")
GRAD_ACCUM_RANGE = (1, 16)


def _way_entry(before: Prediction, after: Prediction, kind: str, b_crit: float | None, condition: str) -> dict:
    if kind == "per_step":
        ratio = after.step_time_s / before.step_time_s
    elif kind == "per_epoch":
        ratio = (after.step_time_s / after.global_batch) / (before.step_time_s / before.global_batch)
    else:
        if b_crit is None:
            return {"verdict": None, "ratio": None, "from_batch": before.global_batch, "to_batch": after.global_batch,
                    "condition": "no critical batch: give --b-crit or --results DIR with noise.csv"}
        ratio = (after.step_time_s * steps_to_target(after.global_batch, b_crit)) / (
            before.step_time_s * steps_to_target(before.global_batch, b_crit))
    return {"verdict": verdict(ratio), "ratio": ratio, "from_batch": before.global_batch,
            "to_batch": after.global_batch, "condition": condition}


def _conditions(before: Prediction, after: Prediction, b_crit: float | None) -> dict[str, str]:
    hidden = after.comm_s - after.exposed_comm_s
    step = (f"predicted: {after.exposed_comm_s:.3g} s of {after.comm_s:.3g} s communication exposed per step "
            f"({hidden:.3g} s hidden behind compute), offload {after.offload_s:.3g} s, compute {after.compute_s:.3g} s")
    rate = after.samples_per_s / before.samples_per_s
    scale = after.global_batch / before.global_batch
    epoch = (f"predicted samples/s x{rate:.2f} for a {scale:g}x batch: "
             + ("the device is saturated (throughput no longer rises with the batch)" if rate < 1.1 else
                "throughput still rises with the batch"))
    if b_crit is None:
        target = "no critical batch given"
    else:
        where = "above" if after.global_batch > b_crit else "below"
        steps = steps_to_target(after.global_batch, b_crit) / steps_to_target(before.global_batch, b_crit)
        target = (f"S(B) = S_min (1 + B_crit/B) with B_crit = {b_crit:.4g}: batch {after.global_batch} is {where} "
                  f"it (steps x{steps:.2f})")
    return {"per_step": step, "per_epoch": epoch, "to_target": target}


def predicted_card(workload: Workload, cluster: Cluster, *, strategy: str = "z0", micro_batch: int = 8,
                   micro_batch_range: tuple[int, int] | None = None, precision: str = "fp16",
                   activation_checkpointing: bool = False, b_crit: float | None = None) -> dict[str, Any]:
    """The answer card's shape (labkit.study.card: ways x per_step/per_epoch/to_target, each with verdict, ratio,
    from_batch, to_batch, condition), PREDICTED for `cluster`. ranks: 1 GPU -> every GPU at `micro_batch`;
    micro_batch: `micro_batch_range` (default micro_batch/4 -> micro_batch*4) on every GPU; grad_accum: 1 -> 16."""
    def run(c: Cluster, m: int, a: int = 1) -> Prediction:
        return predict(workload, c, strategy=strategy, micro_batch=m, grad_accum=a, precision=precision,
                       activation_checkpointing=activation_checkpointing)

    low, high = micro_batch_range or (max(1, micro_batch // 4), micro_batch * 4)
    one = dataclasses.replace(cluster, gpus_per_node=1, nodes=1, inter_gbps=0.0)
    pairs: dict[str, tuple[Prediction, Prediction] | None] = {
        "ranks": None if cluster.world_size == 1 else (run(one, micro_batch), run(cluster, micro_batch)),
        "micro_batch": (run(cluster, low), run(cluster, high)),
        "grad_accum": (run(cluster, micro_batch, GRAD_ACCUM_RANGE[0]), run(cluster, micro_batch, GRAD_ACCUM_RANGE[1])),
    }
    ways: dict[str, Any] = {}
    for way, pair in pairs.items():
        if pair is None:
            ways[way] = {kind: {"verdict": None, "ratio": None, "from_batch": None, "to_batch": None,
                                "condition": "1 device: ranks cannot grow"} for kind in ("per_step", "per_epoch",
                                                                                         "to_target")}
            continue
        before, after = pair
        conditions = _conditions(before, after, b_crit)
        ways[way] = {kind: _way_entry(before, after, kind, b_crit, conditions[kind])
                     for kind in ("per_step", "per_epoch", "to_target")}
    return {"ways": ways, "deepspeed": _deepspeed_line(workload, cluster, micro_batch, precision,
                                                       activation_checkpointing),
            "predicted": True, "flat_band": FLAT_BAND,
            "predicted_for": {"hardware": cluster.describe(), "gpu": cluster.gpu.name, "world_size": cluster.world_size,
                              "model": workload.name, "n_params": workload.n_params, "strategy": strategy,
                              "precision": precision, "activation_checkpointing": activation_checkpointing,
                              "b_crit": b_crit}}


def _deepspeed_line(workload: Workload, cluster: Cluster, micro_batch: int, precision: str, ckpt: bool) -> str:
    base = predict(workload, cluster, strategy="z0", micro_batch=micro_batch, precision=precision,
                   activation_checkpointing=ckpt)
    parts = []
    for strategy in ("z1", "z2", "z3", "z2-offload"):
        p = predict(workload, cluster, strategy=strategy, micro_batch=micro_batch, precision=precision,
                    activation_checkpointing=ckpt)
        parts.append(f"{strategy} {p.step_time_s / base.step_time_s:.2f}x the step, largest micro-batch "
                     f"{p.max_micro_batch} (stage 0: {base.max_micro_batch})")
    return "predicted against ZeRO stage 0 at micro-batch " + f"{micro_batch}: " + "; ".join(parts)


# -- calibrated on the learner's own run ----------------------------------------------------------------------------
@dataclass(frozen=True)
class MeasuredRun:
    """What a finished run measured, per optimizer step (rank 0's medians after the first two steps)."""

    run_dir: str
    config: dict[str, Any]
    forward_s: float
    backward_s: float
    optimizer_s: float
    step_time_s: float
    steps: int

    @property
    def world_size(self) -> int:
        return int(self.config["world_size"])

    @property
    def stage(self) -> int | None:
        return None if self.config.get("example") == "pytorch" else int(self.config.get("stage") or 0)

    @property
    def offload(self) -> bool:
        return bool(self.config.get("offload_optimizer"))

    @property
    def threads_per_rank(self) -> int:
        return int(self.config.get("threads_per_rank") or max(1, (os.cpu_count() or 1) // self.world_size))


SKIP_STEPS = 2
STATISTICS = ("median", "p10")  # p10: the fastest decile of steps, the least disturbed on a shared machine


def read_run(run_dir: str | os.PathLike, statistic: str = "median") -> MeasuredRun:
    """A finished labkit run directory (config.json + rank0.jsonl with per-step phase times), each phase summarised
    over the steps after the first two by `statistic` (median, or p10 on a machine other processes load)."""
    import json
    import statistics

    from labkit.live.records import read_records

    path = Path(run_dir)
    if not (path / "config.json").exists():
        raise ValueError(f"not a labkit run directory (no config.json): {run_dir}")
    config = json.loads((path / "config.json").read_text())
    steps = [r for r in read_records(path / "rank0.jsonl") if r.get("event") == "step" and "forward_s" in r]
    steps = steps[SKIP_STEPS:] if len(steps) > SKIP_STEPS + 2 else steps
    if not steps:
        raise ValueError(f"{run_dir} has no per-step records with phase times (a run with telemetry on is needed)")

    if statistic not in STATISTICS:
        raise ValueError(f"statistic must be one of {STATISTICS}, got {statistic!r}")

    def summary(key: str) -> float:
        values = sorted(float(r.get(key) or 0.0) for r in steps)
        if statistic == "p10":
            return values[int(0.1 * (len(values) - 1))]
        return float(statistics.median(values))

    return MeasuredRun(str(path), config, summary("forward_s"), summary("backward_s"), summary("optimizer_s"),
                       summary("step_time_s"), len(steps))


def effective_cores(threads_per_rank: int, ranks: int, cores: int) -> float:
    """Cores one CPU rank computes on: its threads, or its share of the machine's cores when ranks x threads
    oversubscribe them (ranks on one machine share its cores: no fudge factor, the share)."""
    return min(float(threads_per_rank), cores / ranks)


@dataclass(frozen=True)
class CpuDevice:
    """This machine's per-thread FLOP/s, memory bandwidth and per-op dispatch cost, measured (for the cost of a
    micro-batch of another size on CPU ranks: a roofline plus one dispatch per op)."""

    flops_per_s: float
    bytes_per_s: float
    op_overhead_s: float

    def seconds(self, ops: list[flops.Op]) -> float:
        return float(sum(max(op.flops / self.flops_per_s, op.bytes / self.bytes_per_s) + self.op_overhead_s
                         for op in ops))


def measure_cpu_device(seconds: float = 0.2) -> CpuDevice:
    import time

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        a @ b
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            a @ b
            n += 1
        flops_per_s = 2 * 512**3 * n / (time.perf_counter() - start)
        big = torch.empty(8 << 20)
        src = torch.randn(8 << 20)
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            big.copy_(src)
            n += 1
        bytes_per_s = 2 * big.numel() * 4 * n / (time.perf_counter() - start)
        tiny = torch.zeros(1)
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            tiny.add_(1.0)
            n += 1
        overhead = (time.perf_counter() - start) / n
    finally:
        torch.set_num_threads(threads)
    return CpuDevice(flops_per_s, bytes_per_s, overhead)


def calibrated(run: MeasuredRun, link_fit: Any, *, world_size: int | None = None, micro_batch: int | None = None,
               stage: int | None = None, cores: int | None = None, threads_per_rank: int | None = None,
               device: CpuDevice | None = None) -> dict[str, Any]:
    """The same training as `run`, PREDICTED at another world size, micro-batch or ZeRO stage on this machine:
    the run's measured compute per micro-step (less the communication it had, predicted), the optimizer's measured
    time over the parameters a rank owns, and DeepSpeed's collectives timed with `link_fit` (measure_links on this
    machine). CPU ranks share the machine's cores: each computes on `effective_cores`."""
    from labkit.launch.config import RunConfig

    config = RunConfig.from_dict({k: v for k, v in run.config.items() if k in RunConfig.__dataclass_fields__})
    old_n, new_n = run.world_size, world_size or run.world_size
    old_stage = run.stage
    new_stage = old_stage if stage is None else stage
    if new_stage is not None and new_stage == 0 and run.offload:
        raise ValueError("offload needs ZeRO stage >= 1")
    accum = int(run.config.get("grad_accum") or 1)
    old_m, new_m = int(run.config["micro_batch"]), micro_batch or int(run.config["micro_batch"])
    cores = cores or os.cpu_count() or 1
    new_threads = threads_per_rank or (config.threads_per_rank if world_size is None and config.threads_per_rank
                                       else max(1, cores // new_n))
    links = FittedLinks(link_fit)
    precision = run.config.get("precision", "fp32")

    def rows(stage_: int | None, n: int, m_accum: int) -> list[Any]:
        """The run's own config (its ds_config's ZeRO settings, its model's layout) at `n` ranks and `stage_`."""
        from labkit.launch.config import without_local_device_checks
        from labkit.study import comms

        if n < 2:
            return []
        values = {**run.config, "world_size": n, "stage": 0 if stage_ is None else stage_, "grad_accum": m_accum}
        with without_local_device_checks():
            variant = RunConfig.from_dict({k: v for k, v in values.items() if k in RunConfig.__dataclass_fields__})
        return comms.run_collectives(variant)

    # What the measured run spent communicating (predicted with the same link fit), taken out of its step time (the
    # step, not the sum of its phases: one statistic over whole steps, the same one the prediction is compared with).
    had = comm_time(rows(old_stage, old_n, accum), links, old_n, grad_accum=accum, hide_behind={})
    compute_old = max(run.step_time_s - had.total_s, 0.0)
    optimizer_old = max(run.optimizer_s - sum(r["seconds_per_step"] for r in had.rows if r["phase"] == "optimizer"),
                        0.0)
    micro_old = max(compute_old - optimizer_old, 0.0) / accum
    speed = effective_cores(run.threads_per_rank, old_n, cores) / effective_cores(new_threads, new_n, cores)
    scale = 1.0
    if new_m != old_m:
        work = ModuleWorkload(config)
        device = device or measure_cpu_device()
        old_c, new_c = work.census(old_m, precision), work.census(new_m, precision)
        scale = device.seconds(new_c.forward + new_c.backward) / device.seconds(old_c.forward + old_c.backward)
    micro_new = micro_old * scale * speed
    optimizer_new = optimizer_old * speed * _partition(old_stage, old_n) / _partition(new_stage, new_n)
    spare = cores > new_n * new_threads
    share = micro_new / 2  # forward ~ 1/3, backward ~ 2/3 of a micro-step; only used when a core is spare
    comm = comm_time(rows(new_stage, new_n, accum), links, new_n, grad_accum=accum,
                     hide_behind={"forward": share, "backward": share} if spare else {})
    step = accum * micro_new + optimizer_new + comm.exposed_s
    global_batch = new_m * accum * new_n
    return {"predicted": True, "calibrated_from": run.run_dir, "world_size": new_n, "micro_batch": new_m,
            "grad_accum": accum, "stage": new_stage, "offload_optimizer": run.offload, "threads_per_rank": new_threads,
            "global_batch": global_batch, "step_time_s": step, "samples_per_s": global_batch / step,
            "compute_s": accum * micro_new + optimizer_new, "optimizer_s": optimizer_new, "comm_s": comm.total_s,
            "exposed_comm_s": comm.exposed_s, "offload_s": 0.0, "measured_step_time_s": run.step_time_s,
            "collectives": comm.rows}


# -- `labkit predict` ---------------------------------------------------------------------------------------------
def measure_links(*args: Any, **kwargs: Any) -> Any:
    """labkit.study.comms.measure_links: a short all-reduce / all-gather / reduce-scatter benchmark on this machine
    (real processes; gloo on CPU, NCCL on GPU), fitted per op as alpha + bytes x beta."""
    from labkit.study import comms

    return comms.measure_links(*args, **kwargs)


def _bad(field_name: str, message: str) -> Exception:
    from labkit.launch.config import ConfigError

    return ConfigError(field_name, message)


def _cluster(args: Any) -> Cluster:
    try:
        kind = find_gpu(args.gpu)
        return Cluster(gpu=kind, gpus_per_node=args.gpus_per_node, nodes=args.nodes, intra=args.intra,
                       inter_gbps=args.inter_gbps)
    except ValueError as exc:
        raise _bad("hardware", str(exc)) from None


def _strategy(args: Any) -> str:
    if args.plain_pytorch:
        if args.stage is not None or args.offload_optimizer:
            raise _bad("plain_pytorch", "--plain-pytorch takes no --stage or --offload-optimizer")
        return "torch"
    stage = 0 if args.stage is None else args.stage
    if args.offload_optimizer and stage == 0:
        raise _bad("offload_optimizer", "DeepSpeed offloads the optimizer only with ZeRO stage >= 1 (--stage 1-3)")
    return f"z{stage}" + ("-offload" if args.offload_optimizer else "")


def _workload(args: Any) -> Workload:
    if args.transformer:
        try:
            return TransformerWorkload(flops.Transformer.parse(args.transformer))
        except ValueError as exc:
            raise _bad("transformer", str(exc)) from None
    from labkit.launch.config import RunConfig
    from labkit.models import builders

    values: dict[str, Any] = {"example": "deepspeed", "model": args.model}
    for name in ("hidden", "depth", "input_size"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    config = RunConfig.from_dict(values)
    builders.check_importable(config)
    return ModuleWorkload(config)


def _accumulation(args: Any, micro: int, world_size: int) -> int:
    if args.global_batch is not None:
        if args.grad_accum is not None:
            raise _bad("global_batch", "give --global-batch or --grad-accum, not both")
        accum, rest = divmod(args.global_batch, micro * world_size)
        if accum < 1 or rest:
            raise _bad("global_batch", f"--global-batch {args.global_batch} must be micro-batch {micro} x "
                                       f"accumulation x {world_size} GPUs")
        return accum
    return args.grad_accum or 1


def _b_crit(args: Any) -> float | None:
    if args.b_crit is not None:
        if args.b_crit <= 0:
            raise _bad("b_crit", "--b-crit must be > 0")
        return float(args.b_crit)
    if args.results:
        if not Path(args.results).is_dir():
            raise _bad("results", f"no such results directory: {args.results}")
        return b_crit_from(args.results)
    return None


def cli(args: Any) -> int:
    """`labkit predict` (labkit.cli builds the parser). Every check runs before any counting or benchmark."""
    import json

    for name in ("gpus_per_node", "nodes", "micro_batch", "global_batch", "grad_accum", "world_size",
                 "threads_per_rank"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise _bad(name, f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.from_run:
        out = _cli_from_run(args)
    else:
        cluster, strategy, b_crit = _cluster(args), _strategy(args), _b_crit(args)
        precision = args.precision or "fp16"
        try:
            cluster.gpu.peak(precision)
        except ValueError as exc:
            raise _bad("precision", str(exc)) from None
        micro = args.micro_batch or 1
        accum = _accumulation(args, micro, cluster.world_size)
        workload = _workload(args)
        try:
            pred = predict(workload, cluster, strategy=strategy, micro_batch=micro, grad_accum=accum,
                           precision=precision, activation_checkpointing=args.activation_checkpointing,
                           host_memory_gb_per_s=args.host_memory_gb_per_s or DEFAULT_HOST_MEMORY_GB_PER_S)
        except ValueError as exc:
            raise _bad("predict", str(exc)) from None
        out = pred.to_dict()
        out["model"], out["n_params"] = workload.name, workload.n_params
        if b_crit is not None:
            out["b_crit"] = b_crit
            out["steps_to_target_over_s_min"] = steps_to_target(pred.global_batch, b_crit)
        if args.card:
            out["card"] = predicted_card(workload, cluster, strategy=strategy, micro_batch=micro, precision=precision,
                                         activation_checkpointing=args.activation_checkpointing, b_crit=b_crit)
    if args.format == "json":
        print(json.dumps(out, indent=2, default=float))
    else:
        print(format_table(out))
    return 0


def _cli_from_run(args: Any) -> dict[str, Any]:
    import json

    if args.transformer or args.model:
        raise _bad("from_run", "--from takes the model from the run")
    if not Path(args.from_run).is_dir():
        raise _bad("from_run", f"no such run directory: {args.from_run}")
    try:
        run = read_run(args.from_run)
    except ValueError as exc:
        raise _bad("from_run", str(exc)) from None
    stage = args.stage
    if args.offload_optimizer or args.plain_pytorch:
        raise _bad("from_run", "--from keeps the run's offload and DeepSpeed: change --world-size, --micro-batch or "
                               "--stage")
    if stage == 0 and run.offload:
        raise _bad("stage", "the run offloads its optimizer: stage 0 cannot")
    if args.links:
        if not Path(args.links).is_file():
            raise _bad("links", f"no such link fit: {args.links}")
        fit = json.loads(Path(args.links).read_text())
    else:
        fit = measure_links(world_size=max(2, args.world_size or run.world_size))
    return calibrated(run, fit, world_size=args.world_size, micro_batch=args.micro_batch, stage=stage,
                      threads_per_rank=args.threads_per_rank)


def format_table(out: dict[str, Any]) -> str:
    """The JSON as lines a person reads, every number labelled predicted."""
    lines = [f"PREDICTED ({out.get('hardware') or 'calibrated on ' + str(out.get('calibrated_from'))})"]
    for key in ("strategy", "stage", "world_size", "micro_batch", "grad_accum", "global_batch", "step_time_s",
                "samples_per_s",
                "model_tflops_per_gpu", "hardware_tflops_per_gpu", "compute_s", "comm_s", "exposed_comm_s",
                "offload_s", "device_bytes", "fits", "max_micro_batch", "measured_step_time_s",
                "steps_to_target_over_s_min"):
        if key in out:
            value = out[key]
            text = f"{value:.4g}" if isinstance(value, float) else str(value)
            label = "measured " if key.startswith("measured_") else "predicted"  # the run it was calibrated on
            lines.append(f"  {label} {key:28s} {text}")
    card = out.get("card")
    if card:
        lines.append("  predicted answer card (time at the larger batch / at the smaller):")
        for way, kinds in card["ways"].items():
            cells = [f"{kind} {e['verdict'] or '-'}" + (f" ({e['ratio']:.2f}x)" if e["ratio"] else "")
                     for kind, e in kinds.items()]
            lines.append(f"    {way:12s} " + ", ".join(cells))
    return "\n".join(lines)


def cpu_comparison(data_dir: str | os.PathLike, statistic: str = "median") -> Any:
    """Every 2-rank point of `data_dir/runs.csv` PREDICTED from the 1-rank run of the same strategy and
    micro-batch with the link fit `data_dir/links.json`, beside the measured 2-rank step time (a DataFrame).
    `statistic`: the runs' per-step summary to compare (runs.csv has both: median, p10)."""
    import json

    import pandas as pd

    data = Path(data_dir)
    runs = pd.read_csv(data / "runs.csv")
    runs = runs[runs["statistic"] == statistic] if "statistic" in runs else runs
    fit = json.loads((data / "links.json").read_text())
    machine = json.loads((data / "machine.json").read_text()) if (data / "machine.json").exists() else {}
    cores = int(machine.get("cpu_cores") or 2)
    rows = []
    for _, two in runs[runs["world_size"] == 2].iterrows():
        one = runs[(runs["world_size"] == 1) & (runs["strategy"] == two["strategy"])
                   & (runs["micro_batch"] == two["micro_batch"])]
        if one.empty:
            continue
        base = one.iloc[0]
        run = MeasuredRun(f"{base['strategy']}-w1-m{base['micro_batch']}", json.loads(base["config"]),
                          float(base["forward_s"]), float(base["backward_s"]), float(base["optimizer_s"]),
                          float(base["step_time_s"]), int(base["steps"]))
        pred = calibrated(run, fit, world_size=2, cores=cores, threads_per_rank=1)
        rows.append({"strategy": two["strategy"], "micro_batch": int(two["micro_batch"]),
                     "measured_1_rank_s": float(base["step_time_s"]), "predicted_2_rank_s": pred["step_time_s"],
                     "measured_2_rank_s": float(two["step_time_s"]),
                     "predicted_comm_s": pred["exposed_comm_s"],
                     "error": pred["step_time_s"] / float(two["step_time_s"]) - 1})
    return pd.DataFrame(rows)


# -- report.html's "predicted on other hardware" section -------------------------------------------------------------
REPORT_CLUSTERS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("one node of 8 A100-80GB (NVSwitch)", dict(gpus_per_node=8, nodes=1)),
                   ("4 such nodes, 8 x 200 Gb/s HDR InfiniBand each", dict(gpus_per_node=8, nodes=4, inter_gbps=1600)))
TINY_STEP_S = 1e-3  # below this a predicted GPU step is dominated by kernel launches, which the model leaves out


def answer_workload(results_dir: str | os.PathLike) -> tuple[ModuleWorkload, int]:
    """The model an answer's results dir measured (machine.json's profile and model) and its ranks-way micro-batch."""
    import json

    from labkit.launch.config import RunConfig
    from labkit.study.answer import GPT_MODELS, PROFILES

    machine = json.loads((Path(results_dir) / "machine.json").read_text())
    profile = PROFILES[machine.get("profile") or "ci"]
    values = {**profile.model, **(GPT_MODELS.get(profile.name, {}) if machine.get("model") == "gpt" else {})}
    config = RunConfig.from_dict({"example": "deepspeed", **values})
    micro = 64
    results = Path(results_dir) / "results.csv"
    if results.exists():
        import pandas as pd

        table = pd.read_csv(results)
        ranks = table[table["growth"].astype(str).str.contains("ranks")] if "growth" in table else table.iloc[0:0]
        if not ranks.empty:
            micro = int(ranks["micro_batch"].iloc[0])
    return ModuleWorkload(config), micro


def report_section(results_dir: str | os.PathLike, *, precision: str = "bf16") -> str:
    """HTML: the answer card PREDICTED for one node of 8 A100s and for 4 such nodes, for the model the answer in
    `results_dir` measured, with its B_crit (noise.csv). Every number is labelled predicted."""
    import html

    workload, micro = answer_workload(results_dir)
    b_crit = b_crit_from(results_dir)
    parts = ["<section id='predicted-other-hardware'><h2>Predicted on other hardware (not measured)</h2>",
             "<p>What <code>labkit.study.predict</code> predicts for this answer's model "
             f"({html.escape(workload.name)}, "
             f"{workload.n_params:,} parameters, {precision}, ZeRO stage 0) on GPUs this machine does not have. "
             "Every number here is a <b>prediction</b> (docs/predict.md: the model, its sources, what it leaves out)"
             + (f"; time to the same loss uses the measured B_simple = {b_crit:.4g}" if b_crit else "") + ".</p>"]
    for title, shape in REPORT_CLUSTERS:
        cluster = Cluster(gpu=find_gpu("A100-80GB"), intra="nvswitch", **shape)
        card = predicted_card(workload, cluster, micro_batch=micro, precision=precision, b_crit=b_crit)
        step = predict(workload, cluster, strategy="z0", micro_batch=micro, precision=precision)
        parts.append(f"<h3>{html.escape(title)}: predicted</h3><table><tr><th>way to grow the batch</th>"
                     "<th>per step</th><th>per epoch</th><th>to the same loss</th></tr>")
        for way, kinds in card["ways"].items():
            cells = []
            for entry in kinds.values():
                text = "-" if entry["verdict"] is None else f"predicted {entry['verdict']} ({entry['ratio']:.2f}x)"
                cells.append(f"<td title='{html.escape(entry['condition'])}'>{text}</td>")
            parts.append(f"<tr><td>{way}</td>{''.join(cells)}</tr>")
        parts.append("</table>")
        note = (f" At {step.step_time_s * 1e6:.0f} us a step, kernel launches (not modelled) would dominate: this "
                "model is too small for these GPUs." if step.step_time_s < TINY_STEP_S else "")
        parts.append(f"<p>Predicted step at micro-batch {micro}: {step.step_time_s:.3g} s (compute "
                     f"{step.compute_s:.3g} s, exposed communication {step.exposed_comm_s:.3g} s).{note}</p>")
    parts.append("</section>")
    return "\n".join(parts)


# A 1-rank DeepSpeed engine in a child process: a stack of small Linear modules timed at ZeRO-0 and ZeRO-3
# (persistence threshold 0: every module is fetched); the difference per module fetch is the hooks' host cost.
_FETCH_PROBE = """
import json, os, sys, time
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import torch
torch.set_num_threads(1)
import deepspeed
from torch import nn
deepspeed.init_distributed("gloo", verbose=False)
K, x, best = 64, torch.randn(1, 16), {}
for stage in (0, 3):
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(K)])
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
              "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    times = []
    for _ in range(40):
        start = time.perf_counter()
        engine.backward(engine(x).sum())
        times.append(time.perf_counter() - start)
    best[stage] = sorted(times[5:])[len(times[5:]) // 10]
print(json.dumps({"zero3_fetch_s": (best[3] - best[0]) / (2 * K), "modules": K, "zero0_s": best[0],
                  "zero3_s": best[3]}))
"""


def measure_zero3_fetch_s(repeats: int = 3) -> dict[str, Any]:
    """ZeRO-3's host cost per submodule fetch on this machine (the fastest decile of 35 forward + backward passes of
    64 small Linear modules, ZeRO-3 minus ZeRO-0, over 2 fetches per module), in a child process (~20 s each); the
    least disturbed (minimum) of `repeats` probes, since other processes only ever slow it."""
    probes = [_fetch_probe() for _ in range(repeats)]
    best = min(probes, key=lambda p: p["zero3_fetch_s"])
    return {**best, "observations_s": [p["zero3_fetch_s"] for p in probes]}


def _fetch_probe() -> dict[str, Any]:
    import json
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _FETCH_PROBE, str(port)], capture_output=True, text=True,
                          timeout=900, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"the ZeRO-3 fetch probe failed:\n{done.stderr[-2000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))

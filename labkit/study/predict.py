"""Predicted step time of DeepSpeed 0.19.8 on hardware this machine does not have ("What about my GPUs?").

One optimizer step of one rank, per strategy (plain PyTorch DDP, ZeRO 0-3, ZeRO-Offload), as a sum of parts the
learner can see (docs/predict.md states the model, its sources and what it leaves out):

* compute: every op of the real model's forward and backward (+ the recomputed forward under activation
  checkpointing), counted on the meta device and timed with a roofline on the GPU kind (`labkit.study.flops`);
  the optimizer's update as memory traffic over the parameters the rank owns;
* communication: what DeepSpeed sends per micro-step and per step (`labkit.study.comms.collectives`, with the
  source lines there), timed with an alpha-beta ring over the slowest link each collective crosses
  (`labkit.runtime.hardware.Cluster.bus_bytes_per_s`); what DeepSpeed can overlap (`Collective.overlappable`)
  hides behind the compute of the phase it runs in, which runs OVERLAP_COMPUTE_SLOWDOWN slower meanwhile; the rest
  is exposed. ZeRO-3 across GPUs is played hook by hook instead (`labkit.study.zero3_overlap`): each module's compute
  waits for the gather that took its parameters, and the gathers and reduce-scatters share one NCCL stream;
* offload: gradients down in fp32 and parameters up in the training dtype over the GPU's PCIe link, and CPU
  Adam's pass over the rank's fp32 states in host memory;
* memory: `labkit.core.memory` for the model states plus the activations counted on the meta device: fits
  (within the memory CUDA reports less its context, `GPU.usable_memory_bytes`), and the largest micro-batch that fits;
* time to the same loss: steps from S(B) = S_min (1 + B_crit / B).

Every number this module returns is a PREDICTION; `Prediction.to_dict()` says so (`"predicted": true`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from labkit.core import memory
from labkit.runtime.arguments import whole_number
from labkit.runtime.hardware import GB, GPU, GPUS, MEMORY_EFFICIENCY, Cluster
from labkit.runtime.hardware import gpu as find_gpu
from labkit.study import flops, optimizer_bytes, zero3
from labkit.study.noise_scale import LM_LOSS_RANGE_NATS, language_model_b_crit  # noqa: F401  (torch-free)
from labkit.study.verdict import FLAT_BAND, verdict

HARDWARE = GPUS   # the GPU presets (labkit.runtime.hardware), as the issue names them

# strategy -> (ZeRO stage or None for plain PyTorch DDP, optimizer offloaded to the host)
STRATEGIES: dict[str, tuple[int | None, bool]] = {
    "torch": (None, False), "z0": (0, False), "z1": (1, False), "z2": (2, False), "z3": (3, False),
    "z1-offload": (1, True), "z2-offload": (2, True), "z3-offload": (3, True),
}
PRECISIONS = ("fp16", "bf16", "fp32")

# The optimizer step's device memory traffic per parameter a rank owns is counted on DeepSpeed 0.19.8's own step
# (labkit.study.optimizer_bytes: data/predict-ci/optimizer_bytes.json): 64-78 B with a 16-bit precision, of which
# its fused Adam kernel moves 28; with torch's Adam (its seven foreach passes move 72) 106-122, with its SGD 46-62.
# ZeRO-Offload's host work per owned parameter per step, 0.19.8: DeepSpeedCPUAdam's pass (csrc/includes/
# cpu_adam.h, Step_AVX: the same 16 B read and 12 B written) and two passes of torch's beside it, in
# stage_1_and_2.py: unscale_and_clip_grads multiplies the fp32 gradient partition in place whenever clipping is on
# (DeepSpeed's default gradient_clipping 1.0) or the loss scale is not 1 (:3193-3216), 8 B, and the updated fp32
# partition is copied into the pinned 16-bit upload buffer (:3095), 4 B read and the training dtype's written.
# stage3.py unscales always (:2979-2988, called at :2918 whatever the clipping and loss scale; an fp16 overflow
# step returns before it, :2891-2894) and copies the fp32 partition straight into the 16-bit one on the GPU (:2858),
# which torch converts on the host first: the same bytes there, counted the same. Where a host's passes were not
# measured they move their bytes at the rate its CPU Adam moves its own (assumed: 0.5x its time for bf16; on this
# lab's 2-core CPU machine they took 0.68-0.80x, data/predict-ci/offload_passes/).
CPU_ADAM_BYTES_PER_PARAM = 28
OFFLOAD_UNSCALE_BYTES_PER_PARAM = 8
# Where no node host's CPU Adam was measured, all of it is memory traffic at the host's memory bandwidth. Default
# host: a 2-socket server with 6 channels of DDR4-2666 per socket, 2 x 6 x 21.3 GB/s = 256 GB/s (Intel ARK, Xeon
# Platinum 8168: the DGX-2's CPUs); pass --host-memory-gb-per-s for yours. The node's ranks share its host.
DEFAULT_HOST_MEMORY_GB_PER_S = 256.0
HOST_MEMORY_EFFICIENCY = MEMORY_EFFICIENCY  # assumed, as a GPU's (labkit.runtime.hardware)
# Plain PyTorch across GPUs is torch's DDP, whose default `gradient_as_bucket_view=False` keeps its all-reduce
# buckets as a copy of the gradients: setting it "can reduce peak memory usage, where the saved memory size will be
# equal to the total gradients size" (torch/nn/parallel/distributed.py:731-735, torch 2.13; pytorch/pytorch#41954
# measured ~1 GB less peak for RoBERTa-base's ~1 GB of gradients). The gradients are fp32 under autocast (AMP
# keeps the parameters in fp32), so 4 B per parameter.
DDP_BUCKET_BYTES_PER_PARAM = 4
# ZeRO-3's host-side cost of one submodule fetch (DeepSpeed's pre-forward / pre-backward hooks, Python): measured
# on this lab's machine by `measure_zero3_fetch_s` (data/predict-ci/host.json says when and at what load); the host
# of a GPU node runs the same Python. A micro-step cannot be shorter than the host's work to issue it.
HOST_JSON = Path(__file__).resolve().parents[2] / "data" / "predict-ci" / "host.json"
ZERO3_RANKS_JSON = HOST_JSON.with_name("zero3_ranks.json")  # calibrate.measure_zero3_rank_scaling, on this machine


def zero3_fetch_s() -> float:
    """The measured host cost of one ZeRO-3 module fetch (0 where none was measured: the term is then left out)."""
    import json

    return float(json.loads(HOST_JSON.read_text())["zero3_fetch_s"]) if HOST_JSON.exists() else 0.0


@dataclass(frozen=True)
class HostCosts:
    """What the node's host spends to issue one micro-step, per GPU kind: a GPU node's host measured by
    bench_gpu_constants.py where this lab had that GPU (`GPU.measured`), else this lab's CPU machine for ZeRO-3's
    hooks (host.json) and no launch term (not measured: left out, as docs/predict.md says)."""

    launch_s: float               # per op issued (torch dispatch + kernel launch)
    zero3_per_module_s: float     # per parameter-holding module per micro-step (a fetch before forward, one before
    zero3_per_micro_step_s: float  # backward), fixed per micro-step,
    zero3_per_paramless_module_s: float  # and per module without parameters (hooked too); all at 1 rank
    source: str
    # ZeRO-3's gather path, which a 1-rank engine skips (calibrate.ZERO3_RANKS_PROBE): per fetch that gathers, and per
    # rank per gathered parameter per fetch (data/predict-ci/zero3_ranks.json; 0 where not measured)
    zero3_gather_per_fetch_s: float = 0.0
    zero3_gather_per_rank_param_s: float = 0.0

    def micro_step_s(self, ops: int, modules: float, paramless: float, stage: int | None,
                     recomputed: tuple[int, int] = (0, 0), world_size: int = 1,
                     gathers: tuple[float, float] = (0.0, 0.0)) -> float:
        """`ops` launches, and at stage 3 the hooks of every module. Under activation checkpointing the backward
        runs each block's forward again (torch/utils/checkpoint.py), and ZeRO-3's forward hooks fire on it too:
        `recomputed` (parameter-holding, parameter-free) modules get a third fetch beside the forward's and the
        backward's that the per-module figures were measured over, counted as half those figures. Assumed, and
        uncertain both ways: the forward's half of the two, and the backward's fetch right after the recomputation
        may then find the parameters already gathered. At 2 ranks or more each fetch also runs the gather path:
        `gathers` = (fetches that gather, gathered parameters fetched) per micro-step (`gather_counts`)."""
        if stage != 3:
            return ops * self.launch_s
        hooked_modules = modules + 0.5 * recomputed[0]
        hooked_paramless = paramless + 0.5 * recomputed[1]
        gather = 0.0
        if world_size > 1:
            gather = (gathers[0] * self.zero3_gather_per_fetch_s
                      + gathers[1] * world_size * self.zero3_gather_per_rank_param_s)
        return (ops * self.launch_s + hooked_modules * self.zero3_per_module_s
                + hooked_paramless * self.zero3_per_paramless_module_s + self.zero3_per_micro_step_s + gather)


def node_host(gpu: GPU, figure: str) -> tuple[Any, str] | None:
    """(the measured node host that has `figure`, a `Measured` field, for `gpu`; its source line): its own node's,
    else another GPU node's this lab measured (the same DeepSpeed and PyTorch on another host CPU: the source line
    says whose); None where no node's host has it."""
    if gpu.measured is not None and getattr(gpu.measured, figure) is not None:
        return gpu.measured, gpu.measured.source
    for _, other in sorted(GPUS.items()):
        if other.measured is not None and getattr(other.measured, figure) is not None:
            return other.measured, f"{other.measured.source} (its node's host; {gpu.name}'s not measured)"
    return None


def host_costs(gpu: GPU) -> HostCosts:
    """The node host's costs for `gpu` (`node_host`: its own node's as measured, else another GPU node's); else
    ZeRO-3's hooks from this lab's CPU machine and no launch term. Measured figures below 0 (a difference of two
    noisy timings) count as 0. ZeRO-3's gather path (2 ranks or more) as this lab's CPU machine measured it
    (ZERO3_RANKS_JSON), where it did: CPU time of the same DeepSpeed code, an estimate for a GPU node's host."""
    host = node_host(gpu, "zero3_per_module_s")
    if host is not None:
        m, source = host
        costs = HostCosts(m.launch_s or 0.0, max(m.zero3_per_module_s or 0.0, 0.0),
                          max(m.zero3_per_micro_step_s or 0.0, 0.0), max(m.zero3_per_paramless_module_s or 0.0, 0.0),
                          source)
    else:
        costs = HostCosts(0.0, 2 * zero3_fetch_s(), 0.0, 0.0,
                          f"ZeRO-3 hooks: {HOST_JSON.name} (this lab's CPU machine, parameter-holding modules only)")
    ranks = _zero3_ranks(ZERO3_RANKS_JSON)
    if ranks is None:
        return costs
    per_fetch, per_rank_param, source = ranks
    return dataclasses.replace(costs, zero3_gather_per_fetch_s=per_fetch, zero3_gather_per_rank_param_s=per_rank_param,
                               source=f"{costs.source}; ZeRO-3's gather path: {ZERO3_RANKS_JSON.name}, {source}")


@functools.cache
def _zero3_ranks(path: Path) -> tuple[float, float, str] | None:
    """zero3_ranks.json's gather path (per fetch, per rank per gathered parameter; below 0, a difference of noisy
    timings, counts as 0) and its source line, read once; None where there is none, or it does not read (warned)."""
    import json
    import warnings

    if not path.exists():
        return None
    try:
        ranks = json.loads(path.read_text())
        return (max(float(ranks["per_fetch_s"]), 0.0), max(float(ranks["per_rank_per_param_fetch_s"]), 0.0),
                str(ranks["source"]))
    except (ValueError, KeyError, TypeError) as exc:
        warnings.warn(f"{path}: ZeRO-3's gather path not read ({exc}): left out", stacklevel=2)
        return None


def gather_counts(workload: Workload, zero: Mapping[str, Any] | None = None) -> tuple[float, float]:
    """(fetches that gather, gathered parameters fetched) per micro-step at ZeRO-3, with the `zero` settings: the
    module fetches whose parameters were gathered for that use, by the fetch or by an earlier prefetch (DeepSpeed's
    coordinator replayed: `zero3.replay`), before the forward and, where they were released, before the backward (or,
    under activation checkpointing, the recomputed forward: the same count); a tied LM head where the embedding's
    were released."""
    r = zero3.replay(workload.zero3_trace(), **(zero or {}))
    return float(r.gathering_fetches), float(r.gathered_params_fetched)


class Workload(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def n_params(self) -> int: ...

    @property
    def persistent_params(self) -> int: ...

    @property
    def tied_head(self) -> bool: ...  # an LM head that is the first module's parameters (comms.tied_head)

    def module_layout(self) -> list[list[int]]: ...

    def zero3_trace(self) -> Any: ...  # ZeRO-3's module trace, every hook (zero3.ModuleTrace)

    def zero3_timeline(self, micro_batch: int, precision: str) -> tuple[Any, list[Any]]: ...  # the trace with the
    # step's ops between its hooks (zero3_overlap.recorded)

    def recomputed_modules(self) -> tuple[int, int]: ...

    def modules_before_blocks(self) -> int: ...

    def costs(self, micro_batch: int, gpu: GPU, precision: str, checkpointing: bool) -> PhaseCosts: ...


@dataclass(frozen=True)
class PhaseCosts:
    forward_s: float          # one micro-batch's forward
    backward_s: float         # its backward (+ the recomputed forward under activation checkpointing)
    model_flops: float        # forward + backward, no recomputation
    hardware_flops: float     # what the GPU executes (recomputation counted, as Megatron-LM's SC21 paper does)
    activation_bytes: float   # saved for the backward
    ops: int = 0              # device ops (kernels) the host issues per micro-step


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
    def tied_head(self) -> bool:
        return bool(self.shape.tied)

    def module_layout(self) -> list[list[int]]:
        return self.shape.module_layout()

    def zero3_trace(self) -> Any:
        return self.shape.zero3_trace()

    def zero3_timeline(self, micro_batch: int, precision: str) -> tuple[Any, list[Any]]:
        return self.shape.zero3_timeline(micro_batch, precision)

    def recomputed_modules(self) -> tuple[int, int]:
        return self.shape.recomputed_modules()

    def modules_before_blocks(self) -> int:
        return self.shape.modules_before_blocks()

    def costs(self, micro_batch: int, gpu: GPU, precision: str, checkpointing: bool) -> PhaseCosts:
        dtype = "fp32" if precision == "fp32" else precision
        layers = self.shape.layers
        c = flops.transformer_costs(self.shape, micro_batch, dtype)
        fwd = c.scaled(lambda x: flops.roofline_s(x.forward, gpu, precision), layers)
        bwd = c.scaled(lambda x: flops.roofline_s(x.backward, gpu, precision), layers)
        f_fwd = c.scaled(lambda x: x.flops("forward"), layers)
        f_bwd = c.scaled(lambda x: x.flops("backward"), layers)
        saved = c.scaled(lambda x: x.saved_bytes, layers)
        ops_fwd = round(c.scaled(lambda x: len(x.forward), layers))
        ops = ops_fwd + round(c.scaled(lambda x: len(x.backward), layers))
        if checkpointing:
            # Full recomputation (Megatron-LM's --checkpoint-activations, Hugging Face's gradient checkpointing):
            # each block keeps only its input and the backward recomputes one block's forward at a time; the
            # embeddings, the final norm and the LM head with its loss are not recomputed.
            per_layer = c.ops2.saved_bytes - c.ops1.saved_bytes
            base = c.ops1.saved_bytes - per_layer
            size = 4 if precision == "fp32" else 2
            saved = base + layers * micro_batch * self.shape.seq * self.shape.hidden * size + per_layer
            blocks_s = layers * (flops.roofline_s(c.ops2.forward, gpu, precision)
                                 - flops.roofline_s(c.ops1.forward, gpu, precision))
            blocks_flops = layers * (c.ops2.flops("forward") - c.ops1.flops("forward"))
            blocks_ops = layers * (len(c.ops2.forward) - len(c.ops1.forward))
            return PhaseCosts(fwd, bwd + blocks_s, f_fwd + f_bwd, f_fwd + blocks_flops + f_bwd, saved,
                              ops + blocks_ops)
        return PhaseCosts(fwd, bwd, f_fwd + f_bwd, f_fwd + f_bwd, saved, ops)


@dataclass
class ModuleWorkload:
    """A lab model (`mlp`, `gpt`, `pkg.mod:build_model`) built from a RunConfig on the meta device."""

    config: Any
    name: str = "model"
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        from labkit.models import builders
        from labkit.study import comms

        numels = builders.param_numels(self.config)
        self.n_params = sum(numels)
        self.persistent_params = builders.persistent_params(numels)
        model = builders.meta_model(self.config)
        self.layout = comms.module_layout(model)
        self.tied_head = comms.tied_head(model)
        self.name = self.config.model

    def module_layout(self) -> list[list[int]]:
        return self.layout

    def zero3_trace(self) -> Any:
        if "zero3_trace" not in self._cache:
            self._cache["zero3_trace"] = zero3.record_lab_model(self.config)
        return self._cache["zero3_trace"]

    def recomputed_modules(self) -> tuple[int, int]:
        return (0, 0)  # the lab's models do not checkpoint (costs() refuses it)

    def modules_before_blocks(self) -> int:
        return 0  # no blocks are recomputed (above)

    def census(self, micro_batch: int, precision: str, cuda: bool = True) -> flops.Census:
        """The model's ops at `micro_batch`, as a GPU runs them, or with `cuda=False` as this CPU does (dropout
        unfused: calibrate's predictions of runs here)."""
        key = (micro_batch, precision, cuda)
        if key not in self._cache:
            self._cache[key] = self._counted(micro_batch, precision,
                                             lambda model, step: flops.module_census(model, step, cuda))
        return self._cache[key]

    def zero3_timeline(self, micro_batch: int, precision: str) -> tuple[Any, list[Any]]:
        key = ("zero3_timeline", micro_batch, precision)
        if key not in self._cache:
            from labkit.study import zero3_overlap

            self._cache[key] = self._counted(micro_batch, precision, zero3_overlap.recorded)
        return self._cache[key]

    def _counted(self, micro_batch: int, precision: str, count: Callable[[Any, Callable[[], Any]], Any]) -> Any:
        """`count(model, step)` of the model in `precision`, `step()` its loss on `micro_batch` samples: on the meta
        device, or on a CPU copy where its forward reads a value."""
        import torch
        from torch.utils.data import default_collate

        from labkit.models import builders

        dataset = builders.build_dataset(self.config)
        one = default_collate([dataset[0]])
        dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]
        loss_fn = builders.loss_function(self.config)

        def count_on(device: str) -> Any:
            with torch.device(device), torch.random.fork_rng(devices=[]):
                model = builders.build_model(self.config).to(dtype)
            # the micro-batch as shapes only on the meta device: a batch of a billion samples (or of images) is
            # counted without the host memory it would fill; on the CPU, the first sample repeated
            batch = ([torch.empty((micro_batch, *t.shape[1:]), dtype=t.dtype, device="meta") for t in one]
                     if device == "meta" else default_collate([dataset[0]] * micro_batch))
            inputs, labels = (t.to(dtype) if t.is_floating_point() else t for t in batch)
            return count(model, lambda: loss_fn(model, inputs, labels).float())

        return builders.on_meta_else_cpu(count_on)

    def costs(self, micro_batch: int, gpu: GPU, precision: str, checkpointing: bool) -> PhaseCosts:
        if checkpointing:
            raise ValueError("--activation-checkpointing is modelled for --transformer shapes (the lab's models "
                             "do not checkpoint)")
        c = self.census(micro_batch, precision)
        fwd, bwd = flops.roofline_s(c.forward, gpu, precision), flops.roofline_s(c.backward, gpu, precision)
        return PhaseCosts(fwd, bwd, c.flops(), c.flops(), c.saved_bytes, len(c.forward) + len(c.backward))


def lab_workload(config: Any) -> Workload:
    """The workload of a RunConfig's model: the lab's byte-level GPT is Hugging Face's GPT2LMHeadModel of a known
    shape (labkit.models.gpt), counted as that transformer on the meta device (its own forward reads a value, which
    the meta device cannot give, and a CPU copy of a GPT-2-small-sized model is slow to count), with dropout off and
    transformers' default attention, SDPA, as it runs; any other model is built from the config and counted as it
    is. The shape is counted with transformers' key/value cache on (without it a packed-sequence check reads a
    value), whose copies of K and V the lab's GPT (use_cache=False) does not make: its activations come out ~7% over
    at GPT-2 small's shape and 512 tokens, its largest micro-batch on the safe side."""
    if config.model == "gpt":
        from labkit.models.gpt import VOCAB_SIZE, n_heads

        shape = flops.Transformer(layers=config.depth, hidden=config.hidden, heads=n_heads(config.hidden),
                                  seq=config.input_size, vocab=VOCAB_SIZE, dropout=0.0, attention="sdpa")
        return TransformerWorkload(shape, name="gpt")
    return ModuleWorkload(config)


# -- communication time ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClusterLinks:
    """Alpha-beta ring on a cluster's links: NCCL's ring latency + ring bytes / bus bandwidth."""

    cluster: Cluster

    def seconds(self, op: str, ring_bytes: float, world_size: int) -> float:
        return self.cluster.ring_latency_s(op, world_size) + ring_bytes / self.cluster.bus_bytes_per_s(world_size)


@dataclass(frozen=True)
class FittedLinks:
    """A link fit measured on this machine (`comms.measure_links`, or its JSON form `link_fit_json`): per op,
    comms' ring model, ring steps x alpha + ring bytes x beta (an op the fit lacks uses all_reduce's)."""

    fit: Any

    def seconds(self, op: str, ring_bytes: float, world_size: int) -> float:
        from labkit.study import comms

        fits = self.fit["fits"] if isinstance(self.fit, dict) else link_fit_json(self.fit)["fits"]
        entry = fits.get(op) or fits["all_reduce"]
        return comms.ring_steps(op, world_size) * float(entry["alpha_s"]) + ring_bytes * float(entry["beta_s_per_byte"])


def link_fit_json(fit: Any, *, raw: bool = False) -> dict[str, Any]:
    """A comms.LinkFit as JSON (what `--links FILE` reads): its per-op fits, how its calls were timed and
    summarised, and with `raw` every timed call (so another statistic can be fitted later: `comms.fit_links`)."""
    out = {"world_size": fit.world_size, "backend": fit.backend, "device": fit.device,
           "statistic": fit.statistic, "busy_s": fit.busy_s,
           "fits": {op: {"alpha_s": f.alpha_s, "beta_s_per_byte": f.beta_s_per_byte, "bus_gbps": f.bus_gbps,
                         "median_error": f.median_error} for op, f in fit.fits.items()}}
    if raw:
        out["raw"] = fit.raw[["op", "msg_bytes", "rep", "seconds"]].to_dict(orient="records")
    return out


def collective_rows(stage: int | None, workload: Workload, world_size: int, *, precision: str, grad_accum: int,
                    offload_optimizer: bool, zero: Mapping[str, Any] | None = None) -> list[Any]:
    """DeepSpeed 0.19.8's collectives for one rank (comms.collectives, with the model's module layout: exact
    buckets, per-module ZeRO-3 gathers; the `zero_optimization` settings `zero`, else DeepSpeed's defaults); plain
    PyTorch is torch's DDP (comms.ddp_collectives: fp32 gradient buckets during the backward, the last one after
    it)."""
    if world_size < 2:
        return []
    from labkit.study import comms

    if stage is None:
        numels = [n for module in workload.module_layout() for n in module]
        return comms.ddp_collectives(numels, world_size, grad_accum=grad_accum)
    return list(comms.collectives(stage, workload.n_params, world_size, precision=precision,
                                  grad_accum=grad_accum, offload_optimizer=offload_optimizer,
                                  modules=workload.module_layout(), tied_head=workload.tied_head,
                                  trace=workload.zero3_trace() if stage == 3 else None, **(zero or {})))


@dataclass(frozen=True)
class CommTime:
    total_s: float
    exposed_s: float
    rows: list[dict[str, Any]]


# Compute slows while communication runs beside it (both use the GPU's SMs and memory): "overlapping computation and
# communication can result in an average computational slowdown of 18.9%, with a maximum of 40.0%" (Lee et al.,
# "Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning", arXiv:2507.03114,
# 2025: GPT and LLaMA on 4 x A100, H100, MI250 and MI210). The average, global: not fitted to any point.
OVERLAP_COMPUTE_SLOWDOWN = 1.189


def _past_phase(seconds: float, phase_s: float, gpu_s: float, slowdown: float) -> float:
    """What of `seconds` of communication hidden behind a phase of `phase_s` (the GPU's own compute `gpu_s`, slowed
    `slowdown` x beside it) runs past the phase."""
    on_gpu = seconds if seconds > slowdown * gpu_s else gpu_s + seconds * (1.0 - 1.0 / slowdown)
    return max(0.0, on_gpu - phase_s)


def comm_time(rows: Iterable[Any], links: Any, world_size: int, *, grad_accum: int,
              hide_behind: dict[str, float], slowdown: float = 1.0,
              device: dict[str, float] | None = None) -> CommTime:
    """Seconds per optimizer step: every collective's count x (alpha-beta time of its ring bytes); overlappable
    ones hide behind the compute of their phase per micro-step (`hide_behind`: phase -> seconds per micro-step, as
    the phase runs, host-bound or not), the rest is exposed; one sent once per step (ZeRO-1's buckets, DDP's
    under `no_sync`) hides behind the boundary micro-step's phase only. The GPU's own compute in a phase (`device`,
    default the same) takes `slowdown` x as long beside hidden communication (GPUs: OVERLAP_COMPUTE_SLOWDOWN): on
    the GPU a phase of compute D and communication X takes D + X (1 - 1/slowdown) while X <= slowdown x D, else X;
    what of that runs past the phase is exposed."""
    if slowdown < 1:
        raise ValueError(f"slowdown must be >= 1, got {slowdown}")
    rows = list(rows)
    if not rows:
        return CommTime(0.0, 0.0, [])
    from labkit.study import comms

    total = exposed = 0.0
    # hideable seconds per phase: of every micro-step (a micro-step's share), and of the boundary micro-step only
    # (the collectives sent once per step, which only that micro-step's phase can hide)
    every: dict[str, float] = {}
    boundary: dict[str, float] = {}
    table = []
    for c in rows:
        repeats = c.per_step
        one = links.seconds(c.op, comms.ring_bytes_sent(c, world_size), world_size)
        seconds = repeats * one
        total += seconds
        if c.overlappable and c.phase in hide_behind:
            if c.per == "micro_step":
                every[c.phase] = every.get(c.phase, 0.0) + seconds / grad_accum
            else:
                boundary[c.phase] = boundary.get(c.phase, 0.0) + seconds
        else:
            exposed += seconds
        table.append({"op": c.op, "phase": c.phase, "per": c.per, "count": c.count, "bytes": c.bytes,
                      "overlappable": bool(c.overlappable), "seconds_per_step": seconds})
    for phase in sorted({*every, *boundary}):
        phase_s = hide_behind[phase]
        gpu_s = (device or hide_behind).get(phase, phase_s)

        mine = every.get(phase, 0.0)
        exposed += ((grad_accum - 1) * _past_phase(mine, phase_s, gpu_s, slowdown)
                    + _past_phase(mine + boundary.get(phase, 0.0), phase_s, gpu_s, slowdown))
    return CommTime(total, exposed, table)


# -- the prediction ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Prediction:
    strategy: str
    optimizer: str            # the basic optimizer the step runs (optimizer_for)
    world_size: int
    micro_batch: int
    grad_accum: int
    global_batch: int
    step_time_s: float
    step_time_s_if_nothing_hides: float  # the same step with no communication hidden behind compute, nor behind
                                         # the host's work: compute_s + comm_s + offload_s (= step_time_s where
                                         # none hides)
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
    offload_transfer_s: float  # of offload_s: the gradients down and the parameters up over the host's link
    offload_host_s: float      # of offload_s: CPU Adam and its passes on the node's host, its ranks' together
    host_overhead_s: float
    host_bound_s: float       # of compute_s: the time the device waits on the host (its hooks, launches)
    device_bytes: float
    activation_bytes: float
    step_peak_bytes: float    # at the optimizer step's peak: the states + what the optimizer step allocates itself
    usable_memory_bytes: float  # what device_bytes and step_peak_bytes must fit in: the GPU's memory less the CUDA
                                # context
    fits: bool
    max_micro_batch: int
    hardware: str
    constants: str = ""       # where the GPU kind's efficiencies and the host's costs come from (measured / assumed)
    zero: dict[str, Any] = field(default_factory=dict)  # the zero_optimization settings given (empty: the defaults)
    collectives: list[dict[str, Any]] = field(default_factory=list)
    caveats: list[str] = field(default_factory=list)  # what the published check says of this kind of prediction

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["predicted"] = True
        return out


# Every published ZeRO-3 point across GPUs (data/published: SC21's, ZeRO++'s baseline, GPT-2 XL's autotuning row, the
# H100 BF16 example, the Azure blog's) ran slower than this model predicts it, on one node and on many; those of
# DeepSpeed 0.6 and later within 18% of the same step with no communication hidden (tests/study/
# test_predict_published.py holds the claims): so a predicted ZeRO-3 step across GPUs says so where it is printed.
ZERO3_CAVEAT = ("predicted ZeRO-3 across GPUs: every published ZeRO-3 point this model is checked against ran slower "
                "than predicted (4 H100s in one node, 16 V100s, 384 V100s and 256-2,240 A100s, one with its optimizer "
                "offloaded); read this step as a lower bound, and step_time_s_if_nothing_hides (no communication "
                "hidden behind compute) beside it: the 11 published runs of DeepSpeed 0.6 and later ran within 18% of "
                "that one (docs/predict.md, \"At a glance\")")


def caveats(stage: int | None, world_size: int) -> list[str]:
    """What the published check says of a prediction of this kind (ZERO3_CAVEAT)."""
    return [ZERO3_CAVEAT] if stage == 3 and world_size > 1 else []


def optimizer_for(strategy: str, optimizer: str | None = None) -> str:
    """The basic optimizer a step of `strategy` runs, checked (`optimizer_bytes.basic_optimizer`): by default
    DeepSpeed's FusedAdam, plain PyTorch's torch.optim.Adam (foreach, a GPU's default)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
    return optimizer_bytes.basic_optimizer(*STRATEGIES[strategy], optimizer)


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """What a measured run of the same training says the model misses (`calibrate.gpu_calibration`), applied by
    `predict`: factors on the device's compute, the host's work per micro-step and the optimizer step (on the
    device or, offloaded, the host), and fixed time added to the host's work per micro-step and to the step."""

    device_factor: float = 1.0       # the device's forward + backward x this (> 0)
    host_factor: float = 1.0         # the host's work to issue one micro-step x this (<= 1)
    host_excess_s: float = 0.0       # ... + this (>= 0)
    optimizer_factor: float = 1.0    # the optimizer step (+ offload) x this (<= 1)
    optimizer_excess_s: float = 0.0  # ... + this, once per step (>= 0)
    source: str = ""                 # the run it came from

    def __post_init__(self) -> None:
        if not 0 < self.device_factor < math.inf:
            raise ValueError(f"device_factor must be a finite factor > 0, got {self.device_factor}")
        for name in ("host_factor", "optimizer_factor"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        for name in ("host_excess_s", "optimizer_excess_s"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a finite time >= 0, got {getattr(self, name)}")


def partition_ranks(stage: int | None, world_size: int) -> int:
    """Ranks that share the optimizer's states and update (1 at stage 0 and in plain PyTorch)."""
    return world_size if stage is not None and stage >= 1 else 1



def too_large_to_count(exc: BaseException, given: str) -> str | None:
    """Why an input cannot be counted, naming `given` (what the user chose, as they chose it: the shape's fields and
    the micro-batch): PyTorch's 64-bit sizes overflow while counting on the meta device (a RuntimeError, an
    OverflowError, or a TypeError past 2**63: a huge hidden, seq or micro-batch), or this machine's memory runs out
    building the model's trace (MemoryError; the layer count that once did it, 10^18, is now refused by
    `shapes.MAX_LAYERS`, so this is for a machine with little memory). None for any other error. `labkit predict` and
    notebook 06's `explore` refuse with it (ConfigError, ValueError)."""
    if isinstance(exc, MemoryError):
        return (f"{given} is too large to count: the shape's trace (a record per module and parameter of every "
                "layer) does not fit in this machine's memory")
    if isinstance(exc, (RuntimeError, TypeError, OverflowError)) and ("overflow" in str(exc).lower()
                                                                      or isinstance(exc, OverflowError)):
        return f"{given} is too large to count: its tensors' sizes overflow PyTorch's 64-bit sizes"
    return None

def predict(workload: Workload, cluster: Cluster, *, strategy: str, micro_batch: int, grad_accum: int = 1,
            precision: str = "fp16", activation_checkpointing: bool = False,
            host_memory_gb_per_s: float | None = None, zero: Mapping[str, Any] | None = None,
            optimizer: str | None = None, calibration: Calibration | None = None,
            links: Any | None = None) -> Prediction:
    """One optimizer step of one rank of `workload` on `cluster` (module doc). Every figure is predicted. `zero`:
    DeepSpeed's `zero_optimization` settings where they are not its defaults (`comms.zero_settings` reads them
    from `key=value,...`), checked by DeepSpeed's own config model first. `optimizer`: the basic optimizer the step
    runs (`optimizer_for`): its states and its step's traffic and peak are counted. `calibration`: what a measured
    run of the same training says the model misses (`Calibration`); `links`: a measured link fit (`FittedLinks`)
    instead of the cluster's presets."""
    # A notebook cell passes what the learner typed: checked here, not as torch's or pandas' traceback further on
    if not hasattr(workload, "costs"):
        raise ValueError(f"workload must be a Workload (predict_views.workload(name), lab_workload(config) or a "
                         f"TransformerWorkload), got {workload!r}")
    if not isinstance(cluster, Cluster):
        raise ValueError(f"cluster must be a hardware.Cluster, got {cluster!r}")
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    whole_number("micro_batch", micro_batch)
    whole_number("grad_accum", grad_accum)
    if not isinstance(activation_checkpointing, bool):  # "no" would read as True
        raise ValueError(f"activation_checkpointing must be True or False, got {activation_checkpointing!r}")
    if host_memory_gb_per_s is not None and not (0 < host_memory_gb_per_s < math.inf):
        raise ValueError(f"host_memory_gb_per_s must be a finite bandwidth > 0, got {host_memory_gb_per_s}")
    stage, offload = STRATEGIES[strategy]
    optimizer = optimizer_for(strategy, optimizer)
    if zero:
        if stage is None:
            raise ValueError("zero settings are DeepSpeed's; plain PyTorch has none")
        from labkit.study import comms

        comms.check_zero_settings(stage, zero, offload)
    gpu, n = cluster.gpu, cluster.world_size
    gpu.peak(precision)  # a precision the GPU has no tensor cores for is refused here
    costs = workload.costs(micro_batch, gpu, precision, activation_checkpointing)
    cal = calibration or Calibration()
    if cal.device_factor != 1.0:
        costs = dataclasses.replace(costs, forward_s=costs.forward_s * cal.device_factor,
                                    backward_s=costs.backward_s * cal.device_factor)
    # The host issues the GPU's work asynchronously, so a micro-step takes the longer of the device's compute and the
    # host's work to issue it: an op launch per kernel, and ZeRO-3's per-module fetch hooks (HostCosts).
    modules, paramless = workload.zero3_trace().hooked_modules() if stage == 3 else (0.0, 0.0)
    host_s = host_costs(gpu).micro_step_s(
        costs.ops, modules, paramless, stage,
        workload.recomputed_modules() if activation_checkpointing else (0, 0), world_size=n,
        gathers=gather_counts(workload, zero) if stage == 3 and n > 1 else (0.0, 0.0))
    host_s = host_s * cal.host_factor + cal.host_excess_s
    on_gpu = {"forward": costs.forward_s, "backward": costs.backward_s}  # the device's own, before the host's bound
    host_bound_s = grad_accum * max(0.0, host_s - costs.forward_s - costs.backward_s)
    if host_s > costs.forward_s + costs.backward_s:
        scale = host_s / (costs.forward_s + costs.backward_s)
        costs = dataclasses.replace(costs, forward_s=costs.forward_s * scale, backward_s=costs.backward_s * scale)
    owned = workload.n_params / partition_ranks(stage, n)
    optimizer_s = (0.0 if offload else owned * optimizer_bytes.step_bytes(stage, precision, optimizer=optimizer)
                   / (gpu.memory_bytes_per_s * gpu.memory_efficiency)) * cal.optimizer_factor + cal.optimizer_excess_s
    compute_s = grad_accum * (costs.forward_s + costs.backward_s) + optimizer_s
    rows = collective_rows(stage, workload, n, precision=precision, grad_accum=grad_accum, offload_optimizer=offload,
                           zero=zero)
    link = links or ClusterLinks(cluster)
    comm = comm_time(rows, link, n, grad_accum=grad_accum,
                     hide_behind={"forward": costs.forward_s, "backward": costs.backward_s},
                     slowdown=OVERLAP_COMPUTE_SLOWDOWN, device=on_gpu)
    if stage == 3 and n > 1:  # what the gathers and the reduce-scatters hide, hook by hook (zero3_overlap)
        comm = CommTime(comm.total_s, zero3_exposed_s(workload, rows, link, gpu, n, micro_batch=micro_batch,
                                                      precision=precision, grad_accum=grad_accum, zero=zero,
                                                      offload=offload, phases=costs, on_gpu=on_gpu), comm.rows)
    offload_transfer_s, offload_host_s = _offload_s(stage, offload, owned, grad_accum, cluster, precision,
                                                    host_memory_gb_per_s)
    offload_transfer_s *= cal.optimizer_factor
    offload_host_s *= cal.optimizer_factor
    offload_s = offload_transfer_s + offload_host_s
    step = compute_s + comm.exposed_s + offload_s
    global_batch = micro_batch * grad_accum * n
    states, max_micro, step_peak = _memory(workload, cluster, stage, offload, precision, activation_checkpointing,
                                           zero, optimizer=optimizer)
    device_bytes = states + costs.activation_bytes
    return Prediction(
        strategy=strategy, optimizer=optimizer, world_size=n, micro_batch=micro_batch, grad_accum=grad_accum,
        global_batch=global_batch,
        step_time_s=step, step_time_s_if_nothing_hides=compute_s + comm.total_s + offload_s,
        samples_per_s=global_batch / step,
        model_tflops_per_gpu=costs.model_flops * grad_accum / step / 1e12,
        hardware_tflops_per_gpu=costs.hardware_flops * grad_accum / step / 1e12,
        compute_s=compute_s, forward_s=costs.forward_s, backward_s=costs.backward_s, optimizer_s=optimizer_s,
        comm_s=comm.total_s, exposed_comm_s=comm.exposed_s, offload_s=offload_s,
        offload_transfer_s=offload_transfer_s, offload_host_s=offload_host_s,
        host_overhead_s=grad_accum * host_s, host_bound_s=host_bound_s,
        device_bytes=device_bytes, activation_bytes=costs.activation_bytes, step_peak_bytes=step_peak,
        usable_memory_bytes=gpu.usable_memory_bytes,
        fits=max(device_bytes, step_peak) <= gpu.usable_memory_bytes,
        max_micro_batch=max_micro, hardware=cluster.describe(),
        constants=f"device: {gpu.constants_source}; host: {host_costs(gpu).source}"
                  + (f"; {offload_host(gpu, precision, host_memory_gb_per_s)[1]}" if offload else "")
                  + f"; memory: {gpu.memory_source}"
                  + (f"; calibrated on {cal.source}" if calibration else ""),
        zero=dict(zero or {}), collectives=comm.rows, caveats=caveats(stage, n))


def zero3_exposed_s(workload: Workload, rows: list[Any], links: Any, gpu: GPU, world_size: int, *, micro_batch: int,
                    precision: str, grad_accum: int, zero: Mapping[str, Any] | None, offload: bool,
                    phases: PhaseCosts, on_gpu: dict[str, float]) -> float:
    """Seconds of ZeRO-3's communication exposed per optimizer step: the gathers and the gradients' reduce-scatters
    played hook by hook on the compute and NCCL streams' clocks every micro-step (`zero3_overlap`: its stretches
    timed by this GPU's roofline and scaled to the phases as they run, `phases`, and to the device's own compute,
    `on_gpu`; its buckets DeepSpeed's flush rule over the gradients in the order they complete); the optimizer step's
    collectives in `rows` as `comm_time` exposes them."""
    from labkit.study import comms, zero3_overlap

    settings = dict(zero or {})
    cfg = comms.check_zero_settings(3, settings, offload)
    trace, ops = workload.zero3_timeline(micro_batch, precision)
    size = comms.DTYPE_BYTES[precision]

    def call_s(op: str, numels: Sequence[int]) -> float:  # one call over parameters (or gradients) of `numels`
        moved = comms.ring_factor(op, world_size) * comms.gathered_elements(numels, world_size) * size
        return float(links.seconds(op, moved, world_size))

    steps = zero3_overlap.fetches(trace, zero3.replay(trace, **settings),
                                  [flops.op_seconds(op, gpu, precision) for op in ops],
                                  lambda call: call_s("all_gather", call))
    micro = zero3_overlap.micro_step_s(steps, forward_s=phases.forward_s, backward_s=phases.backward_s,
                                       device_forward_s=on_gpu["forward"], device_backward_s=on_gpu["backward"],
                                       bucket_elements=int(cfg.reduce_bucket_size),
                                       scatter_s=lambda bucket: call_s("reduce_scatter", bucket),
                                       slowdown=OVERLAP_COMPUTE_SLOWDOWN)
    rest = [c for c in rows if c.phase == "optimizer"]
    if len(rest) + sum(c.op in ("all_gather", "reduce_scatter") and c.per == "micro_step" for c in rows) != len(rows):
        raise ValueError("a ZeRO-3 collective neither played nor of the optimizer step: comms and zero3_exposed_s "
                         "disagree")
    exposed = comm_time(rest, links, world_size, grad_accum=grad_accum,
                        hide_behind={"forward": phases.forward_s, "backward": phases.backward_s},
                        slowdown=OVERLAP_COMPUTE_SLOWDOWN, device=on_gpu).exposed_s
    return exposed + grad_accum * micro.exposed_s


def _offload_s(stage: int | None, offload: bool, owned: float, grad_accum: int, cluster: Cluster, precision: str,
               host_memory_gb_per_s: float | None) -> tuple[float, float]:
    """(transfer seconds, host seconds) of ZeRO-Offload, not overlapped (DeepSpeed's default): the rank's gradient
    partition goes down to the host (`offload_grad_bytes`), the host runs CPU Adam and the two passes beside it over
    the rank's partition (CPU_ADAM_BYTES_PER_PARAM's comment), and the updated parameters come back up in the training
    dtype. The node's ranks share its host (`offload_host`)."""
    if not offload:
        return 0.0, 0.0
    assert stage is not None
    down, up = offload_grad_bytes(stage, grad_accum, precision)
    param_size = 4 if precision == "fp32" else 2
    host_s_per_param, _ = offload_host(cluster.gpu, precision, host_memory_gb_per_s)
    return (down * owned / cluster.device_to_host_bytes_per_s()
            + (up + param_size) * owned / cluster.host_to_device_bytes_per_s(),
            owned * host_s_per_param * cluster.gpus_per_node)


def offload_grad_bytes(stage: int, grad_accum: int, precision: str) -> tuple[int, int]:
    """(bytes down to the host, bytes back up) per owned parameter per optimizer step for the gradients under
    ZeRO-Offload, as DeepSpeed 0.19.8 copies them. Every stage sends the boundary's gradient down in fp32, cast on the
    device (4 B). Accumulating, stages 1-2 keep the running sum on the host in the training dtype (g B): each
    micro-step after the first brings it up, adds and sends it down again, and stage 2 sends the first down too
    (`copy_grads_in_partition` -> `async_accumulate_grad_in_cpu_via_gpu`, stage_1_and_2.py:2161-2173, :1809-1858;
    stage 1 reduces at the boundary only, so there once). Stage 3 keeps its gradient partitions in a host buffer
    (stage3.py:333, :791) and on every micro-step copies the partition down and back up (`partition_grads`,
    :2024-2039) before the boundary's fp32 copy (:2044 -> :1443)."""
    g = 4 if precision == "fp32" else 2
    if stage == 3:
        return grad_accum * g + 4, grad_accum * g
    if grad_accum == 1:
        return 4, 0
    if stage == 1:
        return g + 4, g
    return grad_accum * g + 4, (grad_accum - 1) * g


def offload_host(gpu: GPU, precision: str, host_memory_gb_per_s: float | None = None) -> tuple[float, str]:
    """(seconds of ZeRO-Offload's host work per parameter on one node's host, its ranks' parameters together; where
    that comes from). Given `host_memory_gb_per_s`: all of the work as memory traffic at that bandwidth x
    HOST_MEMORY_EFFICIENCY. Else CPU Adam as this lab measured DeepSpeedCPUAdam (all the host's threads) on the GPU
    kind's own node host, else on another GPU node's host (`node_host` says whose), with the two passes as measured
    beside it there (the copy measured into bf16, scaled by its bytes for fp32 training), else at the rate that CPU
    Adam moves bytes (assumed). Else the default bandwidth (assumed)."""
    copy_bytes = 4 + (4 if precision == "fp32" else 2)
    passes_bytes = OFFLOAD_UNSCALE_BYTES_PER_PARAM + copy_bytes
    host = node_host(gpu, "cpu_adam_s_per_param")
    if host is not None and host_memory_gb_per_s is None:
        measured, source = host
        adam = measured.cpu_adam_s_per_param
        unscale, to_bit16 = measured.offload_unscale_s_per_param, measured.offload_to_bit16_s_per_param
        if unscale is not None and to_bit16 is not None:
            measured_copy_bytes = 4 + 2  # bench_gpu_constants times the copy into bf16
            return (adam + unscale + to_bit16 * copy_bytes / measured_copy_bytes,
                    f"CPU Adam and its two passes: {source}")
        return (adam * (1 + passes_bytes / CPU_ADAM_BYTES_PER_PARAM),
                f"CPU Adam: {source}; its two passes at CPU Adam's bytes per second (assumed)")
    if host_memory_gb_per_s is not None and not (0 < host_memory_gb_per_s < math.inf):
        raise ValueError(f"host_memory_gb_per_s must be a finite bandwidth > 0, got {host_memory_gb_per_s}")
    bandwidth = host_memory_gb_per_s or DEFAULT_HOST_MEMORY_GB_PER_S
    given = "given" if host_memory_gb_per_s else "assumed (DEFAULT_HOST_MEMORY_GB_PER_S)"
    return ((CPU_ADAM_BYTES_PER_PARAM + passes_bytes) / (bandwidth * GB * HOST_MEMORY_EFFICIENCY),
            f"CPU Adam and its two passes: memory traffic at {bandwidth:g} GB/s of host memory, {given}, "
            f"x {HOST_MEMORY_EFFICIENCY}")


def _memory(workload: Workload, cluster: Cluster, stage: int | None, offload: bool, precision: str,
            checkpointing: bool, settings: Mapping[str, Any] | None = None, *,
            optimizer: str) -> tuple[float, int, float]:
    """(device bytes of the model states + bucket at the micro-step, the largest micro-batch that fits, device bytes
    at the optimizer step's peak): states from labkit.core.memory (DeepSpeed 0.19.8's accounting; the bucket and
    ZeRO-3's persistent parameters as the `settings` make them), the activations counted on the meta device
    (`largest_micro_batch`), and what the optimizer's step allocates for itself (DeepSpeed's:
    `memory.optimizer_step_bytes`, its sub_group_size as the `settings` say; plain PyTorch's Adam:
    `memory.plain_adam_step_bytes`; SGD without momentum: nothing). `optimizer` (optimizer_for): SGD keeps no
    moments. Where the step does not fit, no micro-batch does."""
    n = cluster.world_size
    mem_precision = "fp32" if precision == "fp32" else precision
    zero = 0 if stage is None else stage
    persistent, bucket = workload.persistent_params, memory.reduce_bucket_bytes(zero, mem_precision)
    sub_group_size = memory.DEFAULT_SUB_GROUP_SIZE
    if settings and stage is not None:
        from labkit.study import comms

        persistent = comms.persistent_elements(workload.module_layout(), **settings)
        cfg = comms.zero_config(zero, settings)
        bucket = memory.reduce_bucket_bytes(zero, mem_precision, int(cfg.reduce_bucket_size), bool(cfg.overlap_comm))
        sub_group_size = int(cfg.sub_group_size)
    states = memory.model_state_bytes(workload.n_params, zero, n, mem_precision, offload,
                                      persistent_params=persistent if zero == 3 else 0,
                                      optimizer="sgd" if optimizer == "torch_sgd" else "adam")
    device = states["device_bytes"] + (bucket if stage else 0) + _peak_extra_bytes(workload, stage, n, precision,
                                                                                    settings)
    # at the step: the states, stage 3's bucket (stages 1-2 free theirs at the end of the backward,
    # `_release_ipg_buffers`, stage_1_and_2.py:924-932) or DDP's (kept for the next backward), and what the step
    # allocates
    if stage is None:
        held = _peak_extra_bytes(workload, stage, n, precision, settings)
        own = memory.plain_adam_step_bytes(workload.n_params) if optimizer == "torch_adam" else 0
    else:
        held = bucket if stage == 3 else 0
        own = 0 if offload else memory.optimizer_step_bytes(  # an offloaded step runs on the host
            zero, [size for module in workload.module_layout() for size in module], n, mem_precision,
            sub_group_size=sub_group_size, optimizer=optimizer)
    step = float(states["device_bytes"] + held + own)
    usable = cluster.gpu.usable_memory_bytes
    largest = 0 if step > usable else largest_micro_batch(
        lambda m: workload.costs(m, cluster.gpu, precision, checkpointing).activation_bytes, usable - device)
    return device, largest, step


def _peak_extra_bytes(workload: Workload, stage: int | None, world_size: int, precision: str,
                      settings: Mapping[str, Any] | None) -> float:
    """What a micro-step holds beyond the model states at the boundary (`memory.model_state_bytes`), across GPUs:
    torch DDP's all-reduce buckets beside the gradients (DDP_BUCKET_BYTES_PER_PARAM), and ZeRO-3's gathered
    parameters at the turn from the forward to the backward, in the training dtype (`zero3.replay`)."""
    if world_size < 2:
        return 0.0
    if stage is None:
        return DDP_BUCKET_BYTES_PER_PARAM * workload.n_params
    if stage == 3:
        from labkit.study import comms

        return comms.DTYPE_BYTES[precision] * zero3.replay(workload.zero3_trace(), **(settings or {})).resident_at_turn
    return 0.0


def largest_micro_batch(activations: Callable[[int], float], room: float) -> int:
    """The largest micro-batch whose counted activations fit in `room` bytes (0: not even one sample). The counts
    grow by the same bytes per sample from 2 samples on (a GPT-2 shape's 1-sample count is above that line: its
    attention saves the value heads, at 1 sample a view into the fused QKV projection's output, whose whole storage
    is counted, and from 2 on a copy of their own), so the line through the counts at 2 and 3 samples is solved
    where the counts at 2, 3 and 4 lie on one line, else the counts themselves are walked to the boundary."""
    if activations(1) > room:
        return 0
    two, three = activations(2), activations(3)
    per_sample = three - two
    if per_sample <= 0:
        return 1
    candidate = max(1, int((room - (two - 2 * per_sample)) // per_sample))
    if abs(activations(4) - three - per_sample) > 1e-9 * per_sample:  # not one line: walk on the counts themselves
        while candidate > 1 and activations(candidate) > room:
            candidate -= 1
        while activations(candidate + 1) <= room:
            candidate += 1
    return candidate


# -- time to the same loss --------------------------------------------------------------------------------------
def steps_to_target(global_batch: float, b_crit: float, s_min: float = 1.0) -> float:
    """S(B) = S_min (1 + B_crit / B) (McCandlish et al. 2018, eq. 2.11)."""
    if not (global_batch > 0 and 0 <= b_crit < math.inf):  # an infinite B_crit made every ratio inf / inf
        raise ValueError(f"global_batch must be > 0 and b_crit a finite batch >= 0, got {global_batch!r} and "
                         f"{b_crit!r}")
    return s_min * (1.0 + b_crit / global_batch)


def b_simple_from(results_dir: str | os.PathLike) -> float | None:
    """The lab's measured B_simple (pooled gradient noise scale over every probe of noise.csv), else None (no file,
    or an estimate not above 0: the pooled trace of the noise came out negative, which is no critical batch); a
    ValueError naming the file where it does not read or lacks the probes' columns."""
    import pandas as pd

    from labkit.study.noise_scale import aggregate

    path = Path(results_dir) / "noise.csv"
    if not path.exists():
        return None
    columns = ["grad_norm_small_sq", "grad_norm_big_sq", "noise_b_small", "noise_b_big"]
    try:
        noise = pd.read_csv(path)
    except (OSError, ValueError) as exc:  # empty (pandas' EmptyDataError is a ValueError), not CSV, not text
        raise ValueError(f"{path} does not read as the answer's gradient-noise probes ({exc})") from None
    missing = [c for c in columns if c not in noise.columns]
    if missing:  # a ValueError naming the file, not pandas' KeyError listing the columns
        raise ValueError(f"{path} lacks the gradient-noise probes' columns: {', '.join(missing)}")
    values = noise[columns].apply(pd.to_numeric, errors="coerce")
    unread = [c for c in columns if values[c].isna().any()]
    if unread:  # text or blank cells: named with the file, not a comparison's TypeError or "b_small nan"
        raise ValueError(f"{path}: {', '.join(unread)} must be numbers in every row")
    pooled = aggregate(values.itertuples(index=False, name=None))
    return None if pooled is None or pooled.b_simple is None or pooled.b_simple <= 0 else pooled.b_simple


def measured_b_crit(results_dir: str | os.PathLike, *, shown_as: str | None = None) -> tuple[float, str] | None:
    """(the critical batch an answer in `results_dir` measured, where it comes from), else None. First the LR study's
    fit of S(B) = S_min (1 + B_crit / B) to its best steps to the target (results.csv, `growth.critical_batch`) where
    its batches place it: the law the time to the same loss is predicted with, fitted to the steps the lab measured;
    else B_simple, the pooled gradient noise scale of noise.csv (`b_simple_from`), McCandlish et al.'s estimate of it
    (B_simple ~ 133 against the fit's ~ 424 on data/reference-ci: the noise scale is not the critical batch itself).
    `shown_as`: how the source names the directory (default: as given; "": the files' names alone)."""
    import pandas as pd

    from labkit.study.growth import critical_batch

    results = Path(results_dir) / "results.csv"
    shown = f"{results_dir}/" if shown_as is None else f"{shown_as}/" if shown_as else ""
    try:
        fit = critical_batch(pd.read_csv(results)) if results.is_file() else None
    except (KeyError, AttributeError, ValueError):  # a results.csv without an LR study's columns: none to fit
        fit = None
    if fit is not None and fit["placement"]["placed"]:
        return float(fit["b_crit"]), f"{fit['placement']['text']}: the LR study in {shown}results.csv"
    b_simple = b_simple_from(results_dir)
    return None if b_simple is None else (b_simple, f"B_simple measured in {shown}noise.csv")


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


def _conditions(before: Prediction, after: Prediction, b_crit: float | None, way: str) -> dict[str, str]:
    hidden = after.comm_s - after.exposed_comm_s
    step = (f"predicted: {after.exposed_comm_s:.3g} s of {after.comm_s:.3g} s communication exposed per step "
            f"({hidden:.3g} s hidden behind compute), offload {after.offload_s:.3g} s, compute {after.compute_s:.3g} s")
    rate = after.samples_per_s / before.samples_per_s
    scale = after.global_batch / before.global_batch
    if way == "ranks":
        why = f"{rate / scale:.0%} of linear scaling"
    elif way == "grad_accum":  # a micro-step's work stays the same: only the per-step costs are spread thinner
        why = ("the per-step costs accumulation spreads (the optimizer step, communication at the boundary) were "
               "already small" if rate < 1.1 else "accumulation spreads the per-step costs over more samples")
    else:
        why = ("the device is saturated (throughput no longer rises with the batch)" if rate < 1.1 else
               "throughput still rises with the batch")
    epoch = f"predicted samples/s x{rate:.2f} for a {scale:g}x batch: {why}"
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
                   activation_checkpointing: bool = False, b_crit: float | None = None,
                   host_memory_gb_per_s: float | None = None, zero: Mapping[str, Any] | None = None,
                   optimizer: str | None = None) -> dict[str, Any]:
    """The answer card's shape (labkit.study.card: ways x per_step/per_epoch/to_target, each with verdict, ratio,
    from_batch, to_batch, condition), PREDICTED for `cluster`. ranks: 1 GPU -> every GPU at `micro_batch`;
    micro_batch: `micro_batch_range` (default micro_batch/4 -> micro_batch*4, or the largest micro-batch that fits
    if smaller) on every GPU; grad_accum: 1 -> 16. A way whose either side does not fit has no verdict, and says so.
    `host_memory_gb_per_s`, `zero` and `optimizer` as `predict` takes them."""
    chosen = optimizer_for(strategy, optimizer)  # refused before anything is counted
    if b_crit is not None and (isinstance(b_crit, bool) or not isinstance(b_crit, numbers.Real)
                               or not 0 <= b_crit < math.inf):  # inf was "a ratio of times must be finite"
        raise ValueError(f"b_crit must be a finite critical batch >= 0 in samples, or None; got {b_crit!r}")
    made: dict[tuple[bool, int, int], Prediction] = {}  # the configuration at micro_batch serves three ways

    def run(c: Cluster, m: int, a: int = 1) -> Prediction:
        key = (c is cluster, m, a)
        if key not in made:
            made[key] = predict(workload, c, strategy=strategy, micro_batch=m, grad_accum=a, precision=precision,
                                activation_checkpointing=activation_checkpointing,
                                host_memory_gb_per_s=host_memory_gb_per_s, zero=zero, optimizer=optimizer)
        return made[key]

    largest = run(cluster, micro_batch).max_micro_batch  # first: `predict` checks micro_batch and the rest
    low, high = micro_batch_range or (max(1, micro_batch // 4), micro_batch * 4)
    if micro_batch_range is None:  # the default range stops at the largest micro-batch that fits
        high = max(micro_batch, min(high, largest))
    # one GPU has no link to another: `auto`, not a link only several GPUs can have (a bridge joins two)
    one = dataclasses.replace(cluster, gpus_per_node=1, nodes=1, inter_gbps=0.0, intra="auto")
    pairs: dict[str, tuple[Prediction, Prediction] | None] = {
        "ranks": None if cluster.world_size == 1 else (run(one, micro_batch), run(cluster, micro_batch)),
        "micro_batch": (run(cluster, low), run(cluster, high)) if low < high else None,
        "grad_accum": (run(cluster, micro_batch, GRAD_ACCUM_RANGE[0]), run(cluster, micro_batch, GRAD_ACCUM_RANGE[1])),
    }
    ways: dict[str, Any] = {}
    for way, pair in pairs.items():
        if pair is None:
            why = ("1 device: ranks cannot grow" if way == "ranks" else
                   f"the range {low} -> {high} does not grow the micro-batch" if micro_batch_range is not None else
                   f"micro-batch {low} is the largest that fits: the micro-batch cannot grow" if largest >= low else
                   f"predicted: no micro-batch fits on {cluster.describe()}")
            ways[way] = {kind: {"verdict": None, "ratio": None, "from_batch": None, "to_batch": None,
                                "condition": why} for kind in ("per_step", "per_epoch", "to_target")}
            continue
        before, after = pair
        too_big = next((p for p in pair if not p.fits), None)
        if too_big is not None:
            step = too_big.step_peak_bytes > too_big.device_bytes  # the optimizer step's peak is the larger
            needs = max(too_big.device_bytes, too_big.step_peak_bytes)
            why = (f"predicted: does not fit: micro-batch {too_big.micro_batch} on {too_big.hardware} needs "
                   f"{needs / 1e9:.1f} GB{' at the optimizer step' if step else ''} of the "
                   f"{cluster.gpu.usable_memory_bytes / 1e9:.1f} GB a process can use per GPU (the largest that "
                   f"fits: {too_big.max_micro_batch})")
            ways[way] = {kind: {"verdict": None, "ratio": None, "from_batch": before.global_batch,
                                "to_batch": after.global_batch, "condition": why}
                         for kind in ("per_step", "per_epoch", "to_target")}
            continue
        conditions = _conditions(before, after, b_crit, way)
        ways[way] = {kind: _way_entry(before, after, kind, b_crit, conditions[kind])
                     for kind in ("per_step", "per_epoch", "to_target")}
    return {"ways": ways, "deepspeed": _deepspeed_line(workload, cluster, micro_batch, precision,
                                                       activation_checkpointing, strategy, zero, host_memory_gb_per_s,
                                                       _stages_optimizer(strategy, chosen)),
            "caveats": run(cluster, micro_batch).caveats,
            "predicted": True, "flat_band": FLAT_BAND,
            "predicted_for": {"hardware": cluster.describe(), "gpu": cluster.gpu.name, "world_size": cluster.world_size,
                              "model": workload.name, "n_params": workload.n_params, "strategy": strategy,
                              "precision": precision, "activation_checkpointing": activation_checkpointing,
                              "optimizer": chosen, "b_crit": b_crit}}


def _stages_optimizer(strategy: str, chosen: str) -> str | None:
    """The optimizer the card's line of ZeRO stages steps with: the card's where it is not its strategy's default
    (plain PyTorch's torch_adam and the offloaded cpu_adam are; DeepSpeed's stages then take theirs)."""
    return None if chosen == optimizer_for(strategy) else chosen


def _deepspeed_line(workload: Workload, cluster: Cluster, micro_batch: int, precision: str, ckpt: bool,
                    strategy: str, zero: Mapping[str, Any] | None = None,
                    host_memory_gb_per_s: float | None = None, optimizer: str | None = None) -> str:
    """Each ZeRO strategy's step against stage 0's at `micro_batch` (in seconds where stage 0 does not fit there),
    the strategies the measured card's line reads (growth.ZERO, both offloads: where nothing else fits, ZeRO-3 with
    the optimizer offloaded often does). The `zero` settings apply to the card's own `strategy` (they were checked at
    its stage), the others run at DeepSpeed's defaults; `host_memory_gb_per_s` to the offloaded ones. A given
    `optimizer` steps every stage but the offloaded ones, whose modelled step is DeepSpeedCPUAdam's
    (`optimizer_for`)."""
    from labkit.study.growth import ZERO

    def one(s: str) -> Prediction:
        offloaded = STRATEGIES[s][1]
        return predict(workload, cluster, strategy=s, micro_batch=micro_batch, precision=precision,
                       activation_checkpointing=ckpt, zero=zero if s == strategy else None,
                       host_memory_gb_per_s=host_memory_gb_per_s if offloaded else None,
                       optimizer=None if offloaded else optimizer)

    base = one("z0")
    parts = []
    for name in ZERO:
        p = one(name)
        step = f"{p.step_time_s / base.step_time_s:.2f}x the step" if base.fits else f"{p.step_time_s:.3g} s per step"
        bound = f" (its step a lower bound; {p.step_time_s_if_nothing_hides:.3g} s with no communication hidden)"
        parts.append(f"{name} {step}{bound if p.caveats else ''}"
                     f"{'' if p.fits else ' (does not fit)'}, largest micro-batch {p.max_micro_batch}")
    if base.fits:
        head = f"predicted against ZeRO stage 0 at micro-batch {micro_batch} (its largest: {base.max_micro_batch})"
    else:
        head = (f"predicted at micro-batch {micro_batch}, where ZeRO stage 0 does not fit (its largest: "
                f"{base.max_micro_batch})")
    if zero:
        head += f" (the zero settings given apply to {strategy} only)"
    if optimizer not in (None, "fused_adam"):
        offloaded = " and ".join(s for s in ZERO if STRATEGIES[s][1])
        head += f" (every stage with {optimizer} but {offloaded}, whose host steps with cpu_adam)"
    return head + ": " + "; ".join(parts)


# -- `labkit predict` ---------------------------------------------------------------------------------------------
def measure_links(*args: Any, **kwargs: Any) -> Any:
    """labkit.study.comms.measure_links: a short all-reduce / all-gather / reduce-scatter benchmark on this machine
    (real processes; gloo on CPU, NCCL on GPU), fitted per op as alpha + bytes x beta."""
    from labkit.study import comms

    return comms.measure_links(*args, **kwargs)


# -- report.html's "predicted on other hardware" section -------------------------------------------------------------
REPORT_CLUSTERS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("one node of 8 A100-80GB (NVSwitch)", dict(gpus_per_node=8, nodes=1)),
                   ("4 such nodes, 8 x 200 Gb/s HDR InfiniBand each", dict(gpus_per_node=8, nodes=4, inter_gbps=1600)))
TINY_STEP_S = 1e-3  # below this a predicted GPU step is mostly the host issuing kernels: too small a model


def answer_workload(results_dir: str | os.PathLike) -> tuple[Workload, int]:
    """The model an answer's results dir measured (machine.json's profile and model) and its ranks-way micro-batch."""
    import json

    from labkit.core.config import RunConfig
    from labkit.study.answer_profiles import PROFILES, with_model

    machine = json.loads((Path(results_dir) / "machine.json").read_text())
    model = machine.get("model") or "mlp"
    if model not in ("mlp", "gpt") and "data" not in machine:  # a model of yours, trained on data not named
        raise ValueError(f"{Path(results_dir) / 'machine.json'} names the model {model} but not the data and loss it "
                         "trained on (an answer before 2026-11-30): predict it with `labkit predict --model "
                         f"{model} --data ... --loss ...`")
    # the model fields the answer trained with, as `labkit answer --model/--data/--loss` made them
    profile = with_model(PROFILES[machine.get("profile") or "ci"], None if model == "mlp" else model,
                         machine.get("data"), machine.get("loss"))
    config = RunConfig.from_dict({"example": "deepspeed", **profile.model})
    micro = 64
    results = Path(results_dir) / "results.csv"
    if results.exists():
        import pandas as pd

        table = pd.read_csv(results)
        ranks = table[table["growth"].astype(str).str.contains("ranks")] if "growth" in table else table.iloc[0:0]
        if not ranks.empty:
            micro = int(ranks["micro_batch"].iloc[0])
    return lab_workload(config), micro


def report_section(results_dir: str | os.PathLike, *, precision: str = "bf16") -> str:
    """HTML: the answer card PREDICTED for one node of 8 A100s and for 4 such nodes, for the model the answer in
    `results_dir` measured, with its measured B_crit (`measured_b_crit`). Every number is labelled predicted."""
    import html

    workload, micro = answer_workload(results_dir)
    b_crit, b_crit_source = measured_b_crit(results_dir, shown_as="") or (None, "")  # the answer's own files
    parts = ["<section id='predicted-other-hardware'><h2>Predicted on other hardware (not measured)</h2>",
             "<p>What <code>labkit.study.predict</code> predicts for this answer's model "
             f"({html.escape(workload.name)}, "
             f"{workload.n_params:,} parameters, {precision}, ZeRO stage 0) on GPUs this machine does not have. "
             "Every number here is a <b>prediction</b> (docs/predict.md: the model, its sources, what it leaves out)"
             + (f"; time to the same loss uses the answer's {html.escape(b_crit_source)}" if b_crit else "")
             + ".</p>"]
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
            first = next(iter(kinds.values()))
            batches = f" (global batch {first['from_batch']} &rarr; {first['to_batch']})" if first["from_batch"] else ""
            parts.append(f"<tr><td>{way}{batches}</td>{''.join(cells)}</tr>")
        parts.append("</table>")
        # the launches are modelled (HostCosts: a GPU node's host as measured), and at this size they are the step
        launches = node_host(cluster.gpu, "launch_s")
        note = (f" At {step.step_time_s * 1e6:.0f} us a step this model is too small for these GPUs: "
                f"{step.host_bound_s * 1e6:.0f} us of it is predicted to be the device waiting on the host to issue "
                "its kernels" + (f" (the launch figure: {launches[1]})" if launches else "") + "."
                if step.step_time_s < TINY_STEP_S else "")
        parts.append(f"<p>Predicted step at micro-batch {micro}: {step.step_time_s:.3g} s (compute "
                     f"{step.compute_s:.3g} s, exposed communication {step.exposed_comm_s:.3g} s).{note}</p>")
    parts.append("</section>")
    return "\n".join(parts)

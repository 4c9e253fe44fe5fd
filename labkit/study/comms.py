"""What the ranks send each other: DeepSpeed 0.19.8's collectives per step, from its source and from its log.

    from labkit.study import comms
    cs = comms.collectives(3, n_params, 8, precision="bf16", grad_accum=4, modules=comms.module_layout(model))
    comms.bytes_per_rank_per_step(cs, 8)          # what one rank puts on the wire per optimizer step
    comms.measured_collectives("runs/<run>")      # what DeepSpeed's comms logger counted (RunConfig(comms_log=True))
    comms.predicted_vs_measured("runs/<run>")     # the two side by side, per operation
    link = comms.measure_links()                  # an alpha-beta fit of this machine's all-reduce, all-gather, ...
    link.seconds(cs[0], 8)                        # one call's time on that link with a ring algorithm

`collectives` reads DeepSpeed's code paths, not the ZeRO paper: every `Collective` names the file and
line (deepspeed 0.19.8, as installed) of the call it stands for, and the function the comms log
names as its caller, so a measured run checks it record by record (`predicted_vs_measured`,
tests/study/test_comms.py). Message sizes follow DeepSpeed's padding and bucketing exactly when the
parameter layout is given (`modules`); without it the sizes are exact in bytes and approximate in
counts. ZeRO-3's all-gathers are DeepSpeed's parameter coordinator replayed over the model's module trace
(`labkit.study.zero3`). Settings this module does not model are refused with the setting named.

The message-size convention (`Collective.bytes`): the bytes one rank hands to torch.distributed for
the whole collective: the tensor of an all-reduce or broadcast, the *gathered output* of an
all-gather, the *input* of a reduce-scatter (the full, padded gradient bucket). DeepSpeed's comms
logger reports an all-gather's *input* (one rank's shard, `get_msg_size_from_args` reads the
argument named `tensor`), so `measured_collectives` multiplies those by the world size.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pandas as pd

from labkit.runtime.arguments import whole_number
from labkit.study import zero3

Op = Literal["all_reduce", "all_gather", "reduce_scatter", "broadcast"]
OPS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8, "uint8": 1}
PRECISIONS = ("fp32", "bf16", "fp16")

# -- DeepSpeed 0.19.8's constants (every one read from its source) ---------------------------
SRC = "deepspeed 0.19.8: "
# Stage 0 all-reduces gradients in chunks of this many elements; no config key sets it.
ENGINE_ALLREDUCE_ELEMS = 500_000_000  # deepspeed/runtime/engine.py:151 (MEMORY_OPT_ALLREDUCE_SIZE)
# Stages 1-2 pad the flat parameter buffer to a multiple of 2 x world size elements.
ZERO12_ALIGNMENT = 2  # deepspeed/runtime/zero/stage_1_and_2.py:387 (nccl_start_alignment_factor), used at :441
GRADIENT_CLIPPING_DEFAULT = 1.0  # deepspeed/runtime/constants.py:203

# The DeepSpeed function each collective's comms-log record names ("Caller Func"), and what it moves.
CALLERS = {
    "allreduce_bucket": "gradients",                       # engine.py:3811, stage_1_and_2.py:2384
    "reduce_scatter_fn": "gradients",                      # comm/comm.py:283 via coalesced_collectives.py:23
    "all_gather_into_tensor_dp_groups": "updated parameters",  # runtime/utils.py:1016
    "allgather_fn": "parameters",                          # comm/comm.py:352 via partition_parameters.py:123
    "_allgather_params_coalesced": "persistent parameters",  # partition_parameters.py:2073
    "clip_grad_norm_": "gradient norm",                    # runtime/utils.py:418
    "get_grad_norm_direct": "gradient norm",               # stage_1_and_2.py:2693, stage3.py:2469
    "complete_grad_norm_calculation_for_cpu_offload": "gradient norm",  # stage_1_and_2.py:1945, stage3.py:1991
    "has_overflow": "overflow check",                      # stage_1_and_2.py:3242, stage3.py:3027
    "_broadcast_model": "initial weights",                 # engine.py:2038, setup only
    "_zero_init_param": "initial weights",                 # ZeRO-3's conversion of the model, setup only
    "assert_lst_len_same_as_other_ranks": "ZeRO-3 trace check",  # steps 1-2 only
    "get_lst_from_rank0": "ZeRO-3 trace check",
}
# DeepSpeed's op names in its log, as this module's ops.
_LOGGED_OPS = {"all_reduce": "all_reduce", "inference_all_reduce": "all_reduce", "all_gather": "all_gather",
               "all_gather_into_tensor": "all_gather", "reduce_scatter": "reduce_scatter",
               "reduce_scatter_tensor": "reduce_scatter", "broadcast": "broadcast", "barrier": "barrier"}


@dataclass(frozen=True, kw_only=True)
class Collective:
    """One kind of call DeepSpeed makes: `count` calls of `bytes` each, per micro-step or per step.

    `bytes`: the message per rank as DeepSpeed hands it to torch.distributed: the whole tensor of
    an all-reduce or broadcast, the gathered OUTPUT of an all-gather, the INPUT of a reduce-scatter.
    `overlappable`: whether it can run behind compute with DeepSpeed's settings (overlap_comm on a side
    stream, ZeRO-3's prefetch). The last gradient bucket of a backward cannot (it is flushed when the
    backward ends), nor the first parameter gather of a forward (nothing computes before it): a model
    within one bucket hides nothing.
    """

    op: Op
    bytes: int
    count: int              # calls per `per`
    per: Literal["micro_step", "step"]
    phase: Literal["forward", "backward", "optimizer"]
    dtype: str              # of the message: fp32, bf16, fp16, fp64, uint8
    overlappable: bool
    what: str               # gradients, updated parameters, parameters, gradient norm, ...
    caller: str             # the DeepSpeed function the comms log names ("Caller Func")
    source: str             # file:line of the call in DeepSpeed 0.19.8
    per_step: int           # calls per optimizer step: count x grad_accum for micro-step collectives

    @property
    def bytes_per_step(self) -> int:
        return self.bytes * self.per_step


# -- the ring model --------------------------------------------------------------------------
def ring_steps(op: str, world_size: int) -> int:
    """Latency terms of a ring algorithm: 2(N-1) for an all-reduce (reduce-scatter then all-gather),
    N-1 for an all-gather, a reduce-scatter or a pipelined broadcast."""
    if op not in OPS:  # a misspelled all-reduce was timed as an all-gather
        raise ValueError(f"unknown collective {op!r}; known: {OPS}")
    n = world_size
    return 2 * (n - 1) if op == "all_reduce" else n - 1


def ring_factor(op: str, world_size: int) -> float:
    """Bytes one rank sends per message byte with a ring: 2(N-1)/N for an all-reduce, (N-1)/N for an
    all-gather (of its output), a reduce-scatter (of its input) or a broadcast (a pipelined ring,
    averaged over the ranks: the last rank sends nothing)."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; known: {OPS}")
    n = world_size
    return (2 * (n - 1) if op == "all_reduce" else n - 1) / n


def ring_bytes_sent(c: Collective, world_size: int) -> float:
    """Bytes one rank sends for ONE call of `c` with a ring algorithm (NCCL's and gloo's for large
    messages): 2(N-1)/N x size for an all-reduce, (N-1)/N x size for an all-gather or reduce-scatter."""
    return ring_factor(c.op, world_size) * c.bytes


def bytes_per_rank_per_step(collectives: Iterable[Collective], world_size: int) -> float:
    """Bytes one rank sends per optimizer step: every collective's ring bytes times its calls per step."""
    return sum(ring_bytes_sent(c, world_size) * c.per_step for c in collectives)


# -- what DeepSpeed 0.19.8 sends ---------------------------------------------------------------
def module_layout(model: Any) -> list[list[int]]:
    """Each module's own parameters' element counts, for every module that holds some, in
    registration order (the forward order of the lab's models; check yours if it reuses modules).
    ZeRO-3 gathers one module's parameters in one call; stages 0-2 flatten them in this order.
    Works on the meta device."""
    return [own for _, own in module_params(model)]


def tied_head(model: Any) -> bool:
    """Whether the module registered last holds only parameters of the first parameter-holding module: a language
    model's LM head tied to its token embedding (Hugging Face's `tie_word_embeddings`), which `module_layout` leaves
    out (a shared parameter is counted once) and ZeRO-3 fetches again at the end of the forward. Not recognised (so
    not modelled): a tied head with a bias of its own, or one followed by another module (a value head)."""
    first: set[int] | None = None
    last: list[int] = []
    seen: set[int] = set()
    holders = 0  # modules holding a parameter of their own, as `module_params` counts them
    for _, module in model.named_modules():
        own = [id(p) for p in module.parameters(recurse=False)]
        if own:
            first = set(own) if first is None else first
            last = own
            holders += not seen.issuperset(own)
            seen.update(own)
    return first is not None and set(last) <= first and holders > 1


def module_params(model: Any) -> Iterator[tuple[str, list[int]]]:
    """(name, its own parameters' element counts) of every module that holds some, in registration order."""
    seen: set[int] = set()
    for name, module in model.named_modules():
        own = []
        for param in module.parameters(recurse=False):
            if id(param) not in seen:  # a shared parameter once, as model.parameters() yields it
                seen.add(id(param))
                own.append(param.numel())
        if own:
            yield name, own


def _auto_keys(settings: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The keys of `settings` whose value is "auto", nested sections' as dotted keys."""
    keys = []
    for key, value in settings.items():
        if isinstance(value, Mapping):
            keys += _auto_keys(value, f"{prefix}{key}.")
        elif isinstance(value, str) and value.strip().lower() == "auto":
            keys.append(f"{prefix}{key}")
    return keys


def zero_config(stage: int, zero_settings: Mapping[str, Any]) -> Any:
    """DeepSpeed's own model of the zero_optimization section: its defaults, aliases and checks."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError

    settings = {k: v for k, v in zero_settings.items() if k != "stage"}
    # "auto" is the Hugging Face Trainer's: it puts a number derived from the model there before DeepSpeed reads the
    # config (DeepSpeed alone reads "auto" as its default), so the run used neither; the number is needed. Inside a
    # section too (offload_optimizer.device), named by its dotted key.
    auto = sorted(_auto_keys(settings))
    if auto:
        raise ValueError(f"zero settings {', '.join(auto)} are 'auto': the Hugging Face Trainer fills those in from "
                         "the model before DeepSpeed reads them; give the values it used")
    try:
        return DeepSpeedZeroConfig(stage=stage, **settings)
    except ValidationError as exc:  # each problem with its setting; an unknown key with the keys there are
        problems, unknown = [], False
        for error in exc.errors():
            key = ".".join(map(str, error["loc"]))
            if error["type"] == "extra_forbidden":
                problems.append(f"{key}: not a zero_optimization key")
                unknown = True
            elif key in ("offload_param", "offload_optimizer"):
                problems.append(f"{key}: a section, not a value here; the strategy says whether the optimizer is "
                                "offloaded (--offload-optimizer, points.csv's offload_optimizer), and ZeRO-3's "
                                "parameter offload (offload_param) is not modelled")
            else:
                problems.append(f"{key}: {error['msg']}")
        keys = sorted({f.alias or name for name, f in DeepSpeedZeroConfig.model_fields.items()} - {"stage"})
        raise ValueError("zero settings refused by DeepSpeed: " + "; ".join(problems)
                         + (f" (its keys: {', '.join(keys)})" if unknown else "")) from None
    except Exception as exc:  # DeepSpeed's own checks beside pydantic's
        raise ValueError(f"zero settings refused by DeepSpeed: {exc}") from None


def zero_settings(text: str) -> dict[str, Any]:
    """`zero_optimization` settings written `key=value,key=value` (a ds_config's keys; values true/false, numbers
    as 1e7 or 50000000, else strings), as a dict; a ValueError names what does not read. What DeepSpeed makes of
    them is checked where they are used (`check_zero_settings`)."""
    out: dict[str, Any] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise ValueError(f"zero settings are key=value pairs separated by commas; got {item!r}")
        if key in out:
            raise ValueError(f"zero setting {key!r} given twice")
        out[key] = _setting(value)
    return out


def _setting(value: str) -> Any:
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    try:
        number = float(value)
    except ValueError:
        return value
    return int(number) if number.is_integer() and abs(number) < 2**63 else number


def check_zero_settings(stage: int, settings: Mapping[str, Any], offload_optimizer: bool | None = False) -> Any:
    """DeepSpeed's config model of `settings` at `stage`; a ValueError naming the setting where that model refuses
    them, this module does not model its communication, or they say otherwise than the stage and strategy do
    (`stage`; an optimizer offload turned on or off, under any of DeepSpeed's names for it, unless
    `offload_optimizer` is None: whichever the settings say)."""
    if "stage" in settings:
        raise ValueError("the zero settings do not set the stage: the strategy does (--stage, points.csv's stage)")
    cfg = zero_config(stage, settings)
    if cfg.offload_optimizer is not None:  # said, under one of its names
        offloaded = str(cfg.offload_optimizer.device) != "none"
        if offload_optimizer is None:
            offload_optimizer = offloaded
        if offloaded != offload_optimizer:
            raise ValueError(f"the zero settings turn the optimizer's offload {'on' if offloaded else 'off'}: the "
                             "strategy says whether it is offloaded (--offload-optimizer, points.csv's "
                             "offload_optimizer)")
    _refuse_unmodelled(stage, cfg, bool(offload_optimizer))
    return cfg


def stage3_only(settings: Mapping[str, Any]) -> list[str]:
    """The keys of `settings` that are ZeRO-3's alone (`stage3_*`, or the field name DeepSpeed reads one into): at
    stages 0-2 they change nothing. A ds_config may carry them at any stage (DeepSpeed-Chat's does); `labkit
    predict --zero` refuses them there, not to ignore what it was told."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    names = {key for name, f in DeepSpeedZeroConfig.model_fields.items()
             for key in (name, f.alias or name) if (f.alias or name).startswith("stage3_")}
    return [key for key in settings if key in names]


def _refuse_unmodelled(stage: int, cfg: Any, offload_optimizer: bool) -> None:
    """Settings whose communication this module does not model: refused, the setting named."""
    unmodelled = {
        "zero_quantized_weights": cfg.zero_quantized_weights, "zero_quantized_gradients": cfg.zero_quantized_gradients,
        "zero_quantized_nontrainable_weights": cfg.zero_quantized_nontrainable_weights,
        "zero_hpz_partition_size": cfg.zero_hpz_partition_size > 1,
        "contiguous_gradients": stage in (1, 2, 3) and not cfg.contiguous_gradients,
        "use_multi_rank_bucket_allreduce": stage in (1, 2) and not cfg.use_multi_rank_bucket_allreduce,
        "reduce_scatter": stage == 3 and not cfg.reduce_scatter,
        "stage3_use_all_reduce_for_fetch_params": stage == 3 and cfg.use_all_reduce_for_fetch_params,
        "stage3_allgather_sequential": stage == 3 and cfg.allgather_sequential,
        "offload_param": stage == 3 and cfg.offload_param is not None,
        # ZeRO-3 leaf modules fetch their subtree's parameters at once: zero3.record does not model them
        "stage3_module_granularity_threshold": stage == 3 and cfg.module_granularity_threshold > 0,
        "leaf_module": stage == 3 and (bool(cfg.leaf_module.names or cfg.leaf_module.name_suffixes)
                                       or cfg.leaf_module.classes != type(cfg.leaf_module)().classes),
        "zenflow": cfg.zenflow is not None,
    }
    bad = [name for name, on in unmodelled.items() if on]
    if bad:
        raise ValueError(f"labkit.study.comms does not model the communication of {bad}")
    if offload_optimizer and stage == 0:
        raise ValueError("offload_optimizer needs ZeRO stage 1, 2 or 3")


def _check_inputs(stage: int | None, n_params: int, world_size: int, precision: str, grad_accum: int,
                  persistent_params: int, modules: Sequence[Sequence[int]] | None) -> list[int] | None:
    if stage not in (None, 0, 1, 2, 3):
        raise ValueError(f"stage must be None (plain PyTorch) or 0-3, got {stage!r}")
    for name, value in (("n_params", n_params), ("world_size", world_size), ("grad_accum", grad_accum)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if not isinstance(persistent_params, int) or not 0 <= persistent_params <= n_params:
        raise ValueError(f"persistent_params must be an integer from 0 to n_params ({n_params}), "
                         f"got {persistent_params!r}")
    if modules is not None and persistent_params:
        raise ValueError("persistent_params is for a model given without modules: with modules, ZeRO-3's "
                         "stage3_param_persistence_threshold decides which parameters persist")
    if modules is None:
        return None
    numels = [int(n) for module in modules for n in module]
    if sum(numels) != n_params or any(n < 1 for n in numels):
        raise ValueError(f"modules hold {sum(numels)} parameters (sizes must be positive), n_params is {n_params}")
    return numels


def _grouped(sizes: Iterable[int]) -> list[tuple[int, int]]:
    """(size, how many) in first-seen order: one Collective per distinct message size."""
    counts: dict[int, int] = {}
    for size in sizes:
        counts[size] = counts.get(size, 0) + 1
    return list(counts.items())


def _emit(out: list[Collective], sizes: Iterable[int], *, per: str, grad_accum: int, **fields: Any) -> None:
    for size, count in _grouped(sizes):
        out.append(Collective(bytes=size, count=count, per=per,  # type: ignore[arg-type]
                              per_step=count * (grad_accum if per == "micro_step" else 1), **fields))


def collectives(stage: int | None, n_params: int, world_size: int, *, precision: str, grad_accum: int = 1,
                offload_optimizer: bool = False, persistent_params: int = 0, reuse_distance: int | None = None,
                bucket_elems: int | None = None, modules: Sequence[Sequence[int]] | None = None,
                gradient_clipping: float = GRADIENT_CLIPPING_DEFAULT, tied_head: bool = False,
                trace: zero3.ModuleTrace | None = None, **zero_settings: Any) -> list[Collective]:
    """Every collective DeepSpeed 0.19.8 runs in a steady training step (step 3 onwards: ZeRO-3
    records its module trace in the first steps), with its defaults unless `zero_settings` (the
    `zero_optimization` keys, e.g. `overlap_comm=True`, `stage3_prefetch_bucket_size=0`) say otherwise.

    `stage`: None is plain PyTorch (one process: sends nothing); 0 is DeepSpeed's data parallelism.
    `modules`: each module's parameter sizes (`module_layout(model)`); with it, bucket boundaries,
    padding, ZeRO-3's persistent parameters and its per-module gathers are exact. Without it the
    model is one module: bytes stay right, call counts are a lower bound, and `persistent_params`
    (elements ZeRO-3 keeps whole) is taken as one tensor.
    `reuse_distance`, `bucket_elems`: `stage3_max_reuse_distance` and `reduce_bucket_size` (elements).
    `gradient_clipping`: the top-level ds_config key (DeepSpeed's default 1.0); stage 0 in fp32 clips
    with one all-reduce of the norm.
    `tied_head`: the model ends with an LM head that is its first module's parameters (`tied_head(model)`): ZeRO-3
    fetches them again there, gathering them where they were released (`_stage3_gathers`).
    `trace`: ZeRO-3's module trace (`zero3.record(model, ...)`): every hook, parameter-free modules' too, so the
    gathers' calls come out as DeepSpeed makes them; without it, `modules` stands for the trace.
    One rank sends nothing: DeepSpeed still calls some collectives on a one-rank group, but they move no bytes.
    """
    numels = _check_inputs(stage, n_params, world_size, precision, grad_accum, persistent_params, modules)
    if trace is not None:
        if sum(trace.numels) != n_params:
            raise ValueError(f"the trace's model has {sum(trace.numels)} parameters, n_params says {n_params}: "
                             "a trace of another model")
        if persistent_params:
            raise ValueError("persistent_params is for a model given without a trace: with one, ZeRO-3's "
                             "stage3_param_persistence_threshold decides which parameters persist")
        if trace.returned and grad_accum > 1 and stage == 3:
            raise ValueError("a module of this model returns a parameter, which DeepSpeed keeps gathered until the "
                             "optimizer step, across the micro-steps of an accumulation: not modelled (grad_accum 1 "
                             "is)")
    if stage is None or world_size == 1:
        return []
    settings = dict(zero_settings)
    if reuse_distance is not None:
        settings["stage3_max_reuse_distance"] = reuse_distance
    if bucket_elems is not None:
        settings["reduce_bucket_size"] = bucket_elems
    cfg = check_zero_settings(stage, settings, offload_optimizer)
    out: list[Collective] = []
    if stage == 0:
        _stage0(out, numels or [n_params], precision, grad_accum, gradient_clipping)
    elif stage in (1, 2):
        _stage12(out, stage, numels or [n_params], world_size, precision, grad_accum, offload_optimizer, cfg)
    else:
        _stage3(out, modules, n_params, persistent_params, world_size, precision, grad_accum, offload_optimizer, cfg,
                tied_head, trace)
    return out


def _stage0(out: list[Collective], numels: list[int], precision: str, grad_accum: int, clipping: float) -> None:
    # engine.backward -> _backward_epilogue -> allreduce_gradients (engine.py:3165) after the whole backward, at
    # the accumulation boundary only (engine.py:3095): buffered_allreduce_fallback -> allreduce_no_retain chunks the
    # grads in parameters() order, closing a chunk once it exceeds 5e8 elements (engine.py:3834), one all-reduce each
    # in the communication dtype, the training dtype by default (engine.py:1719-1730; the all_reduce at :3811,
    # the gradients averaged after it by default).
    size = DTYPE_BYTES[precision]
    _emit(out, (c * size for c in _chunks_over(numels, ENGINE_ALLREDUCE_ELEMS)), op="all_reduce", per="step",
          grad_accum=grad_accum, phase="backward", dtype=precision, overlappable=False, what="gradients",
          caller="allreduce_bucket", source=SRC + "runtime/engine.py:3095 -> :3811")
    if precision == "fp32" and clipping > 0:
        # _take_model_step clips fp32 grads without ZeRO (engine.py:3511): one fp32 norm all-reduced (utils.py:418).
        _emit(out, [4], op="all_reduce", per="step", grad_accum=grad_accum, phase="optimizer", dtype="fp32",
              overlappable=False, what="gradient norm", caller="clip_grad_norm_",
              source=SRC + "runtime/engine.py:3511 -> runtime/utils.py:418")


# torch's DistributedDataParallel (what "plain PyTorch" on several GPUs is): gradients all-reduced in buckets as the
# backward produces them, parameters taken in reverse order (torch/nn/parallel/distributed.py, torch 2.13), a first
# bucket of dist._DEFAULT_FIRST_BUCKET_BYTES = 1 MiB, then bucket_cap_mb's default of 25 MiB each
# (_DEFAULT_BUCKET_CAP_MB); a bucket closes once it reaches its cap (reducer.cpp, compute_bucket_assignment_by_size).
DDP_FIRST_BUCKET_BYTES = 1024 * 1024
DDP_BUCKET_BYTES = 25 * 1024 * 1024


def ddp_collectives(numels: Sequence[int], world_size: int, *, grad_accum: int = 1) -> list[Collective]:
    """What torch's DDP sends per optimizer step for parameters of `numels` elements (registration order): one
    all-reduce per gradient bucket, in fp32 whatever the training precision (the weights stay fp32 under autocast,
    as the lab's plain trainer keeps them, so their gradients are fp32), once per step (gradient accumulation
    under `no_sync`, DDP's way to skip the reduction of the other micro-steps). Every bucket but the last runs
    while the backward goes on; the last (the first layers' gradients, ready when the backward ends) cannot. The
    buckets follow reverse registration order; torch rebuilds them after the first step in the order gradients were
    ready (`_rebuild_buckets`), the same for a model that registers its modules in forward order."""
    if world_size == 1:
        return []
    sizes, size, cap = [], 0, DDP_FIRST_BUCKET_BYTES
    for n in reversed(list(numels)):
        size += 4 * int(n)
        if size >= cap:
            sizes.append(size)
            size, cap = 0, DDP_BUCKET_BYTES
    sizes += [size] if size else []
    out: list[Collective] = []
    for part, hides in ((sizes[:-1], True), (sizes[-1:], False)):
        _emit(out, part, op="all_reduce", per="step", grad_accum=grad_accum, phase="backward", dtype="fp32",
              overlappable=hides, what="gradients", caller="DistributedDataParallel",
              source="torch 2.13: torch/nn/parallel/distributed.py, the reducer's bucketed all-reduce")
    return out


def _chunks_over(numels: Iterable[int], limit: int) -> list[int]:
    """DeepSpeed's "fill a chunk, send it once it exceeds the limit" loops (engine.py:3834,
    stage_1_and_2.py:1568): elements per call."""
    chunks, numel = [], 0
    for n in numels:
        numel += n
        if numel > limit:
            chunks.append(numel)
            numel = 0
    return chunks + ([numel] if numel else [])


def _zero12_buckets(numels: list[int], order: list[int], world_size: int, bucket: int) -> list[list[int]]:
    """Elements of each all-reduce of stages 1-2, per bucket flush: the ipg bucket flushes before a parameter
    that would overflow it (stage_1_and_2.py:1422) and once more when the backward ends; its slices, split at
    partition boundaries and merged while they go to one rank (:1640-1690), are all-reduced together, a new
    call once they exceed the bucket (:1568)."""
    aligned = math.ceil(sum(numels) / (ZERO12_ALIGNMENT * world_size)) * ZERO12_ALIGNMENT * world_size
    partition = aligned // world_size
    offsets = [0]
    for n in numels[:-1]:
        offsets.append(offsets[-1] + n)
    ipg: list[list[int]] = [[]]
    elements = 0
    for i in order:
        if elements + numels[i] > bucket and elements > 0:
            ipg.append([])
            elements = 0
        ipg[-1].append(i)
        elements += numels[i]
    flushes = []
    for params in filter(None, ipg):
        slices: list[tuple[int, int]] = []  # (owner rank, elements)
        for i in params:
            start, end = offsets[i], offsets[i] + numels[i]
            while start < end:
                rank = start // partition
                stop = min(end, (rank + 1) * partition)
                if slices and slices[-1][0] == rank:
                    slices[-1] = (rank, slices[-1][1] + stop - start)
                else:
                    slices.append((rank, stop - start))
                start = stop
        flushes.append(_chunks_over([n for _, n in slices], bucket))
    return flushes


def _stage12(out: list[Collective], stage: int, numels: list[int], world_size: int, precision: str, grad_accum: int,
             offload: bool, cfg: Any) -> None:
    size = DTYPE_BYTES[precision]
    # Gradients: stage 2 reduces in the backward hooks of every micro-step, stage 1 at the boundary only
    # (reduce_ready_partitions_and_remove_grads, stage_1_and_2.py:2294). Hooks fire as gradients are ready: for
    # torch's nn.Linear (addmm) the bias's before the weight's, modules in reverse, so the parameters in reverse;
    # stage 1 without overlap_comm loops over the parameters in order after the backward (reduce_gradients, :958-977).
    # With use_multi_rank_bucket_allreduce (default) each bucket is ALL-REDUCED and every rank keeps its slice
    # (:1695 -> allreduce_and_scatter -> allreduce_bucket's all_reduce, :2384).
    hooks = stage == 2 or cfg.overlap_comm
    order = list(range(len(numels)))[::-1] if hooks else list(range(len(numels)))
    # With overlap_comm they run on a side stream while the backward goes on, except the last bucket's:
    # it is flushed when the backward has ended (independent_gradient_partition_epilogue, :1016).
    flushes = _zero12_buckets(numels, order, world_size, int(cfg.reduce_bucket_size))
    for k, calls in enumerate(flushes):
        _emit(out, (c * size for c in calls), op="all_reduce", per="micro_step" if stage == 2 else "step",
              grad_accum=grad_accum, phase="backward", dtype=precision,
              overlappable=bool(cfg.overlap_comm) and k < len(flushes) - 1, what="gradients",
              caller="allreduce_bucket", source=SRC + "runtime/zero/stage_1_and_2.py:2294 -> :1695 -> :2384")
    # After the step every rank all-gathers the updated parameters: the whole flat buffer, padded to a multiple of
    # 2 x world size elements (:441), one all_gather_into_tensor per parameter group (:3155 -> runtime/utils.py:1016).
    pad = sum((-n) % (16 // math.gcd(16, size)) for n in numels[:-1]) if cfg.parameter_alignment else 0
    aligned = math.ceil((sum(numels) + pad) / (ZERO12_ALIGNMENT * world_size)) * ZERO12_ALIGNMENT * world_size
    _emit(out, [aligned * size], op="all_gather", per="step", grad_accum=grad_accum, phase="optimizer",
          dtype=precision, overlappable=False, what="updated parameters", caller="all_gather_into_tensor_dp_groups",
          source=SRC + "runtime/zero/stage_1_and_2.py:3155 -> runtime/utils.py:1016")
    if precision != "fp32":
        # bf16/fp16 check the gradients for inf/NaN: one byte all-reduced per step (:3029 -> :3242).
        _emit(out, [1], op="all_reduce", per="step", grad_accum=grad_accum, phase="optimizer", dtype="uint8",
              overlappable=False, what="overflow check", caller="has_overflow",
              source=SRC + "runtime/zero/stage_1_and_2.py:3242")
    # The global gradient norm (compute_grad_norm, default on): one fp32 scalar per parameter group.
    caller, line = (("complete_grad_norm_calculation_for_cpu_offload", 1945) if offload
                    else ("get_grad_norm_direct", 2693))
    _emit(out, [4], op="all_reduce", per="step", grad_accum=grad_accum, phase="optimizer", dtype="fp32",
          overlappable=False, what="gradient norm", caller=caller,
          source=SRC + f"runtime/zero/stage_1_and_2.py:{line}")


def _persistent(modules: Sequence[Sequence[int]], cfg: Any) -> list[list[bool]]:
    """ZeRO-3's persistent parameters, per module (`zero3.persistent_ids` over the layout's parameters in order)."""
    keep = zero3.persistent_ids([n for module in modules for n in module], cfg)
    ids = iter(range(sum(map(len, modules))))
    return [[next(ids) in keep for _ in module] for module in modules]


def _partitioned(modules: Sequence[Sequence[int]], cfg: Any) -> list[list[int]]:
    """Per module, the element counts of its parameters ZeRO-3 partitions and gathers (not `_persistent`)."""
    flags = _persistent(modules, cfg)
    return [[n for n, keep in zip(m, f, strict=True) if not keep] for m, f in zip(modules, flags, strict=True)]


def gathered_params(modules: Sequence[Sequence[int]], **zero_settings: Any) -> list[int]:
    """Per module (`module_layout`'s shape), how many of its parameters ZeRO-3 gathers (the rest persist)."""
    return [len(part) for part in _partitioned(modules, zero_config(3, zero_settings))]


def persistent_elements(modules: Sequence[Sequence[int]], **zero_settings: Any) -> int:
    """Elements of the parameters ZeRO-3 keeps whole on every rank (`_persistent`)."""
    flags = _persistent(modules, zero_config(3, zero_settings))
    return sum(n for module, row in zip(modules, flags, strict=True) for n, keep in zip(module, row, strict=True)
               if keep)


def gathered_elements(numels: Iterable[int], world_size: int) -> int:
    """Elements of a ZeRO-3 all-gather's output: each parameter's partition is ceil(n / N) elements
    (partition_parameters.py:1690-1699), N of them."""
    return world_size * sum(math.ceil(n / world_size) for n in numels)


def _stage3_gathers(modules: Sequence[Sequence[int]] | None, n_params: int, persistent_params: int, world_size: int,
                    cfg: Any, tied_head: bool = False,
                    trace: zero3.ModuleTrace | None = None) -> tuple[list[int], list[int], list[int]]:
    """(forward calls, backward calls, persistent parameters) of ZeRO-3, in gathered elements.

    With a module trace (`zero3.record`) or a layout (`modules`, taken as parameter-holding modules called one after
    the other, a tied LM head's fetch of the first module's parameters after them: `zero3.ModuleTrace.from_layout`),
    DeepSpeed's coordinator replayed over it (`zero3.replay`: each fetch gathers what of its module is not resident,
    then prefetches up to a bucket; a release keeps what a prefetch already took for a later use and what is used
    again within stage3_max_reuse_distance). Only a recorded trace has the parameter-free modules' hooks, which
    prefetch too, so only it gives the calls' boundaries exactly; the bytes come out the same where the look-ahead
    is not limited. Without either, parameters are spread evenly: those with more than max_reuse_distance / 2
    parameters after them are gathered again, in prefetch-bucket calls."""
    prefetch = int(cfg.prefetch_bucket_size)
    if trace is None and modules is None:
        reuse = int(cfg.max_reuse_distance)
        window = min(prefetch, int(cfg.max_live_parameters))
        mass = n_params - persistent_params
        regather = 0 if 0 < mass < window else round(mass * max(0, n_params - reuse / 2) / n_params)
        return (_split(gathered_elements([mass], world_size), prefetch),
                _split(gathered_elements([regather], world_size), prefetch) if regather else [],
                [persistent_params] if persistent_params else [])
    if trace is None:
        trace = zero3.ModuleTrace.from_layout(modules or [], tied_head)
    r = zero3.replay(trace, **_zero3_settings(cfg))
    return ([gathered_elements(c, world_size) for c in r.forward_calls],
            [gathered_elements(c, world_size) for c in r.backward_calls],
            [trace.numels[p] for p in sorted(r.persistent)])


def _zero3_settings(cfg: Any) -> dict[str, Any]:
    """A checked stage-3 config's settings back as `zero_optimization` keys (what `zero3.replay` reads)."""
    return {"stage3_max_live_parameters": cfg.max_live_parameters, "stage3_max_reuse_distance": cfg.max_reuse_distance,
            "stage3_prefetch_bucket_size": cfg.prefetch_bucket_size,
            "stage3_param_persistence_threshold": cfg.param_persistence_threshold,
            "stage3_model_persistence_threshold": cfg.model_persistence_threshold}


def _stage3(out: list[Collective], modules: Sequence[Sequence[int]] | None, n_params: int, persistent_params: int,
            world_size: int, precision: str, grad_accum: int, offload: bool, cfg: Any, tied_head: bool,
            trace: zero3.ModuleTrace | None) -> None:
    size = DTYPE_BYTES[precision]
    forward, backward, persistent = _stage3_gathers(modules, n_params, persistent_params, world_size, cfg,
                                                    tied_head, trace)
    # Prefetched gathers run while earlier modules compute; the forward's first one has nothing before it.
    common: dict[str, Any] = {"op": "all_gather", "per": "micro_step", "grad_accum": grad_accum,
                              "dtype": precision, "what": "parameters", "caller": "allgather_fn"}
    prefetching = cfg.prefetch_bucket_size > 0
    gather = "partition_parameters.py:1362"
    for batch, phase, hides, source in (
            (forward[:1], "forward", False, f"partitioned_param_coordinator.py:381/484 -> {gather}"),
            (forward[1:], "forward", prefetching, f"partitioned_param_coordinator.py:484 -> {gather}"),
            (backward, "backward", prefetching, f"partitioned_param_coordinator.py:658 (reuse distance) -> {gather}")):
        _emit(out, (c * size for c in batch), phase=phase, overlappable=hides, **common,
              source=SRC + "runtime/zero/" + source)
    # Gradients: reduce-scattered in buckets of reduce_bucket_size elements in the order they are ready, every
    # micro-step (stage3.py:1583 -> :1931 reduce_scatter_coalesced: each gradient padded to a multiple of N,
    # coalesced_collectives.py:95-128), on a side stream with overlap_comm (on by default at stage 3). Modules in
    # reverse; within an nn.Linear, ZeRO-3's memory-efficient linear (memory_efficient_linear, on by default,
    # partition_parameters.py:419) returns the weight's gradient before the bias's (linear.py:142), torch's own
    # linear the bias's first. Other modules may order theirs otherwise: bucket edges move, bytes do not.
    within = (lambda m: m) if cfg.memory_efficient_linear else (lambda m: m[::-1])
    numels = [n for m in modules[::-1] for n in within(list(m))] if modules is not None else [n_params]
    if modules is not None and trace is not None and trace.ungraded:
        # a parameter the backward gives no gradient (its output unused) fires no reduce hook: nothing sent for it
        ids = iter(range(sum(map(len, modules))))
        numbered = [[(next(ids), n) for n in m] for m in modules]
        numels = [n for m in numbered[::-1] for p, n in within(m) if p not in trace.ungraded]
    bucket = int(cfg.reduce_bucket_size)
    calls: list[int] = []
    current: list[int] = []
    elements = 0
    for n in numels:
        if elements + n > bucket and elements > 0:
            calls.append(gathered_elements(current, world_size))
            current, elements = [], 0
        current.append(n)
        elements += n
    if modules is None:  # one tensor: a call per bucket
        calls = _split(gathered_elements(numels, world_size), bucket)
    elif current:
        calls.append(gathered_elements(current, world_size))
    # The last bucket is reduced when the backward has ended (engine.py:3086): it cannot hide.
    for part, hides in ((calls[:-1], bool(cfg.overlap_comm)), (calls[-1:], False)):
        _emit(out, (c * size for c in part), op="reduce_scatter", per="micro_step", grad_accum=grad_accum,
              phase="backward", dtype=precision, overlappable=hides, what="gradients",
              caller="reduce_scatter_fn", source=SRC + "runtime/zero/stage3.py:1583 -> :1931")
    if precision == "fp16":
        _emit(out, [1], op="all_reduce", per="step", grad_accum=grad_accum, phase="optimizer", dtype="uint8",
              overlappable=False, what="overflow check", caller="has_overflow",
              source=SRC + "runtime/zero/stage3.py:2815 -> :3027")
    # The gradient norm: fp64 where the device has it (zero/utils.py:59), fp32 with the optimizer offloaded.
    caller, line, dtype = (("complete_grad_norm_calculation_for_cpu_offload", 1991, "fp32") if offload
                           else ("get_grad_norm_direct", 2469, "fp64"))
    _emit(out, [DTYPE_BYTES[dtype]], op="all_reduce", per="step", grad_accum=grad_accum, phase="optimizer",
          dtype=dtype, overlappable=False, what="gradient norm", caller=caller,
          source=SRC + f"runtime/zero/stage3.py:{line}")
    # After the step the persistent parameters are gathered again from their updated shards, one call each
    # (stage3.py:2841 -> partition_parameters.py:2073).
    _emit(out, (gathered_elements([n], world_size) * size for n in persistent), op="all_gather", per="step",
          grad_accum=grad_accum, phase="optimizer", dtype=precision, overlappable=False,
          what="persistent parameters", caller="_allgather_params_coalesced",
          source=SRC + "runtime/zero/stage3.py:2841 -> partition_parameters.py:2073")


def _split(total: int, bucket: int) -> list[int]:
    if total <= 0:
        return []
    if bucket <= 0:
        return [total]
    calls = [bucket] * (total // bucket)
    return calls + ([total % bucket] if total % bucket else [])


# -- what a run sent (DeepSpeed's comms logger, labkit.rank.comms_log) ----------------------------
def measured_collectives(run_dir: str | os.PathLike) -> pd.DataFrame:
    """Every (rank, section, operation, caller, message size) DeepSpeed's comms logger counted in a run
    launched with `RunConfig(comms_log=True)`: `count` calls, `msg_bytes` as the logger reports them and
    `bytes` in this module's convention (an all-gather's gathered output: the logged shard x world size).
    Sections: setup, step 1, step 2, steady (`section_steps` steps from step 3 on), between steps."""
    from labkit.rank.comms_log import comms_file

    run_dir = Path(run_dir)
    files = sorted(run_dir.glob("comms_rank*.json"), key=lambda p: int(p.stem.removeprefix("comms_rank")))
    if not files:
        raise FileNotFoundError(f"{run_dir} has no comms_rank<N>.json: launch the run with RunConfig(comms_log=True) "
                                f"(labkit run --comms-log)")
    rows = []
    for path in files:
        data = json.loads(path.read_text())
        world = int(data.get("world_size", 1))
        rank = int(data["rank"])
        if path != comms_file(run_dir, rank):
            raise ValueError(f"{path} holds rank {rank}'s log")
        for record in data["records"]:
            op = _LOGGED_OPS.get(record["op"], record["op"])
            rows.append({"rank": rank, "section": record["section"], "section_steps": record["section_steps"],
                         "op": op, "logged_op": record["op"], "caller": record["caller"],
                         "what": CALLERS.get(record["caller"], record["caller"]), "msg_bytes": record["msg_bytes"],
                         "bytes": record["msg_bytes"] * (world if op == "all_gather" else 1),
                         "count": record["count"], "ms_total": record["ms_total"]})
    columns = ["rank", "section", "section_steps", "op", "logged_op", "caller", "what", "msg_bytes", "bytes", "count",
               "ms_total"]
    return pd.DataFrame(rows, columns=columns)


def steady_per_step(measured: pd.DataFrame, rank: int = 0) -> pd.DataFrame:
    """One rank's steady steps (3 on) per optimizer step, by operation, what it moved and message size."""
    steady = measured[(measured["section"] == "steady") & (measured["rank"] == rank)]
    if steady.empty:
        return pd.DataFrame(columns=["op", "what", "bytes", "calls_per_step", "bytes_per_step"])
    steps = int(steady["section_steps"].iloc[0])
    table = steady.groupby(["op", "what", "bytes"], as_index=False)["count"].sum()
    table["calls_per_step"] = table.pop("count") / steps
    table["bytes_per_step"] = table["bytes"] * table["calls_per_step"]
    return table


def run_collectives(config: Any) -> list[Collective]:
    """`collectives` for a labkit run's RunConfig: its stage, ranks, precision, accumulation and the
    ZeRO settings its ds_config carries, with the parameter layout of its model (built on the meta device)."""
    from labkit.models.builders import meta_model

    if config.example == "pytorch":
        return collectives(None, 1, 1, precision=config.precision)
    ds_config = config.ds_config()
    zero = dict(ds_config.get("zero_optimization", {}))
    stage = int(zero.pop("stage", 0))
    offload = zero.pop("offload_optimizer", None)
    offloaded = bool(offload) and offload.get("device", "none") != "none"
    model = meta_model(config)
    modules = module_layout(model)
    check_zero_settings(stage, zero, offloaded)  # refused before the model's trace is recorded
    trace = zero3.record_lab_model(config) if stage == 3 else None
    return collectives(stage, sum(map(sum, modules)), config.world_size, precision=config.precision,
                       grad_accum=config.grad_accum, tied_head=tied_head(model), trace=trace,
                       offload_optimizer=offloaded, modules=modules,
                       gradient_clipping=ds_config.get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT), **zero)


def predicted_table(cs: Iterable[Collective], world_size: int) -> pd.DataFrame:
    """Collectives per optimizer step by operation and what they move: calls, message bytes, and the
    bytes one rank sends with a ring."""
    rows = [{"op": c.op, "what": c.what, "calls_per_step": c.per_step, "bytes_per_step": c.bytes_per_step,
             "sent_per_rank": ring_bytes_sent(c, world_size) * c.per_step} for c in cs]
    table = pd.DataFrame(rows, columns=["op", "what", "calls_per_step", "bytes_per_step", "sent_per_rank"])
    return table.groupby(["op", "what"], as_index=False, sort=False).sum()


def predicted_vs_measured(run_dir: str | os.PathLike, rank: int = 0) -> pd.DataFrame:
    """Per operation and what it moves: the formula's calls and bytes per optimizer step
    (`run_collectives`) beside what DeepSpeed's comms logger counted in the run's steady steps (3 on),
    on `rank`. `ratio` is measured / predicted bytes; `sent_per_rank_*` the ring bytes one rank sends."""
    from labkit.core.config import RunConfig

    run_dir = Path(run_dir)
    config = RunConfig.load(run_dir / "config.json")
    measured = measured_collectives(run_dir)
    if config.example != "pytorch" and config.world_size > 1 and \
            measured[(measured["section"] == "steady") & (measured["rank"] == rank)].empty:
        raise ValueError(f"{run_dir}: rank {rank} logged no steady step (steps 3 on): run at least 3 steps")
    predicted = predicted_table(run_collectives(config), config.world_size)
    steady = steady_per_step(measured, rank).groupby(["op", "what"], as_index=False)[
        ["calls_per_step", "bytes_per_step"]].sum()
    table = predicted.merge(steady, on=["op", "what"], how="outer", suffixes=("_predicted", "_measured"))
    table = table.fillna(0.0)
    table["sent_per_rank_measured"] = [ring_factor(op, config.world_size) * b if op in OPS else 0.0
                                       for op, b in zip(table["op"], table["bytes_per_step_measured"], strict=True)]
    table = table.rename(columns={"sent_per_rank": "sent_per_rank_predicted"})
    table["ratio"] = [m / p if p else math.inf if m else 1.0
                      for m, p in zip(table["bytes_per_step_measured"], table["bytes_per_step_predicted"], strict=True)]
    table.attrs.update(stage=config.stage, world_size=config.world_size, precision=config.precision,
                       grad_accum=config.grad_accum, offload_optimizer=bool(config.offload_optimizer))
    return table


# -- this machine's links: an alpha-beta fit -------------------------------------------------------
BENCH_SIZES = tuple(4**k * 1024 for k in range(8))  # 1 KiB to 16 MiB messages
BENCH_OPS = ("all_reduce", "all_gather", "reduce_scatter")
BENCH_REPS = 5  # timed calls per (op, size), after BENCH_WARMUP untimed ones
BENCH_WARMUP = 2
# "As training meets the link": each rank computes between calls (one thread, no barrier), as a training step does
# between its collectives, so a call's time includes waiting for the peer and waking a rank that blocked. On a CPU
# whose cores are all ranks this is most of a small collective's cost (figures: docs/predict.md, "This machine").
# One setting, where one must do (the answer's report times the link in ~7 s): 2 ms, the order of the ci model's
# compute between collectives. What it measures depends on it (docs/predict.md has the check at 0.25-8 ms), so
# predictions read the link at their own run's compute per collective instead (the grid below).
TRAINING_BUSY_S = 2e-3
TRAINING_REPS = 20  # timed calls per (op, size) when the mean is the statistic (5 are too few for a mean)
# How long a call waits depends on the other rank's compute before it, so the link is also measured at several
# settings and a prediction reads it at its own run's compute per collective (`measure_training_links`,
# `fit_settings`, `read_settings`): 60 calls per size, since 20 leave each setting's fit too noisy to interpolate
# (docs/predict.md).
TRAINING_BUSY_GRID_S = (0.25e-3, 0.5e-3, 1e-3, 2e-3, 3e-3, 4e-3)
TRAINING_GRID_REPS = 60
# How a size's timed calls are summarised before the fit: the fastest call (the link alone), or as the steps of
# a run are (calibrate.STATISTICS): a step's mean is the sum of its parts' means, which no other statistic is.
LINK_STATISTICS = ("fastest", "p10", "median", "mean")


@dataclass(frozen=True, kw_only=True)
class OpFit:
    """t = ring_steps(op, N) x alpha_s + ring bytes sent per rank x beta_s_per_byte (weighted least squares,
    relative errors: a 1 KiB and a 16 MiB message count alike)."""

    op: str
    alpha_s: float            # per ring step (a message's latency)
    beta_s_per_byte: float    # per byte one rank sends
    median_error: float       # |fit / measured - 1|, median over the sizes

    @property
    def bus_gbps(self) -> float:
        """1 / beta in Gbit/s: NCCL-tests' "bus bandwidth" (ring bytes per rank over time), for large messages."""
        return 8 / self.beta_s_per_byte / 1e9 if self.beta_s_per_byte > 0 else math.inf


@dataclass(frozen=True, kw_only=True)
class LinkFit:
    """`measure_links`' result: a fit per operation to each size's calls summarised by `statistic`, and every timing
    (`raw`: one row per timed call, seconds on rank 0 from a barrier, or from the end of `busy_s` of compute, to
    the call's return)."""

    world_size: int
    backend: str
    device: str
    fits: dict[str, OpFit]
    raw: pd.DataFrame
    statistic: str = "fastest"
    busy_s: float = 0.0

    def seconds(self, c: Collective, world_size: int | None = None) -> float:
        """One call of `c` on this link at `world_size` ranks (the measured one by default), ring model."""
        n = world_size or self.world_size
        fit = self.fits.get(c.op) or self.fits["all_reduce"]
        return ring_steps(c.op, n) * fit.alpha_s + ring_bytes_sent(c, n) * fit.beta_s_per_byte

    def step_seconds(self, cs: Iterable[Collective], world_size: int | None = None) -> dict[str, float]:
        """Communication per optimizer step: `total_s`, and the part that can hide behind compute
        (`overlappable_s`) or cannot (`blocking_s`)."""
        parts = {"overlappable_s": 0.0, "blocking_s": 0.0}
        for c in cs:
            parts["overlappable_s" if c.overlappable else "blocking_s"] += self.seconds(c, world_size) * c.per_step
        return {"total_s": parts["overlappable_s"] + parts["blocking_s"], **parts}

    def table(self) -> pd.DataFrame:
        return pd.DataFrame([{"op": f.op, "alpha_us": f.alpha_s * 1e6, "beta_ns_per_byte": f.beta_s_per_byte * 1e9,
                              "bus_gbps": f.bus_gbps, "median_error": f.median_error} for f in self.fits.values()])


def fit_alpha_beta(op: str, world_size: int, sizes: Sequence[float], seconds: Sequence[float]) -> OpFit:
    """The alpha-beta fit of one operation's times (`seconds`, one per size) at message sizes `sizes`."""
    import numpy as np

    steps = ring_steps(op, world_size)
    sent = np.array([ring_factor(op, world_size) * s for s in sizes], dtype=float)
    t = np.array(seconds, dtype=float)
    design = np.column_stack([np.full_like(sent, steps), sent]) / t[:, None]  # rows weighted by 1 / t
    (alpha, beta), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if alpha < 0:  # latency below resolution: bandwidth only
        alpha, beta = 0.0, float(np.sum(sent * t / t**2) / np.sum(sent**2 / t**2))
    elif beta < 0:
        alpha, beta = float(np.sum(t * steps / t**2) / np.sum(steps**2 / t**2)), 0.0
    errors = np.abs((steps * alpha + sent * beta) / t - 1)
    return OpFit(op=op, alpha_s=float(alpha), beta_s_per_byte=float(beta), median_error=float(np.median(errors)))


def summarise(seconds: Sequence[float], statistic: str) -> float:
    """One figure for a size's timed calls (`LINK_STATISTICS`)."""
    import numpy as np

    if statistic not in LINK_STATISTICS:
        raise ValueError(f"statistic must be one of {LINK_STATISTICS}, got {statistic!r}")
    values = np.sort(np.asarray(seconds, dtype=float))
    if statistic == "fastest":
        return float(values[0])
    if statistic == "p10":
        return float(values[int(0.1 * (len(values) - 1))])
    return float(np.median(values) if statistic == "median" else np.mean(values))


def fit_links(raw: pd.DataFrame | Sequence[Mapping[str, Any]], world_size: int, statistic: str) -> dict[str, OpFit]:
    """The alpha-beta fit per operation of `measure_links`' timed calls (`raw`: op, msg_bytes, seconds), each size
    summarised by `statistic`."""
    table = pd.DataFrame(raw)
    summary = table.groupby(["op", "msg_bytes"], as_index=False)["seconds"].agg(lambda s: summarise(s, statistic))
    return {op: fit_alpha_beta(op, world_size, list(group["msg_bytes"]), list(group["seconds"]))
            for op, group in summary.groupby("op", sort=False)}


def fit_settings(raw: pd.DataFrame | Sequence[Mapping[str, Any]], world_size: int,
                 statistic: str) -> dict[float, dict[str, OpFit]]:
    """Timed calls measured at several settings of the compute before each call (`raw` rows carry `busy_s`:
    `measure_training_links`), fitted per setting by `statistic` (`fit_links`)."""
    table = pd.DataFrame(raw)
    return {float(b): fit_links(table[table["busy_s"] == b], world_size, statistic)
            for b in sorted(table["busy_s"].unique())}


def read_settings(fits: Mapping[float, Mapping[str, OpFit]], busy_s: float) -> dict[str, dict[str, float]]:
    """Alpha and beta per operation at `busy_s`, read linearly between the two fitted settings around it
    (`fit_settings`; the nearest end outside them)."""
    import numpy as np

    settings = sorted(fits)
    at = min(max(busy_s, settings[0]), settings[-1])
    return {op: {"alpha_s": float(np.interp(at, settings, [fits[b][op].alpha_s for b in settings])),
                 "beta_s_per_byte": float(np.interp(at, settings, [fits[b][op].beta_s_per_byte for b in settings]))}
            for op in fits[settings[0]]}


def measure_training_links(world_size: int = 2, backend: str | None = None) -> dict[str, Any]:
    """The link as training meets it at every setting of `TRAINING_BUSY_GRID_S` (`TRAINING_GRID_REPS` calls per
    size each; about a minute for 2 ranks on 2 cores): JSON with every timed call and its setting (`raw`), which
    `fit_settings` fits and `read_settings` reads at a run's own compute per collective."""
    rows: list[dict[str, Any]] = []
    link = None
    for busy in TRAINING_BUSY_GRID_S:
        link = measure_links(world_size=world_size, backend=backend, busy_s=busy, reps=TRAINING_GRID_REPS,
                             statistic="mean")
        rows += [{"busy_s": busy, "op": r["op"], "msg_bytes": int(r["msg_bytes"]), "rep": int(r["rep"]),
                  "seconds": float(r["seconds"])} for r in link.raw.to_dict(orient="records")]
    assert link is not None
    return {"world_size": world_size, "backend": link.backend, "device": link.device, "statistic": "mean",
            "busy_s": list(TRAINING_BUSY_GRID_S), "raw": rows}


def _busy(seconds: float) -> None:
    """Compute on this thread for `seconds` (small matrix products), as a training step does between collectives."""
    import torch

    a = torch.ones(64, 64)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ a


def _bench_rank(rank: int, world_size: int, port: int, backend: str, sizes: Sequence[int], ops: Sequence[str],
                out: str, busy_s: float = 0.0, reps: int = BENCH_REPS) -> None:
    """One rank of `measure_links` (a process of its own: never the notebook's kernel)."""
    import warnings
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13 renames *_into_tensor; same call
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=120))
    sync = torch.cuda.synchronize if backend == "nccl" else (lambda: None)
    rows = []
    try:
        for op in ops:
            for size in sizes:
                elements = max(world_size, size // 4 // world_size * world_size)  # fp32, divisible by N
                full = torch.ones(elements, device=device)
                part = torch.empty(elements // world_size, device=device)

                for rep in range(BENCH_WARMUP + reps):
                    if busy_s > 0:
                        _busy(busy_s)
                    else:
                        dist.barrier()
                    sync()
                    start = time.perf_counter()
                    _bench_call(dist, op, full, part)
                    sync()
                    if rep >= BENCH_WARMUP:
                        rows.append({"op": op, "msg_bytes": elements * 4, "rep": rep - BENCH_WARMUP,
                                     "seconds": time.perf_counter() - start})
    finally:
        dist.destroy_process_group()
    if rank == 0:
        name = torch.cuda.get_device_name(rank) if backend == "nccl" else f"CPU ({os.cpu_count()} cores)"
        Path(out).write_text(json.dumps({"device": name, "rows": rows}))


def _bench_call(dist: Any, op: str, full: Any, part: Any) -> None:
    if op == "all_reduce":
        dist.all_reduce(full)
    elif op == "all_gather":
        dist.all_gather_into_tensor(full, part)
    else:
        dist.reduce_scatter_tensor(part, full)


def measure_links(world_size: int = 2, sizes: Sequence[int] = BENCH_SIZES, ops: Sequence[str] = BENCH_OPS,
                  backend: str | None = None, timeout_s: float = 300.0, *, busy_s: float = 0.0,
                  reps: int = BENCH_REPS, statistic: str = "fastest") -> LinkFit:
    """Time all-reduce, all-gather and reduce-scatter between `world_size` real processes on this machine
    (torch.distributed: gloo on CPU, NCCL on GPUs, one GPU per rank; loopback only) and fit the alpha-beta
    model per operation. The ranks are processes of their own (`python -c`), never the calling one, and
    nothing of the caller is re-imported in them: safe from a notebook or a script. About 15-30 s on a
    2-core CPU with the default sizes (1 KiB to 16 MiB, in the message convention of `Collective`).

    By default each call follows a barrier and the fit takes each size's fastest call: the link alone. With
    `busy_s` each rank computes that long before each call instead, and `statistic="mean"` fits the mean call:
    the link as training meets it, at one setting (`TRAINING_BUSY_S`, `TRAINING_REPS`: the answer's report check);
    `measure_training_links` measures it at several (what `labkit predict --from` uses)."""
    import contextlib
    import subprocess
    import sys
    import tempfile

    from labkit.launch.launcher import free_port
    from labkit.runtime.devices import detect_devices

    whole_number("world_size", world_size, minimum=2)  # a link needs two ends
    bad = [op for op in ops if op not in BENCH_OPS]
    if bad or not ops:
        raise ValueError(f"ops must be among {BENCH_OPS}, got {list(ops)}")
    if not sizes or any(not isinstance(s, int) or s < 4 * world_size for s in sizes):
        raise ValueError(f"sizes must be message bytes >= 4 x world_size, got {list(sizes)}")
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
    if statistic not in LINK_STATISTICS:
        raise ValueError(f"statistic must be one of {LINK_STATISTICS}, got {statistic!r}")
    whole_number("reps", reps)
    if not isinstance(busy_s, (int, float)) or isinstance(busy_s, bool) or not 0 <= busy_s <= 1:
        raise ValueError(f"busy_s must be seconds between 0 and 1, got {busy_s!r}")
    devices = detect_devices()  # asked in a child process: this one holds no GPU context
    gpus = devices.device_count if devices.accelerator == "cuda" else 0
    backend = backend or ("nccl" if gpus >= world_size else "gloo")
    if backend == "nccl" and gpus < world_size:
        raise ValueError(f"nccl needs one GPU per rank: {world_size} ranks, {gpus} GPUs")
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
           # This checkout's labkit, installed or not.
           "PYTHONPATH": os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[2]),
                                                     os.environ.get("PYTHONPATH", "")) if p)}
    code = "import json, sys; from labkit.study.comms import _bench_rank; _bench_rank(**json.loads(sys.argv[1]))"
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as logs:
        out = str(Path(tmp) / "timings.json")
        procs = []
        try:
            for rank in range(world_size):
                args = {"rank": rank, "world_size": world_size, "port": port, "backend": backend,
                        "sizes": list(sizes), "ops": list(ops), "out": out, "busy_s": float(busy_s), "reps": reps}
                log = logs.enter_context(open(Path(tmp) / f"rank{rank}.log", "wb"))
                procs.append(subprocess.Popen([sys.executable, "-c", code, json.dumps(args)], env=env,
                                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log))
            deadline = time.monotonic() + timeout_s
            while any(p.poll() is None for p in procs):
                failed = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        finally:
            for p in procs:  # only the ranks started here
                if p.poll() is None:
                    p.kill()
                p.wait()
        failed = [r for r, p in enumerate(procs) if p.returncode != 0]
        if failed:
            tail = (Path(tmp) / f"rank{failed[0]}.log").read_text(errors="replace")[-2000:]
            late = f" (timed out after {timeout_s:.0f} s)" if time.monotonic() > deadline else ""
            raise RuntimeError(f"measure_links: rank {failed[0]} failed{late}:\n{tail}")
        result = json.loads(Path(out).read_text())
    raw = pd.DataFrame(result["rows"])
    raw["sent_per_rank"] = [ring_factor(op, world_size) * b for op, b in zip(raw["op"], raw["msg_bytes"], strict=True)]
    return LinkFit(world_size=world_size, backend=backend, device=result["device"],
                   fits=fit_links(raw, world_size, statistic), raw=raw, statistic=statistic, busy_s=float(busy_s))


def compare_runs(runs: Mapping[str, Any], rank: int = 0) -> pd.DataFrame:
    """`predicted_vs_measured` for several runs (labkit `Run`s launched with comms_log=True), one block
    per run label, bytes in MiB."""
    tables = []
    for label, run in runs.items():
        table = predicted_vs_measured(run.run_dir, rank=rank)
        table.insert(0, "run", label)
        tables.append(table)
    table = pd.concat(tables, ignore_index=True)
    for column in [c for c in table.columns if c.startswith(("bytes_per_step", "sent_per_rank"))]:
        table[column.replace("bytes", "MiB").replace("sent_per_rank", "sent_MiB_per_rank")] = table.pop(column) / 2**20
    return table

"""Analytic memory model of ZeRO model states, checked against real DeepSpeed 0.19.8.

ZeRO paper (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", Sec. 3 and 5) for Psi parameters, N data-parallel ranks
and mixed-precision Adam:

* params 2*Psi (fp16/bf16), grads 2*Psi, optimizer states K*Psi with K = 12
  (fp32 master 4 + momentum 4 + variance 4), total (2 + 2 + K)*Psi per rank.
* P_os   (stage 1): 2*Psi + 2*Psi + K*Psi/N
* P_os+g (stage 2): 2*Psi + (2 + K)*Psi/N
* P_os+g+p (stage 3): (2 + 2 + K)*Psi/N

What DeepSpeed 0.19.8 really holds (measured by ``labkit.rank.census`` right after
backward at an accumulation boundary, before ``step``) differs in places:

* fp32 training (no bf16/fp16): stage 0 keeps no master copy (K = 8: Adam moments
  only), but stages >= 1 clone the fp32 partition into ``single_partition_of_fp32_groups``
  / ``fp32_partitioned_groups_flat``, so K = 12 again, divided by N.
* Stage 1 grads are partitioned at that moment just like stage 2: at the end of
  backward DeepSpeed copies the grads of the params in its partition into
  ``grads_in_partition`` and frees the rest.  The *whole* grad of every param that
  overlaps the partition is kept, so with a few big layers a rank can hold far more
  than Psi/N (we model the ideal Psi/N; :func:`zero12_grad_elements` gives the
  real per-rank figure from the param sizes).  During backward a contiguous reduce bucket of
  ``reduce_bucket_size`` elements (default 5e8) holds all grads while Psi fits in it,
  so the transient peak is full-size grads at both stages 1 and 2.
* Optimizer offload (stages 1-3): moments + master go to the host, and so does the
  fp32 grad partition (4*Psi/N).  Stages 1/2 then keep no grads on the device at
  the boundary.  Stage 3 keeps a grad partition in the gradient-accumulation dtype
  (the params' dtype here) too, and it is on the host as well: ``stage3.py`` sets
  ``self.device`` to "cpu" under optimizer offload and allocates
  ``grad_partitions_flat_buffer`` there.  So with offload only the params stay on
  the device, at every stage.  (With gradient accumulation > 1, stages 1/2 also keep
  the whole grads of the partition's params on the host, ``accumulated_grads_in_cpu``:
  not modelled.)
* Stage 3 keeps "persistent" params (numel <= ``param_persistence_threshold``,
  default 1e5) whole on every rank, on top of its Psi/N partition (when N > 1):
  pass their count as ``persistent_params`` (see :func:`mlp_persistent_params`).
* torch's SGD without momentum (labkit's ``optimizer="sgd"``) keeps no optimizer state: K = 4 (the master), 0 at
  stage 0 in fp32 (``model_state_bytes(optimizer="sgd")``; measured, tests/study/test_sweep.py).
* Partitions are padded to a multiple of 2*N elements at stages 1/2 (negligible).
* :func:`accountings` puts the paper's figures and these side by side, with the reduce bucket's bytes.
* Not model states, so not modelled by :func:`model_state_bytes`: the stage-3 reduce bucket
  (``reduce_bucket_size`` elements, 2 GB fp32 by default, kept between steps),
  offload staging buffers, and what ``step`` builds for itself: :func:`optimizer_step_bytes` has that.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:  # torch only where a module is counted: `labkit predict` checks its flags before torch loads
    from torch import nn

PRECISIONS = ("fp32", "bf16", "fp16", "mixed")
ACCOUNTINGS = ("deepspeed", "paper")
# Optimizer moments per parameter, fp32, by RunConfig.optimizer: Adam's exp_avg and exp_avg_sq; torch's SGD without
# momentum (what labkit's runs build) keeps no state. Measured by labkit.rank.census on real runs (stages 0-3, fp32
# and bf16, offload, the plain loop): SGD's optimizer.state is empty, its fp32 master copy the same as Adam's.
MOMENT_BYTES_PER_PARAM = {"adam": 8, "sgd": 0}


def model_state_bytes(n_params: int, stage: int, world_size: int, precision: str = "mixed",
                      offload_optimizer: bool = False, *, persistent_params: int = 0,
                      accounting: str = "deepspeed", optimizer: str = "adam") -> dict[str, int]:
    """Predicted model-state bytes of ONE rank.

    ``accounting="deepspeed"`` (default): what DeepSpeed 0.19.8 holds right after backward at an
    accumulation boundary (module doc).  ``accounting="paper"``: the ZeRO paper's Figure 1, mixed-precision
    Adam only (2 + 2 + K)*Psi, K = 12, no offload, no persistent params: stage 1 keeps the full 2*Psi grads.

    Returns ``param_bytes``, ``grad_bytes`` (device + host), ``optim_bytes``
    (moments + fp32 master, the paper's K*Psi/N), ``device_bytes`` (what stays on
    the accelerator), ``host_bytes`` (what optimizer offload put on the CPU) and
    ``host_grad_bytes`` (the grads among them, like the census key of
    ``labkit.rank.census``).  ``persistent_params``: params stage 3 keeps unpartitioned (see module doc).
    ``optimizer``: ``adam`` (K = 12: fp32 master + two moments) or ``sgd`` (no momentum: K = 4, the master alone,
    :data:`MOMENT_BYTES_PER_PARAM`); the master is there except at stage 0 in fp32, as with Adam.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0..3, got {stage}")
    if world_size < 1 or n_params < 0:
        raise ValueError("world_size must be >= 1 and n_params >= 0")
    if not 0 <= persistent_params <= n_params:  # a subset of the params; a negative count shrank the prediction
        raise ValueError(f"persistent_params must be between 0 and n_params ({n_params:,}), got {persistent_params}")
    if offload_optimizer and stage == 0:
        raise ValueError("DeepSpeed offloads the optimizer only with ZeRO stage >= 1")
    if accounting not in ACCOUNTINGS:
        raise ValueError(f"accounting must be one of {ACCOUNTINGS}, got {accounting!r}")
    if optimizer not in MOMENT_BYTES_PER_PARAM:
        raise ValueError(f"optimizer must be one of {tuple(MOMENT_BYTES_PER_PARAM)}, got {optimizer!r}")
    if accounting == "paper":
        if precision == "fp32" or offload_optimizer or persistent_params or optimizer != "adam":
            raise ValueError("accounting='paper' is the ZeRO paper's mixed-precision Adam without offload or "
                             "persistent params; use accounting='deepspeed' for fp32, offload, persistent_params "
                             "or SGD")
        return _paper_state_bytes(n_params, stage, world_size)

    psi, n = n_params, world_size
    lp = 4 if precision == "fp32" else 2  # bytes per param / grad element on the device
    # fp32 at stage 0 updates the model params in place: no master copy (Adam's K = 8).
    k = MOMENT_BYTES_PER_PARAM[optimizer] + (0 if precision == "fp32" and stage == 0 else 4)

    # Stage 3: own partition, plus whole copies of the persistent params (N > 1 only;
    # with one rank the partition is the whole param and p.data shares it).
    params = lp * (psi / n + (persistent_params if n > 1 else 0)) if stage >= 3 else lp * psi
    optim = k * psi / n if stage >= 1 else k * psi
    if not offload_optimizer:
        device_grads = lp * psi / n if stage >= 1 else lp * psi
        host_grads = 0.0
    else:
        # The grad partitions live next to the offloaded optimizer: the fp32 one, and at
        # stage 3 the low-precision one too (grad_partitions_flat_buffer on self.device = cpu).
        host_grads = 4 * psi / n + (lp * psi / n if stage >= 3 else 0.0)
        device_grads = 0.0

    host = optim + host_grads if offload_optimizer else 0.0
    device = params + device_grads + (0.0 if offload_optimizer else optim)
    return {
        "param_bytes": round(params),
        "grad_bytes": round(device_grads + host_grads),
        "optim_bytes": round(optim),
        "device_bytes": round(device),
        "host_bytes": round(host),
        "host_grad_bytes": round(host_grads),
    }


DEFAULT_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeedZeroConfig.sub_group_size (0.19.8)
NORM_BYTES = 8  # the gradient norm reads each gradient as fp64 (zero/utils.py get_norm_dtype: fp64 where supported)


# torch.optim.Adam's default step on a GPU (foreach; fused is off by default: torch/optim/adam.py:937-947, torch
# 2.13) makes sqrt(exp_avg_sq) for every parameter at once, one fp32 list (`exp_avg_sq_sqrt =
# torch._foreach_sqrt(device_exp_avg_sqs)`, adam.py:790), freed after the update: 4 B per fp32 parameter. (Adam's L2
# weight_decay copies the gradients first, adam.py:696-698, and frees the copy, :726, before that list is made.)
PLAIN_ADAM_STEP_BYTES_PER_PARAM = 4
# What DeepSpeed's basic optimizer is (labkit.runtime.ops.OPTIMIZER_IMPLS less CPU Adam, which steps on the host)
STEP_OPTIMIZERS = ("fused_adam", "torch_adam", "torch_sgd")


def optimizer_step_bytes(stage: int, param_numels: Sequence[int], world_size: int, precision: str = "mixed",
                         offload_optimizer: bool = False, sub_group_size: int = DEFAULT_SUB_GROUP_SIZE,
                         optimizer: str = "fused_adam") -> int:
    """Device bytes DeepSpeed 0.19.8's ``step`` allocates for itself at its peak, beyond the model states, on one
    rank without offload (the activations are gone by then; 0 with offload, whose step runs on the host).
    Measured on the real step (``labkit.study.optimizer_bytes --peak``, tests/study/test_step_memory.py: 1 and 2
    CPU ranks, to the byte but for a few scalars). ``param_numels``: every parameter's elements in
    ``model.parameters()`` order, as one optimizer parameter group (DeepSpeed partitions and groups each group
    apart, one after the other: with a weight-decay group and a no-decay one of biases and norms, as the Hugging Face
    Trainer and Megatron-LM make, the largest is nearly all and this is within 0.03% for GPT shapes).
    ``sub_group_size`` 0 makes each parameter its own sub-group, as DeepSpeed's loop does.

    * Stages 1-2 turn the rank's gradient partition into fp32 at once: ``flatten`` copies it (16-bit), ``.to``
      converts it (stage_1_and_2.py:3113-3118): (2 + 4) B per partition element, 4 B in fp32 training (the copy;
      ``.to`` of an fp32 tensor is itself).
    * Stage 3 does the same one sub-group at a time (``_prepare_fp32_grad_for_sub_group``, stage3.py:2686-2687, in
      ``step``'s loop over ``fp16_groups``, each freed by ``_release_sub_group``): a sub-group collects parameters in
      order until it holds ``sub_group_size`` partition elements or more (``_create_fp16_sub_groups``,
      stage3.py:1210-1233), and one of a single parameter is a view, not a copy. So ``sub_group_size`` (default
      1e9 elements: ~6 GB in bf16) bounds this peak, as DeepSpeed's docs advise for an OOM in the step.
    * Before either, the gradient norm reads each gradient piece as fp64, one at a time (:data:`NORM_BYTES`;
      ``get_grad_norm_direct``, stage3.py:2457, stage_1_and_2.py:2684).
    * Stage 0 in 16 bits (FP16_Optimizer, for fp16 and bf16 alike) makes every gradient fp32 in a list and flattens
      the list (fp16/fused_optimizer.py:284-289): (4 + 4) B per parameter, 4 where the model has one tensor (a
      view). Stage 0 in fp32 steps the basic optimizer on the gradients as they are: nothing.
    * ``optimizer``: the basic optimizer, FusedAdam above. ``torch_adam`` (torch's Adam, DeepSpeed's
      ``"torch_adam": true``: labkit's choice on a GPU without nvcc, labkit.runtime.ops) makes sqrt(exp_avg_sq) of
      what it steps on in its update, as torch's foreach default on a GPU does (PLAIN_ADAM_STEP_BYTES_PER_PARAM),
      while the fp32 gradients it steps with are held: at stages 1-3 (4 + 4) B per element of the partition or
      sub-group (4 where a single fp32 parameter's gradient is a view), where that is more than the copies above.
      ``torch_sgd`` (no momentum) updates in place. At stage 0 in 16 bits an optimizer other than FusedAdam runs
      under FP16_UnfusedOptimizer (engine.py's `_configure_fp16_optimizer`), which makes every gradient fp32 and
      flattens nothing: 4 B per parameter, 8 with torch's Adam's list; in fp32, torch's Adam's list, 4 B.
      Measured at 1 and 2 ranks, foreach as on a GPU (``--peak ... --optimizer NAME``)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0..3, got {stage}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if world_size < 1 or sub_group_size < 0 or not param_numels:
        raise ValueError("world_size must be >= 1, sub_group_size >= 0 (DeepSpeed's), and param_numels not empty")
    if optimizer not in STEP_OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {STEP_OPTIMIZERS}, got {optimizer!r}")
    if offload_optimizer:
        return 0
    low = 4 if precision == "fp32" else 2  # the gradients' dtype
    to_fp32 = 0 if low == 4 else 4
    torch_adam = optimizer == "torch_adam"
    sqrt = PLAIN_ADAM_STEP_BYTES_PER_PARAM if torch_adam else 0  # torch's Adam: sqrt(exp_avg_sq), fp32
    if stage == 0:
        if optimizer != "fused_adam":  # FP16_UnfusedOptimizer in 16 bits: fp32 gradients, no flattened list
            return (to_fp32 + sqrt) * sum(param_numels)
        return 0 if low == 4 else (to_fp32 + (4 if len(param_numels) > 1 else 0)) * sum(param_numels)
    if stage in (1, 2):
        partition = math.ceil(sum(param_numels) / world_size)
        update = (4 + sqrt) * partition if torch_adam else 0
        return max((low + to_fp32) * partition, update, NORM_BYTES * min(max(param_numels), partition))
    parts = [math.ceil(n / world_size) for n in param_numels]  # partition_numel() of each parameter
    largest, group, count = 0, 0, 0
    for i, part in enumerate(parts):
        group, count = group + part, count + 1
        if group >= sub_group_size or i == len(parts) - 1:
            largest = max(largest, ((low if count > 1 else 0) + to_fp32) * group)
            if torch_adam:  # the group's fp32 gradients (a view for one fp32 parameter) and the sqrt list
                largest = max(largest, ((4 if count > 1 or low == 2 else 0) + sqrt) * group)
            group, count = 0, 0
    return max(largest, NORM_BYTES * max(parts))


def plain_adam_step_bytes(n_params: int) -> int:
    """Device bytes torch.optim.Adam's default step (foreach) allocates for itself at its peak beyond the model
    states, for `n_params` fp32 parameters on one device: PLAIN_ADAM_STEP_BYTES_PER_PARAM each. Measured on the real
    step (``python -m labkit.study.optimizer_bytes --peak torch fp32 0``; tests/study/test_step_memory.py)."""
    if n_params < 1:
        raise ValueError(f"n_params must be >= 1, got {n_params}")
    return PLAIN_ADAM_STEP_BYTES_PER_PARAM * n_params


def _paper_state_bytes(psi: int, stage: int, n: int) -> dict[str, int]:
    """Figure 1 of the ZeRO paper: 2*Psi fp16 params, 2*Psi fp16 grads, K*Psi = 12*Psi optimizer states."""
    params = 2 * psi / n if stage >= 3 else 2 * psi
    grads = 2 * psi / n if stage >= 2 else 2 * psi  # P_os (stage 1) keeps every grad whole
    optim = 12 * psi / n if stage >= 1 else 12 * psi
    return {"param_bytes": round(params), "grad_bytes": round(grads), "optim_bytes": round(optim),
            "device_bytes": round(params + grads + optim), "host_bytes": 0, "host_grad_bytes": 0}


# Where and why DeepSpeed 0.19.8 differs from the paper, per stage (read in deepspeed/runtime/engine.py,
# zero/stage_1_and_2.py, zero/stage3.py, utils.py; see accountings()).
_DIFFERENCES = {
    0: "same states (no ZeRO optimizer: the engine all-reduces the grads in chunks of 5e8 elements; "
       "in fp32 there is no master copy, K = 8)",
    1: "grads: the paper's P_os keeps full 2*Psi grads; DeepSpeed 0.19.8 stage 1 also keeps every full-size grad "
       "through all micro-steps and the boundary backward (engine.allreduce_gradients reduces at stage 1 only at "
       "the accumulation boundary), but at the end of that backward (independent_gradient_partition_epilogue) it "
       "copies its partition's grads into grads_in_partition and sets p.grad = None, so right after backward it "
       "holds Psi/N like stage 2 (the whole grad of each param overlapping its partition). With bf16 and "
       "grad_accum_dtype fp32, stage 1 runs BF16_Optimizer instead, which keeps full fp32 grads (4*Psi). "
       "Plus the reduce bucket during backward",
    2: "same states after backward; plus the reduce bucket during backward (freed at the end of backward)",
    3: "same states, plus params of <= param_persistence_threshold elements kept whole on every rank, plus the "
       "reduce bucket, allocated once at init and kept between steps",
}


def reduce_bucket_bytes(stage: int, precision: str = "mixed", reduce_bucket_size: int = 500_000_000,
                        overlap_comm: bool = False) -> int:
    """Bytes of DeepSpeed 0.19.8's contiguous reduce bucket (``contiguous_gradients``, the default) on one rank.

    Stages 1/2: ``setup_buckets`` allocates ``torch.empty(reduce_bucket_size)`` in the grads' dtype at each
    backward, a second one with ``overlap_comm`` (stage_1_and_2.py:3266-3278; off by default at stages 1-2), and
    frees them in the epilogue.
    Stage 3: allocated once in ``__init__`` and kept.  Stage 0 has no ZeRO bucket (0).  It does not shrink with
    the model: 5e8 elements are 1 GB in bf16/fp16, 2 GB in fp32, whatever Psi is.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0..3, got {stage}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    buffers = 2 if overlap_comm and stage in (1, 2) else 1
    return 0 if stage == 0 else buffers * int(reduce_bucket_size) * (4 if precision == "fp32" else 2)


def accountings(n_params: int, world_size: int, precision: str = "mixed", *,
                reduce_bucket_size: int = 500_000_000, allgather_bucket_size: int = 500_000_000) -> Any:
    """Both accountings side by side, one row per ZeRO stage (a pandas DataFrame).

    Columns: ``stage``, ``paper_grad_bytes``, ``paper_device_bytes`` (Figure 1 of the paper),
    ``deepspeed_grad_bytes``, ``deepspeed_device_bytes`` (:func:`model_state_bytes`' default),
    ``reduce_bucket_bytes`` (:func:`reduce_bucket_bytes`, shown, not folded in), ``allgather_bucket_bytes``
    (0: at stages 1/2 ``all_gather_dp_groups`` gathers the updated params in shards of
    ``allgather_bucket_size`` elements that are views of the fp16 params, or in one
    ``all_gather_into_tensor`` where the backend has it, so no buffer is allocated) and
    ``where_deepspeed_differs``.  The paper column needs mixed precision; for fp32 it is left empty (NaN).
    """
    import pandas as pd

    if allgather_bucket_size < 0:
        raise ValueError("allgather_bucket_size must be >= 0")
    rows = []
    for stage in range(4):
        ds = model_state_bytes(n_params, stage, world_size, precision)
        paper = None if precision == "fp32" else model_state_bytes(n_params, stage, world_size, accounting="paper")
        rows.append({
            "stage": stage,
            "paper_grad_bytes": math.nan if paper is None else paper["grad_bytes"],
            "paper_device_bytes": math.nan if paper is None else paper["device_bytes"],
            "deepspeed_grad_bytes": ds["grad_bytes"],
            "deepspeed_device_bytes": ds["device_bytes"],
            "reduce_bucket_bytes": reduce_bucket_bytes(stage, precision, reduce_bucket_size),
            "allgather_bucket_bytes": 0,
            "where_deepspeed_differs": _DIFFERENCES[stage],
        })
    return pd.DataFrame(rows)


def n_params_mlp(input_size: int, hidden: int, depth: int, output_size: int) -> int:
    """Parameters of labkit's MLP: Linear(input, hidden), (depth-1) x Linear(hidden, hidden),
    Linear(hidden, output), all with bias."""
    if depth < 1:
        raise ValueError("depth (number of hidden layers) must be >= 1")
    return ((input_size + 1) * hidden + (depth - 1) * (hidden + 1) * hidden + (hidden + 1) * output_size)


def mlp_persistent_params(input_size: int, hidden: int, depth: int, output_size: int,
                          threshold: int = 100_000) -> int:
    """Params of labkit's MLP that ZeRO-3 keeps whole on every rank: each tensor with at
    most ``threshold`` elements (DeepSpeed's ``param_persistence_threshold``; its
    ``mark_persistent_parameters`` compares with ``<=``)."""
    shapes = [(input_size, hidden)] + [(hidden, hidden)] * (depth - 1) + [(hidden, output_size)]
    sizes = [n for fan_in, fan_out in shapes for n in (fan_in * fan_out, fan_out)]
    return sum(s for s in sizes if s <= threshold)


def zero12_grad_elements(param_numels: Sequence[int], world_size: int) -> list[int]:
    """Grad elements each rank keeps after backward at ZeRO stage 1/2 (no offload).

    DeepSpeed flattens the params in ``model.parameters()`` order, pads the flat
    buffer to a multiple of 2*N and gives rank r the slice [r*P, (r+1)*P).  At the
    end of backward it keeps the *whole* grad of every param that overlaps the slice
    (``grads_in_partition``), so the real figure is between Psi/N and Psi.  Per-param
    alignment padding (a few elements) is ignored.  Multiply by the grad element size.
    """
    total = sum(param_numels)
    part = math.ceil(total / (2 * world_size)) * 2
    held = []
    for rank in range(world_size):
        lo, hi, offset, kept = rank * part, (rank + 1) * part, 0, 0
        for numel in param_numels:
            if offset < hi and offset + numel > lo:
                kept += numel
            offset += numel
        held.append(kept)
    return held


def _counts(model_or_n_params: nn.Module | int, largest_layer_params: int | None) -> tuple[int, int]:
    if hasattr(model_or_n_params, "parameters"):  # a torch module (torch is not imported here)
        module = cast("nn.Module", model_or_n_params)
        # Same counting as DeepSpeed's model_to_params: shared params once, largest module.
        # parameters() yields a shared parameter once; by identity, so meta-device models count too.
        total = sum(p.numel() for p in module.parameters())
        largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules()), default=0)
        return total, largest if largest_layer_params is None else largest_layer_params
    total = int(model_or_n_params)
    return total, total if largest_layer_params is None else largest_layer_params


def deepspeed_estimates(model_or_n_params: nn.Module | int, world_size: int, *,
                        largest_layer_params: int | None = None, num_nodes: int = 1,
                        zero_init: bool = False,
                        additional_buffer_factor: float = 1.5) -> dict[str, dict[str, int]]:
    """DeepSpeed's own estimates (``estimate_zero2_model_states_mem_needs`` and
    ``estimate_zero3_model_states_mem_needs``, the count-based variants: no GPU needed).

    Returns ``{option: {"device_bytes", "host_bytes"}}`` for options ``zero2``,
    ``zero2_offload``, ``zero3``, ``zero3_offload`` (optimizer only) and
    ``zero3_offload_all`` (optimizer + params).  ``world_size`` ranks per node.
    Differences with :func:`model_state_bytes`: DeepSpeed assumes mixed precision and
    counts 18*Psi/N (adds the 4*Psi/N fp32 grad partition built in ``step``), stage 3
    adds 4 x the largest layer (gathered params + grads), and its "host" is the RAM
    needed to build/load the model (x ``additional_buffer_factor``), not model states.
    Without a module, ``largest_layer_params`` defaults to ``n_params`` (worst case).
    """
    from labkit.runtime.ds_import import import_deepspeed

    import_deepspeed()  # not from several threads at once: DeepSpeed's circular imports deadlock
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    total, largest = _counts(model_or_n_params, largest_layer_params)
    common: dict[str, Any] = dict(total_params=total, num_gpus_per_node=world_size, num_nodes=num_nodes,
                                  additional_buffer_factor=additional_buffer_factor)
    out: dict[str, dict[str, int]] = {}
    for name, offload in (("zero2", False), ("zero2_offload", True)):
        cpu, gpu = estimate_zero2_model_states_mem_needs(cpu_offload=offload, **common)
        out[name] = {"device_bytes": int(gpu), "host_bytes": int(cpu)}
    for name, offload, offload_params in (("zero3", False, False), ("zero3_offload", True, False),
                                          ("zero3_offload_all", True, True)):
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(largest_layer_params=largest, cpu_offload=offload,
                                                            cpu_offload_params=offload_params,
                                                            zero_init=zero_init, **common)
        out[name] = {"device_bytes": int(gpu), "host_bytes": int(cpu)}
    return out


def compare(measured: Mapping[str, float], predicted: Mapping[str, float]) -> dict[str, float]:
    """Signed relative error (measured - predicted) / predicted for each shared key.

    A census from ``labkit.rank.census`` reports the fp32 master separately: when
    ``measured`` has ``master_bytes`` and ``predicted`` does not, it is folded into
    ``optim_bytes`` first (the paper's K*Psi counts master + moments).  A zero
    prediction gives 0.0 if the measurement is zero too, else inf.
    """
    m = dict(measured)
    if "master_bytes" in m and "master_bytes" not in predicted and "optim_bytes" in m:
        m["optim_bytes"] = m["optim_bytes"] + m.pop("master_bytes")
    errors: dict[str, float] = {}
    for key in predicted:
        if key not in m:
            continue
        p, v = float(predicted[key]), float(m[key])
        errors[key] = (0.0 if v == 0 else math.inf) if p == 0 else (v - p) / p
    return errors


def activation_bytes_per_sample(measured_activation_bytes: int, micro_batch: int) -> float:
    """Activation bytes per sample from one measured profile (linear model, no intercept:
    activations of an MLP scale with the number of samples in the micro-batch)."""
    if micro_batch < 1:
        raise ValueError("micro_batch must be >= 1")
    return measured_activation_bytes / micro_batch


def activation_bytes(per_sample: float, micro_batch: int) -> int:
    """Predicted activation bytes for ``micro_batch`` samples (per rank)."""
    if micro_batch < 0:
        raise ValueError("micro_batch must be >= 0")
    return round(per_sample * micro_batch)


def mlp_activation_bytes_per_sample(input_size: int, hidden: int, depth: int, output_size: int,
                                    element_bytes: int = 4) -> int:
    """Activation bytes one sample of labkit's MLP keeps for backward, for sizing a run before it is launched:
    what autograd saves (the input, each hidden layer's ReLU output, which is also the next Linear's input, and
    the logits' log-softmax) plus the one pre-activation alive while its ReLU runs. A measured profile
    (`activation_bytes_per_sample`) replaces it once a run has counted the real bytes."""
    if depth < 1 or element_bytes < 1:
        raise ValueError("depth and element_bytes must be >= 1")
    return element_bytes * (input_size + (depth + 1) * hidden + 2 * output_size)

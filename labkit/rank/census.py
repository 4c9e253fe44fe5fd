"""Census of the model-state bytes ONE rank really holds, read from live tensors.

Why a census and not ``torch.cuda.memory_allocated``: on the CPU accelerator there is
no allocator counter per rank, and process RSS mixes model states with activations,
the Python heap and communication buffers.  Counting the tensors that the model and
the (DeepSpeed) optimizer keep makes ZeRO partitioning visible on any device.

Where the tensors live (DeepSpeed 0.19.8, verified with real 2-rank gloo runs):

* plain torch / DeepSpeed stage 0 fp32 (``FusedAdam``): ``p.data``, ``p.grad``,
  ``optimizer.state``.
* stage 0 bf16 (``FP16_Optimizer`` wrapper; ``BF16_Optimizer`` in other setups):
  bf16 params in ``fp16_groups_flat``, fp32 master ``fp32_groups_flat`` (full, not
  partitioned), bf16 ``p.grad``. With torch's SGD it is ``FP16_UnfusedOptimizer``: an fp32 master per
  parameter, found through the inner optimizer's ``param_groups``.
* stage 1/2 (``DeepSpeedZeroOptimizer``): params are views of ``bit16_groups_flat``
  (padded), master ``single_partition_of_fp32_groups``, grads at the boundary are
  views kept in ``averaged_gradients`` (``p.grad`` is already cleared); with
  offload the fp32 grad partition is ``single_partition_of_fp32_groups[i].grad`` (on
  the host: ``self.device`` is "cpu" under offload; ``offload_gradient_dict`` holds
  views of it) and staging buffers ``temp_grad_buffer_for_{cpu,gpu}_offload`` and
  ``param_buffer_of_bit16_for_cpu_offload_groups`` exist; with offload and gradient
  accumulation > 1 the whole grads of the partition's params are also kept on the
  host in ``accumulated_grads_in_cpu``.
* stage 3 (``DeepSpeedZeroOptimizer_Stage3``): param partitions ``p.ds_tensor``
  (views of ``fp16_partitioned_groups_flat``) plus full ``p.data`` of "persistent"
  small params, master ``fp32_partitioned_groups_flat``, grads in
  ``grad_partitions_flat_buffer`` (and ``fp32_partitioned_groups_flat[i].grad`` with
  offload), a reduce bucket ``ipg_buckets[dtype].buffer``.  With offload
  ``self.device`` is "cpu", and ``grad_partitions_flat_buffer`` is allocated there:
  both grad partitions live on the host.

Every tensor is counted by the full size of its storage, once (dedup on
``untyped_storage().data_ptr()``), in the first category that reaches it, in the
order params, master, optim, grads, buffers.  A view into a bigger buffer therefore
costs the whole buffer: that is the memory the rank really keeps alive.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from labkit.core.schema import CENSUS_KEYS, device_bytes

# Attribute names of DeepSpeed optimizer wrappers, per category (missing ones are skipped).
_PARAM_ATTRS = ("bit16_groups_flat", "fp16_groups_flat", "bf16_groups_flat",
                "fp16_partitioned_groups_flat", "lp_param_buffer")
_MASTER_ATTRS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat",
                 "fp32_groups_flat", "fp32_groups_flat_partition")
_GRAD_ATTRS = ("averaged_gradients", "grads_in_partition", "grad_partitions_flat_buffer",
               "offload_gradient_dict", "accumulated_grads_in_cpu",
               "fp32_groups_gradients_flat", "fp32_groups_gradient_flat_partition")
# Communication buckets and offload staging copies: not model states in the ZeRO
# paper's sense, reported separately so they don't swamp grad_bytes (the stage-3
# reduce bucket is reduce_bucket_size elements = 2 GB fp32 by default).
_BUFFER_ATTRS = ("ipg_buckets", "temp_grad_buffer_for_cpu_offload", "temp_grad_buffer_for_gpu_offload",
                 "param_buffer_of_bit16_for_cpu_offload_groups", "param_groups_fp16_flat_cpu_memory")

# Grads that optimizer offload keeps on the host, besides the fp32 master's .grad (stage 3's
# grad_partitions_flat_buffer is allocated on self.device, "cpu" under offload). On the CPU
# accelerator every tensor is on "cpu", so these names stand in for the device check.
_HOST_GRAD_ATTRS = ("accumulated_grads_in_cpu", "offload_gradient_dict", "grad_partitions_flat_buffer")


def _tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Yield the tensors inside obj: a tensor, list/tuple, dict values, a ZeRO
    GradPartitionBufferGroup (``flat_partition``) or an IPG bucket (``buffer``)."""
    if obj is None or depth > 4:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item, depth + 1)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item, depth + 1)
    else:
        for attr in ("flat_partition", "buffer"):
            if hasattr(obj, attr):
                yield from _tensors(getattr(obj, attr), depth + 1)


def _base_optimizer(optimizer: Any) -> Any:
    """Unwrap DeepSpeed wrappers (ZeRO, FP16/BF16_Optimizer) down to the torch optimizer
    that owns ``state`` (FusedAdam, DeepSpeedCPUAdam, torch.optim.Adam...)."""
    base = optimizer
    while True:
        inner = getattr(base, "optimizer", None)
        if inner is None or inner is base or not hasattr(inner, "param_groups"):
            return base
        base = inner


class _Counter:
    """Sum storage bytes per category, each storage once; remember what each category got."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.totals: dict[str, int] = {k: 0 for k in CENSUS_KEYS}
        self.counted: dict[str, list[tuple[torch.Tensor, int]]] = {k: [] for k in CENSUS_KEYS}

    def add(self, key: str, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            if t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or ptr in self.seen:
                continue
            self.seen.add(ptr)
            self.totals[key] += nbytes
            self.counted[key].append((t, nbytes))

    def bytes_where(self, keys: Iterable[str], keep: Any) -> int:
        """Bytes of the storages counted under ``keys`` whose tensor passes ``keep``."""
        return sum(n for k in keys for t, n in self.counted[k] if keep(t))


def _attrs(obj: Any, names: Iterable[str]) -> Iterator[torch.Tensor]:
    for name in names:
        yield from _tensors(getattr(obj, name, None))


def take_census(model: nn.Module, optimizer: Any, *, offload_optimizer: bool) -> dict[str, int]:
    """Bytes of model states held by this rank right now.

    Call it after ``backward`` at a gradient-accumulation boundary and before
    ``step`` (where gradients are complete).  Returns ``param_bytes``,
    ``grad_bytes``, ``optim_bytes`` (optimizer moments), ``master_bytes`` (fp32
    master copies), ``host_optim_bytes`` (the part of optim+master on the host
    because of optimizer offload), ``host_grad_bytes`` (the part of grad_bytes on
    the host because of optimizer offload: the grad partitions next to the offloaded
    optimizer) and ``buffer_bytes`` (reduce buckets and offload staging buffers, not
    part of the ZeRO paper's model states).  Device bytes of model states are
    param + grad + optim + master - host_optim - host_grad.

    On a GPU, host bytes are the counted tensors whose device is "cpu"; on the CPU
    accelerator every tensor is on "cpu", so ``offload_optimizer`` decides: all of
    optim+master, and the grads DeepSpeed allocates on its offload device (the
    master's .grad, ``accumulated_grads_in_cpu``, ``offload_gradient_dict`` and, at
    stage 3, ``grad_partitions_flat_buffer``).
    """
    params = list(model.parameters())
    base = _base_optimizer(optimizer)
    c = _Counter()

    # Params: the stage-3 partition (p.data is empty there, except persistent params).
    c.add("param_bytes", (t for p in params if (t := getattr(p, "ds_tensor", None)) is not None))
    c.add("param_bytes", (p.data for p in params))
    c.add("param_bytes", _attrs(optimizer, _PARAM_ATTRS))

    # Master: whatever the inner optimizer updates that is not a model param.
    # (stage 0 fp32: those are the model params, already counted, so master = 0.)
    master_tensors = list(_attrs(optimizer, _MASTER_ATTRS)) + [p for g in base.param_groups for p in g["params"]]
    c.add("master_bytes", master_tensors)

    c.add("optim_bytes", (t for state in base.state.values() for t in _tensors(state)))

    # Grads: model grads (stage 0, or not yet reduced), ZeRO grad partitions, master .grad.
    c.add("grad_bytes", (p.grad for p in params if p.grad is not None))
    c.add("grad_bytes", (t for p in params if (t := getattr(p, "grad_accum", None)) is not None))
    c.add("grad_bytes", _attrs(optimizer, _GRAD_ATTRS))
    c.add("grad_bytes", (m.grad for m in master_tensors if m.grad is not None))

    c.add("buffer_bytes", _attrs(optimizer, _BUFFER_ATTRS))

    out = c.totals
    accel_is_cpu = not params or params[0].device.type == "cpu"
    if accel_is_cpu:
        out["host_optim_bytes"] = out["optim_bytes"] + out["master_bytes"] if offload_optimizer else 0
        host_grads: set[int] = set()
        if offload_optimizer:
            candidates = [*_attrs(optimizer, _HOST_GRAD_ATTRS), *(m.grad for m in master_tensors if m.grad is not None)]
            host_grads = {t.untyped_storage().data_ptr() for t in candidates if t.device.type != "meta"}
        out["host_grad_bytes"] = c.bytes_where(["grad_bytes"], lambda t: t.untyped_storage().data_ptr() in host_grads)
    else:
        out["host_optim_bytes"] = c.bytes_where(["optim_bytes", "master_bytes"], _on_host)
        out["host_grad_bytes"] = c.bytes_where(["grad_bytes"], _on_host)
    return out


def _on_host(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu"


def check_emulated_capacity(budget: int | None, rank: int, census: dict[str, int], activation_bytes: int) -> None:
    """On CPU, an explicit per-rank budget (`device_memory_budget_bytes`; None: no check) stands in for a GPU's
    memory size: the model states a GPU would hold (optimizer states and grad partitions that offload keeps on the
    host left out) plus saved activations. Communication buffers (buffer_bytes) and params gathered
    transiently by ZeRO-3 are not counted. Exceeding it raises torch.OutOfMemoryError, as a GPU would."""
    if budget is None:
        return
    on_device = int(device_bytes(census, activation_bytes))
    if on_device > budget:
        raise torch.OutOfMemoryError(
            f"emulated device capacity exceeded: rank {rank} needs {on_device} bytes "
            f"(model states + {activation_bytes} activation bytes) but the budget is {budget} bytes")


class RankMemory:
    """The last census a rank took and its peak of saved activations so far (both go into every step record and
    the done record), checked against the emulated capacity where the step's memory peaks."""

    def __init__(self, *, budget_bytes: int | None, rank: int):
        self.budget_bytes, self.rank = budget_bytes, rank
        self.census: dict[str, int] = {}
        self.activation_bytes = 0

    def check(self, census: dict[str, int], activation_bytes: int) -> None:
        """labkit.rank.step_loop.train_step's `on_census`: at the step's peak (gradients held, before the optimizer
        step), with the step's activation bytes so far; the peak over earlier steps counts too."""
        check_emulated_capacity(self.budget_bytes, self.rank, census, max(self.activation_bytes, activation_bytes))

    def update(self, census: dict[str, int], activation_bytes: int) -> None:
        """After a measured step: its census, and the activation peak raised to its bytes."""
        self.census, self.activation_bytes = census, max(self.activation_bytes, activation_bytes)

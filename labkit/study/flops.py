"""What one micro-batch costs, counted on the real model built on the meta device (no memory, no data).

A `TorchDispatchMode` sees every aten op the forward and the backward run: its FLOPs (torch's own
`torch.utils.flop_counter` formulas), the bytes its tensors occupy (inputs + outputs: what a kernel must
read and write at least) and, for matrix products, the GEMM shape. A saved-tensor hook counts what autograd
keeps for the backward (the activations). `roofline_s` turns the ops into seconds on a GPU kind:

* a GEMM runs in waves of output tiles over the streaming multiprocessors: time = waves x one tile's
  FLOPs / (per-SM peak x the GPU kind's GEMM efficiency) (tile and wave quantization, NVIDIA's "Matrix Multiplication
  Background User's Guide", DU-09799-001, ch. 3), with K split over the SMs a small output leaves idle
  (`hardware.gemm_split_k`), and never less than its bytes / memory bandwidth;
* a fused attention (torch's `scaled_dot_product_attention`, which a GPU runs as FlashAttention-2 or the
  memory-efficient kernel) is one op each way: the FLOPs it executes as FlashAttention's benchmarks count them (the
  backward recomputes the scores, 2.5x the forward; a causal mask halves both) at the GPU kind's fused-attention
  share of the peak, never less than its bytes (Q, K, V, the output and their gradients: no s x s scores) / memory
  bandwidth;
* every other op is memory-bound: bytes / (memory bandwidth x its memory efficiency) (the guide's ch. 2: an op
  whose FLOPs per byte are below the GPU's FLOPs:bytes ratio is limited by memory).

So small micro-batches run far below peak for a reason the learner can see (partial waves, memory-bound
GEMMs, element-wise ops that do not shrink with the GEMMs), with three constants per GPU kind, the GEMMs', the
memory's and the fused attention's shares (measured by this lab where it had that GPU, else published or assumed:
`labkit.runtime.hardware.GPU`), none per point.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from labkit.runtime.hardware import (  # noqa: F401 -- the assumed values
    GEMM_EFFICIENCY,
    GPU,
    MEMORY_EFFICIENCY,
    SPLIT_K_PARTIAL_BYTES,
    calibrates,
    gemm_sm_flops,
    gemm_split_k,
    grid_blas,
    on_tensor_cores,
)
from labkit.study.shapes import Transformer, build  # Transformer: also flops.Transformer, as callers name it

_GEMMS = {"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm"}


class Attention(NamedTuple):
    """A fused attention's shape: what its work depends on."""

    heads: int       # batch x query heads
    q_len: int
    k_len: int
    dim: int         # the query's and key's head dimension
    v_dim: int       # the value's
    causal: bool     # the causal flag and no other mask: the blocks above the diagonal are skipped
    backward: bool


@dataclass(frozen=True)
class Op:
    name: str
    flops: float
    bytes: float
    gemm: tuple[int, int, int, int] | None = None   # (batch, M, N, K)
    # The GEMM as cuBLAS gets it, (m, k, lda, ldb, ldc, then a batched GEMM's strides between its matrices, which
    # set each matrix's address): what decides tensor cores under cuBLAS 10 (`_tensor_cores`)
    blas: tuple[int, ...] | None = None
    attention: Attention | None = None  # a fused attention's shape


@dataclass
class Census:
    """The ops of one micro-batch's forward and backward, and the bytes saved for the backward."""

    forward: list[Op] = field(default_factory=list)
    backward: list[Op] = field(default_factory=list)
    saved_bytes: float = 0.0

    def flops(self, phase: str | None = None) -> float:
        ops = self.forward + self.backward if phase is None else getattr(self, phase)
        return float(sum(op.flops for op in ops))


def _nbytes(values: Any, seen: set[int] | None = None) -> float:
    """Bytes of the tensors in `values` (nested lists too), each tensor once: `x * x` reads x once."""
    seen = set() if seen is None else seen
    total = 0.0
    for value in values:
        if isinstance(value, torch.Tensor) and id(value) not in seen:
            seen.add(id(value))
            total += value.numel() * value.element_size()
        elif isinstance(value, (list, tuple)):
            total += _nbytes(value, seen)
    return total


def _leading(x: torch.Tensor) -> int:
    """A matrix's leading dimension as PyTorch hands it to cuBLAS (ATen's prepare_matrix_for_cublas): its row stride
    if row-major, its column stride if column-major, else its column count (it is copied to a contiguous one)."""
    rows, cols = int(x.shape[-2]), int(x.shape[-1])
    row_stride, col_stride = int(x.stride()[-2]), int(x.stride()[-1])
    if col_stride == 1 and row_stride >= max(1, cols):
        return row_stride
    if row_stride == 1 and col_stride >= max(1, rows):
        return col_stride
    return cols


def _tensor_cores(op: Op, align: int) -> bool:
    """Whether cuBLAS runs this fp16 GEMM on tensor cores (`hardware.on_tensor_cores`: cuBLAS 10's alignment)."""
    return op.gemm is None or on_tensor_cores(op.gemm, op.blas, align)


def _gemm(name: str, args: tuple, out: Any) -> tuple[tuple[int, int, int, int] | None, tuple[int, ...] | None]:
    """A matrix product's (batch, M, N, K) and its cuBLAS call's (m, k, lda, ldb, ldc[, the operands' batch
    strides]); (None, None) for any other op. For a row-major output C = A @ B PyTorch has cuBLAS compute C's
    transpose, B^T A^T, so cuBLAS's m is C's columns, its first operand B and its second A."""
    if name not in _GEMMS or not isinstance(out, torch.Tensor):
        return None, None
    a, b = (args[1], args[2]) if name in ("aten.addmm", "aten.baddbmm") else (args[0], args[1])
    k = int(a.shape[-1])
    rows, columns = int(out.shape[-2]), int(out.shape[-1])
    batch = tuple(int(x.stride()[0]) for x in (b, a) if x.dim() == 3 and x.shape[0] > 1)
    shape = (int(out.shape[0]) if out.dim() == 3 else 1, rows, columns, k)
    return shape, (columns, k, _leading(b), _leading(a), columns, *batch)


# Ops that launch no kernel and move no bytes: allocations (their memory is written by the op that fills it, counted
# there) and `_unsafe_view`, the reshape `matmul` returns after `mm`, a view whose schema carries no alias annotation.
NO_TRAFFIC = {"aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided",
              "aten._unsafe_view"}


def _moved(name: str, args: tuple, kwargs: dict, outputs: Any) -> float:
    """Bytes an op's kernel reads and writes: its tensors, each once, but for two that read rows of a big input:
    `nll_loss_forward` reads one logit per row (and its targets), `embedding` the rows its indices name."""
    if name == "aten.nll_loss_forward":
        logits, target = args[0], args[1]
        return _nbytes([target, *outputs]) + target.numel() * logits.element_size()
    if name == "aten.embedding":
        return _nbytes([args[1]]) + 2 * _nbytes(outputs)  # the indices, the rows read, the rows written
    return _nbytes([*args, *kwargs.values()]) + _nbytes(outputs)  # an in-place op's output is its write


class _Recorder(TorchDispatchMode):
    def __init__(self, census: Census) -> None:
        super().__init__()
        self.census = census
        self.phase = "forward"
        self.muted = False  # while a fused op makes its outputs: they are its own writes, counted with it

    @contextlib.contextmanager
    def unrecorded(self) -> Iterator[None]:
        self.muted = True
        try:
            yield
        finally:
            self.muted = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.muted:
            return out
        schema = func._schema
        # A view (an alias that writes nothing) launches no kernel and moves no bytes.
        if schema.returns and all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
            return out
        packet = func.overloadpacket
        name = str(packet)
        if name in NO_TRAFFIC:
            return out
        flops = float(flop_registry[packet](*args, **kwargs, out_val=out)) if packet in flop_registry else 0.0
        outputs = out if isinstance(out, (list, tuple)) else (out,)
        getattr(self.census, self.phase).append(Op(name, flops, _moved(name, args, kwargs, outputs),
                                                   *_gemm(name, args, out)))
        return out


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _attention_op(attention: Attention, moved: float) -> Op:
    """The fused op's FLOPs as the eager kernels' matrix products count them (Q K^T and P V forward, four products
    backward), so that model FLOPs do not depend on the kernel; what it executes is `attention_work`'s."""
    a = attention
    forward = 2.0 * a.heads * a.q_len * a.k_len * (a.dim + a.v_dim)
    return Op("fused_attention", 2 * forward if a.backward else forward, moved, attention=a)


class _FusedAttention(torch.autograd.Function):
    """scaled_dot_product_attention as a GPU runs it: one kernel each way that keeps the scores on chip and saves
    Q, K, V, its output and each row's log-sum-exp (FlashAttention-2's backward inputs; a mask too) for the
    backward. Its outputs are zeros (real memory when counted on a CPU copy) laid out as its inputs."""

    @staticmethod
    def forward(ctx: Any, recorder: _Recorder, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        if q.dim() >= 3 and k.shape[-3] != q.shape[-3]:  # grouped-query: fewer key/value heads
            lead = (*torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3]), q.shape[-3])
        else:
            lead = tuple(torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
        shape = (*lead, q.shape[-2], v.shape[-1])
        with recorder.unrecorded():
            out = torch.zeros_like(q) if tuple(q.shape) == shape else q.new_zeros(shape)
            lse = q.new_zeros((*lead, q.shape[-2]), dtype=torch.float32)
        ctx.attention = Attention(math.prod(lead), q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1], causal, False)
        moved = _nbytes((q, k, v, mask, out, lse))
        getattr(recorder.census, recorder.phase).append(_attention_op(ctx.attention, moved))
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.recorder = recorder
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse, mask = ctx.saved_tensors
        recorder = ctx.recorder
        with recorder.unrecorded():
            grads: list[torch.Tensor | None] = [torch.zeros_like(t) for t in (q, k, v)]
            grads.append(torch.zeros_like(mask) if mask is not None and ctx.needs_input_grad[4] else None)
        moved = _nbytes((q, k, v, mask, out, lse, grad, *grads))
        getattr(recorder.census, recorder.phase).append(_attention_op(ctx.attention._replace(backward=True), moved))
        return (None, *grads, None)


def _fused_sdpa(recorder: _Recorder, cuda: bool = True) -> Callable[..., torch.Tensor]:
    """scaled_dot_product_attention's signature, routed to `_FusedAttention` (on the meta device torch would run
    its math fallback, the eager kernels). With `cuda` False, as a CPU runs it: its fused kernel
    (`_scaled_dot_product_flash_attention_for_cpu`) has no dropout, so a call with dropout_p > 0 runs the math path,
    counted as such."""

    def sdpa(*args: Any, **kwargs: Any) -> torch.Tensor:
        call = dict(zip(_SDPA_ARGS[:len(args)], args, strict=True), **kwargs)
        if not cuda and float(call.get("dropout_p") or 0.0) > 0:
            return _SDPA(*args, **kwargs)
        mask = call.get("attn_mask")
        causal = bool(call.get("is_causal")) and mask is None
        return _FusedAttention.apply(recorder, call["query"], call["key"], call["value"], mask, causal)

    return sdpa


def _fused_dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
    """Dropout as a GPU runs it: ATen takes its fused kernel, `native_dropout` (one pass writing the output and a
    bool mask; `native_dropout_backward` in the backward), only for CUDA tensors (`is_fused_kernel_acceptable`,
    aten/src/ATen/native/Dropout.cpp) and not in place (`dropout_` is always the unfused path); on the meta device the
    out-of-place call would run the unfused path too (a noise tensor in the input's dtype, `bernoulli_`, `div_`,
    `mul`), about three times the traffic and a mask twice the size."""
    if inplace or not training or not 0 < p < 1:
        return _DROPOUT(input, p, training, inplace)
    return torch.native_dropout(input, p, True)[0]


class _FusedSdpa(TorchFunctionMode):
    """Routes scaled_dot_product_attention and dropout called by a name bound before the count (`from
    torch.nn.functional import ...`); `count` swaps the module's own attributes, which a checkpoint's recompute in
    the backward calls (function modes are off there)."""

    def __init__(self, recorder: _Recorder, cuda_dropout: bool) -> None:
        super().__init__()
        self.sdpa = _fused_sdpa(recorder, cuda_dropout)
        self.cuda_dropout = cuda_dropout

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is _SDPA:
            return self.sdpa(*args, **(kwargs or {}))
        if func is _DROPOUT and self.cuda_dropout:
            return _fused_dropout(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


_SDPA = torch.nn.functional.scaled_dot_product_attention
_DROPOUT = torch.nn.functional.dropout


def count(step: Callable[[], torch.Tensor], params: list[torch.nn.Parameter] | None = None,
          cuda_dropout: bool = True) -> Census:
    """Run `step()` (a forward returning the loss) and its backward under the recorder; `step` must build on
    the meta device. Saved tensors that are parameters (or views of them) are model states, not activations.
    `cuda_dropout`: count dropout as the fused kernels a GPU runs (`_fused_dropout`, and inside a fused attention);
    False, as a CPU runs it (the unfused path, a mask in the input's dtype; an attention with dropout on the math
    path), for a prediction of this machine's runs."""
    census = Census()
    owners = {p.untyped_storage()._cdata for p in params or []}
    seen: set[int] = set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = tensor.untyped_storage()._cdata
        if key not in owners and key not in seen:
            seen.add(key)
            census.saved_bytes += tensor.untyped_storage().nbytes()
        return tensor

    with recording(census, cuda_dropout) as recorder, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
        recorder.phase = "backward"
        loss.backward()
    return census


@contextlib.contextmanager
def recording(census: Census, cuda_dropout: bool = True) -> Iterator[_Recorder]:
    """Every op run inside goes into `census` (its `forward` list until the recorder's `phase` is set to
    "backward"), a fused attention and, with `cuda_dropout`, dropout as a GPU runs them (`count`)."""
    recorder = _Recorder(census)
    routed = _FusedSdpa(recorder, cuda_dropout)
    torch.nn.functional.scaled_dot_product_attention = routed.sdpa
    if cuda_dropout:
        torch.nn.functional.dropout = _fused_dropout
    try:
        with recorder, routed:
            yield recorder
    finally:
        torch.nn.functional.scaled_dot_product_attention = _SDPA
        torch.nn.functional.dropout = _DROPOUT


def attention_work(a: Attention) -> float:
    """The FLOPs a fused attention executes, counted as FlashAttention-2's benchmark counts them
    (Dao-AILab/flash-attention@c082294e0f6c01d46318694a6f3e0274225a9683, benchmarks/benchmark_flash_attention.py,
    `flops`: a causal mask halves the work, the backward is 2.5x the forward), the convention of the published shares
    the model divides it by: forward Q K^T and P V; backward Q K^T again and four products (arXiv:2307.08691,
    Algorithm 2). No wave quantization: a published share is the kernel's throughput over that benchmark's grid
    (batch x tokens 32 x 512 to 1 x 16,384, width 2,048, head dims 64 and 128), whose low end is taken."""
    products = 2.0 * a.heads * a.q_len * a.k_len
    executed = products * (3 * a.dim + 2 * a.v_dim if a.backward else a.dim + a.v_dim)
    return executed / 2 if a.causal else executed


def attention_seconds(op: Op, gpu: GPU, precision: str) -> float:
    """A fused attention's compute time: its work (`attention_work`) at the GPU kind's fused-attention share of the
    peak (fp32 runs on the CUDA cores)."""
    assert op.attention is not None
    peak = gpu.cuda_core_peak(precision) if precision == "fp32" else gpu.peak(precision)
    return attention_work(op.attention) / (peak * gpu.attention_efficiency)


def attention_share(heads: int, tokens: int, dim: int, seconds: float, peak: float) -> float:
    """The share of `peak` at which a causal self-attention's forward + backward took `seconds`, its work counted
    as `attention_seconds` counts it: what bench_gpu_constants.py measures and the model then divides by."""
    work = sum(attention_work(Attention(heads, tokens, tokens, dim, dim, True, back)) for back in (False, True))
    return work / seconds / peak


def op_seconds(op: Op, gpu: GPU, precision: str) -> float:
    """One op on one GPU: the roofline of the module doc (GEMMs with tile and wave quantization)."""
    memory_s = op.bytes / (gpu.memory_bytes_per_s * gpu.memory_efficiency)
    if op.attention is not None:
        return max(attention_seconds(op, gpu, precision), memory_s)
    if op.gemm is None:
        return memory_s
    batch, m, n, k = op.gemm
    tensor_cores = precision == "fp32" or _tensor_cores(op, gpu.tensor_core_alignment)
    peak = gpu.peak(precision) if tensor_cores else gpu.cuda_core_peak(precision)
    per_sm = peak / gpu.sms * gpu.gemm_efficiency(precision if tensor_cores else "fp32")
    def seconds(split: int) -> float:  # K in `split` slices; more than one writes and reads fp32 partials
        partials = split * batch * m * n * SPLIT_K_PARTIAL_BYTES if split > 1 else 0
        partials_s = partials / (gpu.memory_bytes_per_s * gpu.memory_efficiency)
        return max(gemm_sm_flops(gpu, batch, m, n, k, split) / per_sm, memory_s + partials_s)

    return min(seconds(1), seconds(gemm_split_k(gpu, batch, m, n, k)))


def roofline_s(ops: list[Op], gpu: GPU, precision: str) -> float:
    return float(sum(op_seconds(op, gpu, precision) for op in ops))


@dataclass(frozen=True)
class LayerCosts:
    """A transformer's costs as base + per layer (exact for a stack of identical blocks): counted at 1 and 2
    layers on the meta device and extrapolated linearly to `layers`."""

    ops1: Census
    ops2: Census

    def scaled(self, value: Callable[[Census], float], layers: int) -> float:
        one, two = value(self.ops1), value(self.ops2)
        return one + (layers - 1) * (two - one)


@functools.lru_cache(maxsize=64)
def transformer_costs(shape: Transformer, micro_batch: int, dtype_name: str) -> LayerCosts:
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
    censuses = []
    for layers in (1, 2):
        model = build(shape, layers, dtype)
        ids = torch.zeros(micro_batch, shape.seq, dtype=torch.long, device="meta")

        def step(m: Any = model, x: torch.Tensor = ids) -> torch.Tensor:
            return m(input_ids=x, labels=x).loss

        censuses.append(count(step, list(model.parameters())))
    return LayerCosts(*censuses)


def module_census(model: torch.nn.Module, step: Callable[[], torch.Tensor], cuda_dropout: bool = True) -> Census:
    """Any model already on the meta device, with a `step()` that returns its loss (`count`'s `cuda_dropout`)."""
    return count(step, list(model.parameters()), cuda_dropout)


def gemm_check(gpu: GPU) -> list[dict[str, Any]]:
    """The GEMM roofline (`op_seconds`) against every GEMM of `gpu`'s grid (`gpu.measured`: this lab's, from
    bench_gpu_constants.py, or a published one, data/published/gemm/): predicted and measured seconds per shape and
    dtype, and whether the GPU kind's GEMM efficiency is taken from it (`calibrates`). The model takes one number per
    dtype from the grid (hardware.typical_gemm_efficiency: the median rate per SM of the `calibrates` GEMMs), so
    those straddle the roofline by construction; the spread around it, and the other GEMMs, are what this checks."""
    if gpu.measured is None:
        return []
    size = {"bf16": 2, "fp16": 2, "fp32": 4}
    rows = []
    for dtype, shapes in gpu.measured.gemm_shapes.items():
        for shape in shapes:
            m, n, k = int(shape["m"]), int(shape["n"]), int(shape["k"])
            op = Op("aten.mm", 2.0 * m * n * k, float(size[dtype] * (m * k + k * n + m * n)), (1, m, n, k),
                    grid_blas(shape))
            predicted = op_seconds(op, gpu, dtype)
            rows.append({"dtype": dtype, "label": shape.get("label", f"{m}x{n}x{k}"), "m": m, "n": n, "k": k,
                         "measured_s": float(shape["seconds"]), "predicted_s": predicted,
                         "error": predicted / float(shape["seconds"]) - 1,
                         "calibrates": calibrates(gpu, dtype, shape)})
    return rows

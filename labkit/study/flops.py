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
import dataclasses
import functools
import math
import re
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


ATTENTIONS = ("eager", "sdpa")
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

    recorder = _Recorder(census)
    routed = _FusedSdpa(recorder, cuda_dropout)
    torch.nn.functional.scaled_dot_product_attention = routed.sdpa
    if cuda_dropout:
        torch.nn.functional.dropout = _fused_dropout
    try:
        with recorder, routed, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = step()
            recorder.phase = "backward"
            loss.backward()
    finally:
        torch.nn.functional.scaled_dot_product_attention = _SDPA
        torch.nn.functional.dropout = _DROPOUT
    return census


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


# -- a transformer given by its shape ------------------------------------------------------------------------
# The decoder families a shape can name (`Transformer.arch`), each Hugging Face's own class, built on the meta device:
# gpt2: GPT2LMHeadModel, as Megatron-LM's GPT too (pre-LayerNorm, GELU MLP, learned positions, tied embeddings);
# llama: LlamaForCausalLM (RMSNorm, SwiGLU MLP, rotary positions, grouped-query attention, no biases);
# qwen2: Qwen2ForCausalLM (llama's, with biases on the query, key and value projections).
ARCHS = ("gpt2", "llama", "qwen2")
_BLOCK = re.compile(r"(^|\.)(h|layers)\.0(\.|$)")  # a module inside the first decoder block of the built model


@dataclass(frozen=True, kw_only=True)
class Transformer:
    """A decoder-only transformer by its shape; its modules and parameters are Hugging Face's class for `arch`
    (ARCHS) built on the meta device. `attention`: "eager" materialises the s x s scores (a softmax, a mask and a
    dropout over them: the 2019-2021 GPT codes, Hugging Face's eager kernels and Megatron-LM's fused softmax alike);
    "sdpa" is torch's scaled_dot_product_attention, which a GPU runs fused (FlashAttention-2 or the
    memory-efficient kernel: module doc). Default: eager for gpt2 (the codes its published points ran), sdpa for
    llama and qwen2 (transformers' default attn_implementation for them since v4.36). `dropout`: on the embeddings,
    the attention probabilities and both residual branches for gpt2, 0.1 by default as both GPT codes train
    (Hugging Face's GPT2Config resid_pdrop = embd_pdrop = attn_pdrop = 0.1; Megatron-LM's --hidden-dropout and
    --attention-dropout 0.1); on the attention probabilities only for llama and qwen2, 0 by default (their configs'
    attention_dropout): a dropout is a kernel over its tensor in the forward and one in the backward (inside the
    fused attention with sdpa)."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int = 50257
    dropout: float | None = None   # None: the arch's default (gpt2 0.1, llama and qwen2 0)
    arch: str = "gpt2"
    kv_heads: int | None = None    # key/value heads (grouped-query attention; llama and qwen2); None: heads
    ffn: int | None = None         # the MLP's inner width; None: 4 x hidden (gpt2); llama and qwen2 must say
    tied: bool | None = None       # the LM head is the token embedding; None: the arch's default (gpt2 yes, else no)
    attention: str | None = None   # "eager" or "sdpa" (ATTENTIONS); None: the arch's default (gpt2 eager, else sdpa)

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"transformer arch must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        gpt2 = self.arch == "gpt2"
        if self.ffn is None and not gpt2:
            raise ValueError(f"a {self.arch} transformer needs ffn (its MLP's inner width, intermediate_size)")
        # The arch's defaults for what was left out (the dataclass is frozen: set once, here)
        dropout = (0.1 if gpt2 else 0.0) if self.dropout is None else self.dropout
        kv_heads = self.heads if self.kv_heads is None else self.kv_heads
        ffn = 4 * self.hidden if self.ffn is None else self.ffn
        tied = gpt2 if self.tied is None else self.tied
        attention = ("eager" if gpt2 else "sdpa") if self.attention is None else self.attention
        for name, value in (("dropout", dropout), ("kv_heads", kv_heads), ("ffn", ffn), ("tied", tied),
                            ("attention", attention)):
            object.__setattr__(self, name, value)
        if attention not in ATTENTIONS:
            raise ValueError(f"transformer attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
        for name in ("layers", "hidden", "heads", "seq", "vocab", "kv_heads", "ffn"):
            if getattr(self, name) < 1:
                raise ValueError(f"transformer {name} must be >= 1")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        if not gpt2 and (self.hidden // self.heads) % 2:
            raise ValueError(f"a {self.arch} transformer's head dimension, hidden / heads = "
                             f"{self.hidden // self.heads}, must be even: rotary positions turn pairs of its features")
        if self.heads % kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({kv_heads})")
        if gpt2 and (kv_heads != self.heads or not tied):
            raise ValueError("a gpt2 transformer has as many key/value heads as heads and a tied LM head")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"transformer dropout must be in [0, 1), got {dropout}")

    @classmethod
    def parse(cls, text: str) -> Transformer:
        """'layers=48,hidden=1600,heads=16,seq=1024[,vocab=50257][,dropout=0.1][,ffn=6400][,attention=sdpa]' (GPT-2),
        or a llama or qwen2 decoder (vocab and ffn required):
        'arch=qwen2,layers=36,hidden=2048,heads=16,kv_heads=2,ffn=11008,seq=512,vocab=151936,tied=1'."""
        ints = ("layers", "hidden", "heads", "seq", "vocab", "kv_heads", "ffn")
        values: dict[str, Any] = {}
        parts = [p.strip() for p in text.split(",")]
        if any(not p for p in parts[:-1]):  # one trailing comma is harmless; an empty item is a slip
            raise ValueError(f"--transformer has an empty item (two commas, or a leading one): {text!r}")
        for part in filter(None, parts):
            key, sep, value = part.partition("=")
            if not sep or key not in (*ints, "dropout", "arch", "tied", "attention"):
                raise ValueError(f"--transformer takes layers=,hidden=,heads=,seq=[,vocab=,dropout=,arch=,kv_heads=,"
                                 f"ffn=,tied=,attention=], got {part!r}")
            if key in values:
                raise ValueError(f"--transformer {key} given twice")
            if key in ("arch", "attention"):
                values[key] = value
            elif key == "tied":
                if value.lower() not in ("1", "0", "true", "false"):
                    raise ValueError(f"--transformer tied must be 1 or 0, got {value!r}")
                values[key] = value.lower() in ("1", "true")
            else:
                try:
                    values[key] = int(value) if key in ints else float(value)
                except ValueError:
                    kind = "an integer" if key in ints else "a number"
                    raise ValueError(f"--transformer {key} must be {kind}, got {value!r}") from None
        if values.get("arch", "gpt2") not in ARCHS:  # before what it would require: an unknown arch requires nothing
            raise ValueError(f"transformer arch must be one of {', '.join(ARCHS)}, got {values['arch']!r}")
        missing = {"layers", "hidden", "heads", "seq"} - set(values)
        if values.get("arch", "gpt2") != "gpt2" and "vocab" not in values:
            missing.add("vocab")  # GPT-2's default vocabulary is no llama's or qwen2's
        if missing:
            raise ValueError(f"--transformer is missing {', '.join(sorted(missing))}")
        return cls(**values)

    def _structure(self) -> _Structure:
        return _structure(dataclasses.replace(self, layers=1))

    def n_params(self) -> int:
        return sum(sum(module) for module in self.module_layout())

    def param_modules(self) -> int:
        """Submodules holding parameters directly (ZeRO-3 hooks each and fetches its parameters before its forward
        and its backward): `module_layout`'s, and a tied LM head, which holds the embedding's weight (counted once
        in the layout) and is fetched again for it."""
        return len(self.module_layout()) + (1 if self.tied else 0)

    def paramless_modules(self) -> int:
        """Submodules without parameters of their own (blocks, attention and MLP containers, dropouts, the
        activation, the rotary embedding): ZeRO-3 hooks them too."""
        s = self._structure()
        return s.paramless_outside + self.layers * s.paramless_per_block

    def recomputed_modules(self) -> tuple[int, int]:
        """(parameter-holding, parameter-free) submodules inside the blocks: what activation checkpointing runs
        forward again in the backward (not the embeddings, the final norm or the head)."""
        s = self._structure()
        return self.layers * len(s.block), self.layers * s.paramless_per_block

    def module_layout(self) -> list[list[int]]:
        """Each parameter-holding module's parameter sizes in the model's module order (comms.module_layout's shape):
        for gpt2 wte, wpe, then per layer ln_1, c_attn, c_proj, ln_2, c_fc, mlp c_proj, then ln_f."""
        s = self._structure()
        return [list(module) for module in (*s.before, *(s.block * self.layers), *s.after)]  # the caller's own lists

    def modules_before_blocks(self) -> int:
        """Parameter-holding modules ahead of the first block in `module_layout` (gpt2: wte and wpe)."""
        return len(self._structure().before)

    def persistent_params(self, threshold: int = 100_000) -> int:
        """Elements of the tensors ZeRO-3 keeps whole (each <= param_persistence_threshold): biases and norms."""
        return sum(n for module in self.module_layout() for n in module if n <= threshold)


@dataclass(frozen=True)
class _Structure:
    """A transformer's parameter-holding modules before, inside one and after its decoder blocks, and its modules
    without parameters outside and inside one block: what any number of layers repeats."""

    before: list[list[int]]
    block: list[list[int]]
    after: list[list[int]]
    paramless_outside: int
    paramless_per_block: int


@functools.lru_cache(maxsize=64)
def _structure(shape: Transformer) -> _Structure:
    """Read off the one-layer model (`shape.layers` is 1) on the meta device."""
    from labkit.study import comms

    model = _build(shape, 1, torch.float32)
    before: list[list[int]] = []
    block: list[list[int]] = []
    after: list[list[int]] = []
    for name, own in comms.module_params(model):
        (block if _BLOCK.search(name) else after if block else before).append(own)
    paramless = [name for name, module in model.named_modules() if not list(module.parameters(recurse=False))]
    inside = sum(1 for name in paramless if _BLOCK.search(name))
    return _Structure(before, block, after, len(paramless) - inside, inside)


def _build(shape: Transformer, layers: int, dtype: torch.dtype) -> Any:
    """Hugging Face's model of `shape.arch` with `layers` blocks, on the meta device."""
    import transformers

    # no token ids: GPT-2's (50256) lie outside the small vocabulary of the module-counting models, and transformers
    # warns in the learner's notebook
    settings: dict[str, Any] = dict(vocab_size=shape.vocab, attn_implementation=shape.attention, bos_token_id=None,
                                    eos_token_id=None)
    if shape.arch == "gpt2":
        settings.update(n_layer=layers, n_embd=shape.hidden, n_head=shape.heads, n_positions=shape.seq,
                        n_inner=shape.ffn, resid_pdrop=shape.dropout, embd_pdrop=shape.dropout,
                        attn_pdrop=shape.dropout)
    else:
        settings.update(num_hidden_layers=layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
                        num_key_value_heads=shape.kv_heads, intermediate_size=shape.ffn,
                        max_position_embeddings=shape.seq, tie_word_embeddings=shape.tied,
                        attention_dropout=shape.dropout)
    names = {"gpt2": ("GPT2Config", "GPT2LMHeadModel"), "llama": ("LlamaConfig", "LlamaForCausalLM"),
             "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}[shape.arch]
    config = getattr(transformers, names[0])(**settings)
    with torch.device("meta"):
        model: Any = getattr(transformers, names[1])(config)
    # The loss transformers falls back to for these classes anyway, named so that it does not warn it is guessing.
    model.loss_type = "ForCausalLM"
    return model.to(dtype)


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
        model = _build(shape, layers, dtype)
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

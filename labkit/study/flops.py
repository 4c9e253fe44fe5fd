"""What one micro-batch costs, counted on the real model built on the meta device (no memory, no data).

A `TorchDispatchMode` sees every aten op the forward and the backward run: its FLOPs (torch's own
`torch.utils.flop_counter` formulas), the bytes its tensors occupy (inputs + outputs: what a kernel must
read and write at least) and, for matrix products, the GEMM shape. A saved-tensor hook counts what autograd
keeps for the backward (the activations). `roofline_s` turns the ops into seconds on a GPU kind:

* a GEMM runs in waves of output tiles over the streaming multiprocessors: time = waves x one tile's
  FLOPs / (per-SM peak x the GPU kind's GEMM efficiency) (tile and wave quantization, NVIDIA's "Matrix Multiplication
  Background User's Guide", DU-09799-001, ch. 3), and never less than its bytes / memory bandwidth;
* every other op is memory-bound: bytes / (memory bandwidth x its memory efficiency) (the guide's ch. 2: an op
  whose FLOPs per byte are below the GPU's FLOPs:bytes ratio is limited by memory).

So small micro-batches run far below peak for a reason the learner can see (partial waves, memory-bound
GEMMs, element-wise ops that do not shrink with the GEMMs), with two constants per GPU kind (measured by this lab
where it had that GPU, else assumed: `labkit.runtime.hardware.GPU.gemm_efficiency`), none per point.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from labkit.runtime.hardware import GEMM_EFFICIENCY, GPU, MEMORY_EFFICIENCY  # noqa: F401 -- the assumed values

TILE = 128               # cuBLAS's typical 128 x 128 output tile (the guide's section 2.3)

_GEMMS = {"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm"}


@dataclass(frozen=True)
class Op:
    name: str
    flops: float
    bytes: float
    gemm: tuple[int, int, int, int] | None = None   # (batch, M, N, K)


@dataclass
class Census:
    """The ops of one micro-batch's forward and backward, and the bytes saved for the backward."""

    forward: list[Op] = field(default_factory=list)
    backward: list[Op] = field(default_factory=list)
    saved_bytes: float = 0.0

    def flops(self, phase: str | None = None) -> float:
        ops = self.forward + self.backward if phase is None else getattr(self, phase)
        return float(sum(op.flops for op in ops))


def _nbytes(values: Any) -> float:
    total = 0.0
    for value in values:
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, (list, tuple)):
            total += _nbytes(value)
    return total


def _gemm_shape(name: str, args: tuple, out: Any) -> tuple[int, int, int, int] | None:
    if name not in _GEMMS or not isinstance(out, torch.Tensor):
        return None
    a = args[1] if name in ("aten.addmm", "aten.baddbmm") else args[0]
    k = int(a.shape[-1])
    if out.dim() == 3:
        return int(out.shape[0]), int(out.shape[1]), int(out.shape[2]), k
    return 1, int(out.shape[0]), int(out.shape[1]), k


class _Recorder(TorchDispatchMode):
    def __init__(self, census: Census) -> None:
        super().__init__()
        self.census = census
        self.phase = "forward"

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        # A view (an alias that writes nothing) launches no kernel and moves no bytes.
        if schema.returns and all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
            return out
        packet = func.overloadpacket
        flops = float(flop_registry[packet](*args, **kwargs, out_val=out)) if packet in flop_registry else 0.0
        name = str(packet)
        outputs = out if isinstance(out, (list, tuple)) else (out,)
        moved = _nbytes(args) + _nbytes(list(kwargs.values())) + _nbytes(outputs)
        getattr(self.census, self.phase).append(Op(name, flops, moved, _gemm_shape(name, args, out)))
        return out


def count(step: Callable[[], torch.Tensor], params: list[torch.nn.Parameter] | None = None) -> Census:
    """Run `step()` (a forward returning the loss) and its backward under the recorder; `step` must build on
    the meta device. Saved tensors that are parameters (or views of them) are model states, not activations."""
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
    with recorder, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
        recorder.phase = "backward"
        loss.backward()
    return census


def op_seconds(op: Op, gpu: GPU, precision: str) -> float:
    """One op on one GPU: the roofline of the module doc (GEMMs with tile and wave quantization)."""
    memory_s = op.bytes / (gpu.memory_bytes_per_s * gpu.memory_efficiency)
    if op.gemm is None:
        return memory_s
    batch, m, n, k = op.gemm
    tiles = batch * math.ceil(m / TILE) * math.ceil(n / TILE)
    waves = math.ceil(tiles / gpu.sms)
    align = gpu.tensor_core_alignment
    tensor_cores = precision == "fp32" or align == 1 or all(d % align == 0 for d in (m, n, k))
    peak = gpu.peak(precision) if tensor_cores else gpu.cuda_core_peak(precision)
    per_sm = peak / gpu.sms * gpu.gemm_efficiency(precision if tensor_cores else "fp32")
    return max(waves * 2.0 * TILE * TILE * k / per_sm, memory_s)


def roofline_s(ops: list[Op], gpu: GPU, precision: str) -> float:
    return float(sum(op_seconds(op, gpu, precision) for op in ops))


# -- a transformer given by its shape ------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Transformer:
    """A GPT-2-style decoder (pre-LayerNorm, 4h MLP, GELU, tied embeddings): Megatron-LM's GPT and Hugging Face's
    GPT2LMHeadModel. Attention is materialised (softmax over s x s scores), as in the 2020-2021 codes. `dropout`:
    on the embeddings, the attention probabilities and both residual branches, 0.1 by default as both codes train
    (Hugging Face's GPT2Config resid_pdrop = embd_pdrop = attn_pdrop = 0.1; Megatron-LM's --hidden-dropout and
    --attention-dropout 0.1): a dropout is a kernel over its tensor in the forward and one in the backward."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int = 50257
    dropout: float = 0.1

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"transformer {name} must be >= 1")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"transformer dropout must be in [0, 1), got {self.dropout}")

    @classmethod
    def parse(cls, text: str) -> Transformer:
        """'layers=48,hidden=1600,heads=16,seq=1024,vocab=50257,dropout=0.1' (vocab and dropout optional)."""
        values: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep or key not in ("layers", "hidden", "heads", "seq", "vocab", "dropout"):
                raise ValueError(f"--transformer takes layers=,hidden=,heads=,seq=[,vocab=,dropout=], got {part!r}")
            try:
                values[key] = float(value) if key == "dropout" else int(value)
            except ValueError:
                kind = "a number" if key == "dropout" else "an integer"
                raise ValueError(f"--transformer {key} must be {kind}, got {value!r}") from None
        missing = {"layers", "hidden", "heads", "seq"} - set(values)
        if missing:
            raise ValueError(f"--transformer is missing {', '.join(sorted(missing))}")
        return cls(**values)

    def n_params(self) -> int:
        h, v, s = self.hidden, self.vocab, self.seq
        per_layer = 12 * h * h + 13 * h          # qkv + proj + 2 MLP matrices, their biases, 2 LayerNorms
        return self.layers * per_layer + v * h + s * h + 2 * h

    def param_modules(self) -> int:
        """Submodules holding parameters directly (ZeRO-3 fetches each before its forward and its backward):
        per layer ln_1, c_attn, c_proj, ln_2, c_fc, mlp c_proj; plus wte, wpe, ln_f (the LM head is tied)."""
        return 6 * self.layers + 3

    def paramless_modules(self) -> int:
        """Submodules without parameters of their own (blocks, attention and MLP containers, dropouts, the
        activation): ZeRO-3 hooks them too. Counted on Hugging Face's model at 1 and 2 layers, extrapolated."""
        return _paramless_modules(self.hidden, self.heads, self.dropout, self.layers)

    def recomputed_modules(self) -> tuple[int, int]:
        """(parameter-holding, parameter-free) submodules inside the blocks: what activation checkpointing runs
        forward again in the backward (not the embeddings, ln_f or the head)."""
        per_layer_paramless = (_paramless_modules(self.hidden, self.heads, self.dropout, 2)
                               - _paramless_modules(self.hidden, self.heads, self.dropout, 1))
        return 6 * self.layers, per_layer_paramless * self.layers

    def module_layout(self) -> list[list[int]]:
        """Each parameter-holding module's parameter sizes, in GPT2LMHeadModel's order (comms.module_layout's shape):
        wte, wpe, then per layer ln_1, c_attn, c_proj, ln_2, c_fc, mlp c_proj, then ln_f (the LM head is tied)."""
        h = self.hidden
        layer = [[h, h], [3 * h * h, 3 * h], [h * h, h], [h, h], [4 * h * h, 4 * h], [4 * h * h, h]]
        return [[self.vocab * h], [self.seq * h], *(layer * self.layers), [h, h]]

    def largest_param(self) -> int:
        return max(self.vocab * self.hidden, 4 * self.hidden * self.hidden)

    def persistent_params(self, threshold: int = 100_000) -> int:
        """Elements of the tensors ZeRO-3 keeps whole (<= param_persistence_threshold): biases and LayerNorms."""
        h = self.hidden
        small = [h, h, 3 * h, h, h, h, 4 * h, h]  # ln1 w/b, qkv b, proj b, ln2 w/b, fc b, out b
        per_layer = sum(n for n in small if n <= threshold)
        return self.layers * per_layer + (2 * h if h <= threshold else 0)


def _gpt2(shape: Transformer, layers: int, dtype: torch.dtype) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    settings: dict[str, Any] = dict(n_layer=layers, n_embd=shape.hidden, n_head=shape.heads, n_positions=shape.seq,
                                    vocab_size=shape.vocab, attn_implementation="eager", resid_pdrop=shape.dropout,
                                    embd_pdrop=shape.dropout, attn_pdrop=shape.dropout,
                                    # no token ids: GPT-2's (50256) lie outside the small vocabulary of the
                                    # module-counting models, and transformers warns in the learner's notebook
                                    bos_token_id=None, eos_token_id=None)
    with torch.device("meta"):
        model: Any = GPT2LMHeadModel(GPT2Config(**settings))
    # The loss transformers falls back to for this class anyway, named so that it does not warn it is guessing.
    model.loss_type = "ForCausalLM"
    return model.to(dtype)


@functools.lru_cache(maxsize=64)
def _paramless_modules(hidden: int, heads: int, dropout: float, layers: int) -> int:
    shape = Transformer(layers=1, hidden=hidden, heads=heads, seq=8, vocab=8, dropout=dropout)
    one, two = (sum(1 for m in _gpt2(shape, n, torch.float32).modules() if not list(m.parameters(recurse=False)))
                for n in (1, 2))
    return one + (layers - 1) * (two - one)


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
        model = _gpt2(shape, layers, dtype)
        ids = torch.zeros(micro_batch, shape.seq, dtype=torch.long, device="meta")

        def step(m: Any = model, x: torch.Tensor = ids) -> torch.Tensor:
            return m(input_ids=x, labels=x).loss

        censuses.append(count(step, list(model.parameters())))
    return LayerCosts(*censuses)


def module_census(model: torch.nn.Module, step: Callable[[], torch.Tensor]) -> Census:
    """Any model already on the meta device, with a `step()` that returns its loss."""
    return count(step, list(model.parameters()))


def gemm_check(gpu: GPU) -> list[dict[str, Any]]:
    """The GEMM roofline (`op_seconds`) against every GEMM of `gpu`'s grid (`gpu.measured`: this lab's, from
    bench_gpu_constants.py, or a published one, data/published/gemm/): predicted and measured seconds per shape and
    dtype. The model takes one number from the grid (its best GEMM, as the GPU kind's efficiency); every other shape
    is a check it was not fitted to."""
    if gpu.measured is None:
        return []
    size = {"bf16": 2, "fp16": 2, "fp32": 4}
    rows = []
    for dtype, shapes in gpu.measured.gemm_shapes.items():
        for shape in shapes:
            m, n, k = int(shape["m"]), int(shape["n"]), int(shape["k"])
            op = Op("aten.mm", 2.0 * m * n * k, float(size[dtype] * (m * k + k * n + m * n)), (1, m, n, k))
            predicted = op_seconds(op, gpu, dtype)
            rows.append({"dtype": dtype, "label": shape.get("label", f"{m}x{n}x{k}"), "m": m, "n": n, "k": k,
                         "measured_s": float(shape["seconds"]), "predicted_s": predicted,
                         "error": predicted / float(shape["seconds"]) - 1})
    return rows

"""A decoder-only transformer given by its shape (`labkit predict --transformer`, `data/published/` rows): parsed
and checked without torch, so a wrong shape is refused at once; its modules and parameters are read off Hugging
Face's class for its family built on the meta device (torch and transformers, imported when first needed).
labkit.study.flops counts what it costs. A shape can also come from a Hugging Face model's config.json
(`from_hf_config`), which transformers reads (torch with it: ~4 s here)."""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass
from typing import Any

ATTENTIONS = ("eager", "sdpa")  # the scores materialised, or torch's fused scaled_dot_product_attention (flops)


# -- the shape ------------------------------------------------------------------------------------------------------
# The decoder families a shape can name (`Transformer.arch`), each Hugging Face's own class, built on the meta device:
# gpt2: GPT2LMHeadModel, as Megatron-LM's GPT too (pre-LayerNorm, GELU MLP, learned positions, tied embeddings);
# llama: LlamaForCausalLM (RMSNorm, SwiGLU MLP, rotary positions, grouped-query attention, no biases);
# qwen2: Qwen2ForCausalLM (llama's, with biases on the query, key and value projections).
ARCHS = ("gpt2", "llama", "qwen2")
# The deepest transformer published: DeepNet's 1,000 layers (Wang et al., "DeepNet: Scaling Transformers to 1,000
# Layers", 2022). Deeper is a typo (layers=1e6 for hidden=1e6), and the trace grows with depth: 1,000 layers take
# ~19 s to predict on this lab's 2-core CI machine, 100,000 layers minutes and GBs.
MAX_LAYERS = 1000
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
        if self.layers > MAX_LAYERS:
            raise ValueError(f"transformer layers ({self.layers:,}) must be at most {MAX_LAYERS:,}, the deepest "
                             "published transformer (DeepNet's); today's LLMs have 24-128")
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
        'arch=qwen2,layers=36,hidden=2048,heads=16,kv_heads=2,ffn=11008,seq=512,vocab=151936,tied=1';
        or a Hugging Face model's config.json, with the training sequence: 'hf=path/to/config.json,seq=2048'
        (`from_hf_config`; dropout= and attention= may follow it)."""
        ints = ("layers", "hidden", "heads", "seq", "vocab", "kv_heads", "ffn")
        keys = (*ints, "dropout", "arch", "tied", "attention", "hf")
        values: dict[str, Any] = {}
        parts = [p.strip() for p in text.split(",")]
        if any(not p for p in parts[:-1]):  # one trailing comma is harmless; an empty item is a slip
            raise ValueError(f"--transformer has an empty item (two commas, or a leading one): {text!r}")
        for part in filter(None, parts):
            key, sep, value = part.partition("=")
            if "hf" in values and (not sep or key not in keys):
                raise ValueError(f"--transformer hf= takes a path without commas (the items are split at them), got "
                                 f"{values['hf']!r} then {part!r}")
            if not sep or key not in keys:
                raise ValueError(f"--transformer takes layers=,hidden=,heads=,seq=[,vocab=,dropout=,arch=,kv_heads=,"
                                 f"ffn=,tied=,attention=], or hf=CONFIG,seq=, got {part!r}")
            if key in values:
                raise ValueError(f"--transformer {key} given twice")
            if key in ("arch", "attention", "hf"):
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
        if "hf" in values:
            path = values.pop("hf")
            extra = sorted(set(values) - {"seq", "dropout", "attention"})
            if extra:
                raise ValueError(f"--transformer hf= reads {', '.join(extra)} from the config; give only seq=, "
                                 "dropout= and attention= beside it")
            return from_hf_config(path, **values)
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

    def zero3_trace(self) -> Any:
        """ZeRO-3's module trace of this model (`zero3.ModuleTrace`): recorded on the one-layer model, its block's
        hooks repeated `layers` times."""
        return _zero3_trace(self)

    def zero3_timeline(self, micro_batch: int, dtype: str) -> tuple[Any, list[Any]]:
        """ZeRO-3's module trace at `micro_batch` sequences in `dtype` ("fp32", "fp16", "bf16") with every op of the
        step (`zero3_overlap.recorded` on the one-layer model; its block's hooks, with their ops, repeated `layers`
        times)."""
        from labkit.study import zero3

        trace, ops = _one_layer_timeline(dataclasses.replace(self, layers=1), micro_batch, dtype)
        return zero3.repeat_blocks(trace, self.layers, _BLOCK), ops

    def persistent_params(self, threshold: int = 100_000) -> int:
        """Elements of the tensors ZeRO-3 keeps whole (each <= param_persistence_threshold): biases and norms."""
        return sum(n for module in self.module_layout() for n in module if n <= threshold)


# -- a Hugging Face model's config.json -------------------------------------------------------------------------------
# model_type -> the arch whose class is built for it. Mistral's modules and parameters are Llama's (MistralForCausalLM:
# the same attention, MLP and RMSNorm shapes; transformers reads a mistral config that lists layer_types as ministral,
# the same again); its sliding window changes what the attention computes only past the window, which
# from_hf_config refuses.
HF_MODEL_TYPES = {"gpt2": "gpt2", "llama": "llama", "qwen2": "qwen2", "mistral": "llama", "ministral": "llama"}


def from_hf_config(path: str, *, seq: int | None = None, dropout: float | None = None,
                   attention: str | None = None) -> Transformer:
    """The shape of the Hugging Face model whose config.json is at `path` (the file, or the model's directory; `~`
    expanded), read offline by transformers' AutoConfig, which fills in what the file leaves to its class's defaults;
    `seq` is the training sequence (a config only says the longest). Refused with a ValueError naming the file and the
    field: a config transformers does not read, a model_type not in HF_MODEL_TYPES, a `seq` past the model's positions,
    and what the class built for the shape would not have (a head dimension other than hidden / heads, Llama's
    optional biases, layers with a sliding window shorter than `seq`, GPT-2's cross-attention or an untied head). A
    GPT-2 shape's position table is built `seq` long: (n_positions - seq) x hidden parameters fewer than the file's
    model (0.05% of GPT-2 XL's at 512 tokens). `dropout` (default: the config's) and `attention` as the shape takes
    them."""
    import os

    where = f"--transformer hf={path}"
    path = os.path.expanduser(path)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):  # a local file only: AutoConfig would take anything else for a hub repository's name
        raise ValueError(f"{where}: no such file (a config.json, or the model's directory with one)")
    if seq is None:
        raise ValueError(f"{where} needs seq=, the sequence you train at (the config only gives the longest the model "
                         "takes)")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(file)
    except ImportError:  # transformers' own install, not the file
        raise
    except Exception as exc:  # not JSON, no model_type, a field its class's checks refuse (not all ValueErrors)
        raise ValueError(f"{where}: not a Hugging Face config transformers reads ({type(exc).__name__}: {exc})") \
            from None
    kind = getattr(config, "model_type", None)
    if kind not in HF_MODEL_TYPES:
        raise ValueError(f"{where}: model_type {kind!r} is not modelled; known: {', '.join(HF_MODEL_TYPES)} (or give "
                         "its shape: layers=,hidden=,heads=,...)")
    gpt2 = kind == "gpt2"
    if gpt2:
        # GPT-2's positions are a table of parameters; rotary ones (the others) are none, and a longer sequence than
        # max_position_embeddings (context extension, rope_scaling) changes no shape
        refusals = [(seq > config.n_positions, f"seq={seq} is past the model's {config.n_positions} positions "
                                               "(n_positions)"),
                    (bool(config.add_cross_attention), "add_cross_attention is true (an encoder-decoder's blocks: "
                                                       "not modelled)"),
                    (not config.tie_word_embeddings, "tie_word_embeddings is false (GPT-2's head is its embedding: "
                                                     "not modelled)"),
                    (dropout is None and len({config.resid_pdrop, config.embd_pdrop, config.attn_pdrop}) > 1,
                     f"resid_pdrop, embd_pdrop and attn_pdrop differ ({config.resid_pdrop}, {config.embd_pdrop}, "
                     f"{config.attn_pdrop}) and the shape has one dropout: give dropout=")]
    else:
        heads, hidden = config.num_attention_heads, config.hidden_size
        head_dim = getattr(config, "head_dim", None)
        # which layers slide, where the class slides any (Llama's does not): transformers' own list where the config
        # has one (Qwen2's max_window_layers), else every layer
        types = getattr(config, "layer_types", None)
        sliding = kind != "llama" and ("sliding_attention" in types if types is not None else
                                       kind != "qwen2" or bool(getattr(config, "use_sliding_window", False)))
        window = getattr(config, "sliding_window", None)
        refusals = [(head_dim is not None and head_dim * heads != hidden,
                     f"head_dim {head_dim} is not hidden_size / num_attention_heads = {hidden / heads:g} (not "
                     "modelled)"),
                    (kind == "llama" and bool(getattr(config, "attention_bias", False)),
                     "attention_bias is true (not modelled)"),
                    (kind == "llama" and bool(getattr(config, "mlp_bias", False)), "mlp_bias is true (not modelled)"),
                    (sliding and window is not None and seq > window,
                     f"its sliding window ({window}) is shorter than seq (not modelled)")]
    why = [text for refused, text in refusals if refused]
    if why:
        raise ValueError(f"{where}: {'; '.join(why)}")
    try:
        if gpt2:
            return Transformer(layers=config.n_layer, hidden=config.n_embd, heads=config.n_head, seq=seq,
                               vocab=config.vocab_size, ffn=config.n_inner, tied=True,
                               dropout=config.resid_pdrop if dropout is None else dropout, attention=attention)
        kv_heads = getattr(config, "num_key_value_heads", None)
        return Transformer(arch=HF_MODEL_TYPES[kind], layers=config.num_hidden_layers, hidden=hidden, heads=heads,
                           kv_heads=heads if kv_heads is None else kv_heads,
                           ffn=config.intermediate_size, seq=seq, vocab=config.vocab_size,
                           tied=bool(config.tie_word_embeddings),
                           dropout=float(getattr(config, "attention_dropout", 0.0)) if dropout is None else dropout,
                           attention=attention)
    except ValueError as exc:  # the shape's own checks, in its names: say the file's
        names = ("layers n_layer, hidden n_embd, heads n_head, ffn n_inner, dropout resid_pdrop" if gpt2 else
                 "layers num_hidden_layers, hidden hidden_size, heads num_attention_heads, kv_heads "
                 "num_key_value_heads, ffn intermediate_size, dropout attention_dropout")
        raise ValueError(f"{where}: {exc} (the shape's {names}; dropout= when given)") from None


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
    import torch

    from labkit.study import comms

    model = build(shape, 1, torch.float32)
    before: list[list[int]] = []
    block: list[list[int]] = []
    after: list[list[int]] = []
    for name, own in comms.module_params(model):
        (block if _BLOCK.search(name) else after if block else before).append(own)
    paramless = [name for name, module in model.named_modules() if not list(module.parameters(recurse=False))]
    inside = sum(1 for name in paramless if _BLOCK.search(name))
    return _Structure(before, block, after, len(paramless) - inside, inside)


@functools.lru_cache(maxsize=64)
def _zero3_trace(shape: Transformer) -> Any:
    from labkit.study import zero3

    return zero3.repeat_blocks(_one_layer_trace(dataclasses.replace(shape, layers=1)), shape.layers, _BLOCK)


@functools.lru_cache(maxsize=64)
def _one_layer_trace(shape: Transformer) -> Any:
    """ZeRO-3's module trace of the one-layer model on the meta device, computing its loss on 8 tokens (the hooks
    do not depend on the sequence)."""
    import torch

    from labkit.study import zero3

    model = build(shape, 1, torch.float32)
    ids = torch.zeros(1, min(8, shape.seq), dtype=torch.long, device="meta")
    return zero3.record(model, lambda: model(input_ids=ids, labels=ids).loss)


@functools.lru_cache(maxsize=64)
def _one_layer_timeline(shape: Transformer, micro_batch: int, dtype: str) -> tuple[Any, list[Any]]:
    """The one-layer model's trace with its ops (`zero3_overlap.recorded`) on the meta device, at `micro_batch` x seq
    tokens, its loss computed as `flops.transformer_costs` counts it."""
    import torch

    from labkit.study import zero3_overlap

    model = build(shape, 1, {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype])
    ids = torch.zeros(micro_batch, shape.seq, dtype=torch.long, device="meta")
    return zero3_overlap.recorded(model, lambda: model(input_ids=ids, labels=ids).loss)


def build(shape: Transformer, layers: int, dtype: Any) -> Any:
    """Hugging Face's model of `shape.arch` with `layers` blocks, on the meta device, in `dtype` (a torch dtype)."""
    import torch
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

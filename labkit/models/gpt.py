"""A small GPT-2-style causal language model on real text every machine has: Python's own source.

    RunConfig(model="gpt", **SIZES["ci"])            # the built-in name
    RunConfig(model="labkit.models.gpt:build_model", data="labkit.models.gpt:build_dataset")  # the same

The model is Hugging Face's `GPT2LMHeadModel` built from a `GPT2Config` (no download): vocabulary 256
(one token per byte), `n_embd = hidden`, `n_layer = depth`, context `n_positions = input_size` tokens,
dropout off, input and output embeddings tied. `output_size` is not used (the vocabulary is 256).
The corpus: the top-level `*.py` files of this interpreter's standard library, read as bytes in
file-name order (data/README.md); each sample is a window of `input_size + 1` bytes, inputs the
first `input_size`, labels the same shifted by one. Loss: cross-entropy per token, in nats
(ln 256 = 5.55 for a uniform guess). Needs `pip install labkit[hf]` (transformers).
"""

from __future__ import annotations

import hashlib
import sysconfig
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB_SIZE = 256  # bytes

# RunConfig fields for each size; `RunConfig(**SIZES["ci"], ...)` switches a run to this model.
SIZES: dict[str, dict[str, Any]] = {
    # 120,576 parameters, 64-byte context: trains on 2 CPU ranks in minutes.
    "ci": dict(model="gpt", hidden=64, depth=2, input_size=64, dataset_size=4096, lr=3e-3, warmup_steps=5),
    # GPT-2 small's shape (12 x 768, 12 heads) with a byte vocabulary: ~86M parameters, for GPUs.
    "full": dict(model="gpt", hidden=768, depth=12, input_size=512, dataset_size=65536, lr=3e-4, warmup_steps=20),
}


def n_heads(hidden: int) -> int:
    """Attention heads: 64-dim heads as in GPT-2 when `hidden` allows, else the most heads of >= 32 dims."""
    if hidden % 64 == 0 and hidden >= 128:
        return hidden // 64
    return next((h for h in (8, 4, 2) if hidden % h == 0 and hidden // h >= 32), 1)


class ByteGPT(nn.Module):
    """GPT2LMHeadModel whose forward takes token ids and returns the logits tensor, so labkit's
    default loss (cross-entropy over every position), the flops profiler and ZeRO see a plain module."""

    def __init__(self, config: GPT2Config):
        super().__init__()
        self.lm = GPT2LMHeadModel(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, use_cache=False).logits


def gpt2_config(config: Any) -> GPT2Config:
    return GPT2Config(vocab_size=VOCAB_SIZE, n_positions=config.input_size, n_embd=config.hidden,
                      n_layer=config.depth, n_head=n_heads(config.hidden), resid_pdrop=0.0, embd_pdrop=0.0,
                      attn_pdrop=0.0, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)


def build_model(config: Any) -> nn.Module:
    """`build_model(RunConfig) -> nn.Module`: the byte-level GPT sized by hidden, depth, input_size."""
    return ByteGPT(gpt2_config(config))


def corpus_files() -> list[Path]:
    """The standard library's top-level modules, in name order (this interpreter's own copy)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(stdlib.glob("*.py"), key=lambda p: p.name)


@lru_cache(maxsize=1)
def corpus() -> bytes:
    return b"\n".join(path.read_bytes() for path in corpus_files())


def corpus_fingerprint() -> str:
    """sha256 of the corpus: the same on every machine with the same Python version."""
    return hashlib.sha256(corpus()).hexdigest()


def build_dataset(config: Any) -> TensorDataset:
    """`build_dataset(RunConfig) -> Dataset` of (input_ids, next_ids): `dataset_size` windows of
    `input_size + 1` bytes spread evenly over the whole corpus (deterministic: no randomness at all;
    the DistributedSampler shuffles them with RunConfig.seed)."""
    text = torch.frombuffer(bytearray(corpus()), dtype=torch.uint8)
    window = config.input_size + 1
    if len(text) < window:
        raise ValueError(f"the corpus has {len(text)} bytes, fewer than one window of {window}")
    stride = max(1, (len(text) - window) // config.dataset_size)
    starts = (torch.arange(config.dataset_size) * stride) % (len(text) - window + 1)
    windows = text[starts[:, None] + torch.arange(window)].long()
    return TensorDataset(windows[:, :-1].contiguous(), windows[:, 1:].contiguous())

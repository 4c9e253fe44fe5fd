"""Deterministic generated data with learnable structure.

Inputs are standard normal; labels come from a fixed random "teacher" MLP, so a student
model can learn them and the loss falls towards zero. That makes "time to the same loss"
meaningful, which random labels (as in the seed text) never are. Every rank builds the
same dataset from the seed, so nothing is downloaded and nothing is shared on disk.
See data/README.md.
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

TEACHER_HIDDEN = 64


def make_dataset(size: int, input_size: int, output_size: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(size, input_size, generator=generator)
    w1 = torch.randn(input_size, TEACHER_HIDDEN, generator=generator) / input_size**0.5
    w2 = torch.randn(TEACHER_HIDDEN, output_size, generator=generator) / TEACHER_HIDDEN**0.5
    labels = (torch.tanh(inputs @ w1) @ w2).argmax(dim=1)
    return TensorDataset(inputs, labels)

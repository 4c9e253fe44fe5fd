"""A learner's own model, as `labkit run --model tests.own_model:build_model ...` imports it.

Regression, not classification: the loss hook (mean squared error) replaces labkit's default
cross-entropy, so a run that finishes proves the hook was used.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset


def build_model(config) -> nn.Module:
    return nn.Sequential(nn.Linear(config.input_size, config.hidden), nn.Tanh(), nn.Linear(config.hidden, 1))


def build_dataset(config) -> TensorDataset:
    generator = torch.Generator().manual_seed(config.seed)
    inputs = torch.randn(config.dataset_size, config.input_size, generator=generator)
    weights = torch.randn(config.input_size, 1, generator=generator) / config.input_size**0.5
    return TensorDataset(inputs, inputs @ weights)


def loss_fn(model, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(inputs).float(), labels.float())


not_callable = 42

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


class _Split(nn.Module):
    """One Linear, its output returned as two halves."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, 2 * width)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.linear(x).chunk(2, dim=-1)


class _OddHooks(nn.Module):
    """What ZeRO-3's hooks meet in real models beyond a chain of layers: a module called twice in one forward, a
    module with two outputs that both receive gradients, one whose second output the loss never uses, and a layer
    whose output it never uses at all (gathered for the forward, never for the backward)."""

    def __init__(self, input_size: int, width: int):
        super().__init__()
        self.first = nn.Linear(input_size, width)
        self.shared = nn.Linear(width, width)
        self.split = _Split(width)
        self.split_unused = _Split(width)
        self.unused = nn.Linear(width, width)
        self.last = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.shared(torch.tanh(self.first(x)))
        u, v = self.split(self.shared(h))
        w, _unused = self.split_unused(u * v)
        self.unused(w)  # a side branch whose result is dropped
        return self.last(w)


def build_odd_model(config) -> nn.Module:
    return _OddHooks(config.input_size, config.hidden)


class _Wrap(nn.Module):
    """A wrapper around a layer that another wrapper holds too."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


class _Offset(nn.Module):
    """A module whose forward returns its own parameter."""

    def __init__(self, width: int):
        super().__init__()
        self.offset = nn.Parameter(torch.zeros(width))

    def forward(self) -> nn.Parameter:
        return self.offset


class _ExternalParams(nn.Module):
    """What ZeRO-3 handles beyond each module's own parameters: one layer registered under two parents (DeepSpeed
    hooks it twice), a parameter a module returns (it becomes its caller's), and a weight read again outside its
    module's forward (it becomes the reading module's external parameter)."""

    def __init__(self, input_size: int, width: int):
        super().__init__()
        self.first = nn.Linear(input_size, width)
        layer = nn.Linear(width, width)
        self.a = _Wrap(layer)
        self.b = _Wrap(layer)
        self.offset = _Offset(width)
        self.mix = nn.Linear(width, width)
        self.last = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x)) + self.offset()
        h = self.mix(self.b(torch.tanh(self.a(h))))
        return self.last(h + torch.tanh(h) @ self.mix.weight)  # mix's weight once more, by hand


def build_external_model(config) -> nn.Module:
    return _ExternalParams(config.input_size, config.hidden)


def build_dataset(config) -> TensorDataset:
    generator = torch.Generator().manual_seed(config.seed)
    inputs = torch.randn(config.dataset_size, config.input_size, generator=generator)
    weights = torch.randn(config.input_size, 1, generator=generator) / config.input_size**0.5
    return TensorDataset(inputs, inputs @ weights)


def loss_fn(model, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(inputs).float(), labels.float())


not_callable = 42

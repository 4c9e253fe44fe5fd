"""The seed's SimpleModel (100 -> 500 -> 10), scalable in width and depth.

Width and depth let the same code show ZeRO's effect on memory: the default is tiny
(~55k parameters); hidden=4096, depth=2 is ~17M; on a GPU, hidden=16384, depth=8 is ~2B.
"""

from __future__ import annotations

import torch
from torch import nn


class SimpleModel(nn.Module):
    def __init__(self, input_size: int = 100, hidden: int = 500, output_size: int = 10, depth: int = 1):
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(input_size, hidden), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(hidden, hidden), nn.ReLU()]
        layers.append(nn.Linear(hidden, output_size))
        # A Sequential of Linear submodules: ZeRO-3 gathers each one's parameters
        # just before its forward and again before its backward, freeing them in between only
        # if stage3_max_reuse_distance allows (DeepSpeed's default keeps a model < ~0.5B gathered:
        # the distance counts each module twice, in the forward and in the backward).
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())

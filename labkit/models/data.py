"""Deterministic generated data with learnable structure.

Inputs are standard normal; labels come from a fixed random "teacher" MLP, so a student
model can learn them and the loss falls towards zero. That makes "time to the same loss"
meaningful, which random labels (as in the seed text) never are. Every rank builds the
same dataset from the seed, so nothing is downloaded and nothing is shared on disk.
See data/README.md.
"""

from __future__ import annotations

import torch
from torch.utils.data import DistributedSampler, RandomSampler, Sampler, TensorDataset

TEACHER_HIDDEN = 64
EVAL_SEED_OFFSET = 1_000_003  # the held-out inputs come from a generator of their own


def _inputs_and_teacher(size: int, input_size: int, output_size: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(size, input_size, generator=generator)
    w1 = torch.randn(input_size, TEACHER_HIDDEN, generator=generator) / input_size**0.5
    w2 = torch.randn(TEACHER_HIDDEN, output_size, generator=generator) / TEACHER_HIDDEN**0.5
    return inputs, w1, w2


def _labels(inputs: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return (torch.tanh(inputs @ w1) @ w2).argmax(dim=1)


def make_dataset(size: int, input_size: int, output_size: int, seed: int) -> TensorDataset:
    inputs, w1, w2 = _inputs_and_teacher(size, input_size, output_size, seed)
    return TensorDataset(inputs, _labels(inputs, w1, w2))


def make_eval_set(eval_size: int, size: int, input_size: int, output_size: int, seed: int) -> TensorDataset:
    """A fixed held-out set labelled by the same teacher as `make_dataset(size, ...)`, on inputs
    the training set never holds: the same for every run with the same seed, whatever its batch."""
    _, w1, w2 = _inputs_and_teacher(size, input_size, output_size, seed)
    inputs = torch.randn(eval_size, input_size, generator=torch.Generator().manual_seed(seed + EVAL_SEED_OFFSET))
    return TensorDataset(inputs, _labels(inputs, w1, w2))


def make_sampler(dataset: TensorDataset, *, distributed_sampler: bool, world_size: int, rank: int, seed: int,
                 same_seed_every_rank: bool = False, with_replacement: bool = False) -> tuple[Sampler[int], int]:
    """The sampler one rank reads with, and how many samples make its epoch.

    `distributed_sampler=True`: each rank its own shard (`dataset_size / world_size` samples).
    False reproduces the seed text's bug: every rank shuffles and reads the whole dataset, each
    with its own seed (`seed + rank`); `same_seed_every_rank=True` is the worse variant, where
    every rank draws the same order and so the same batches (only the lessons use it).
    `with_replacement=True`: each rank draws `dataset_size / world_size` samples per epoch at random with
    replacement, from its own generator (`seed + rank`), so a micro-batch may be larger than the dataset
    (RunConfig.sample_with_replacement: the max-batch search's probes).
    """
    if with_replacement:
        per_rank = max(1, len(dataset) // world_size)
        generator = torch.Generator().manual_seed(seed + rank)
        return RandomSampler(dataset, replacement=True, num_samples=per_rank, generator=generator), per_rank
    if distributed_sampler:
        sampler: DistributedSampler[int] = DistributedSampler(dataset, num_replicas=world_size, rank=rank,
                                                              shuffle=True, seed=seed, drop_last=True)
        return sampler, len(sampler)
    generator = torch.Generator().manual_seed(seed if same_seed_every_rank else seed + rank)
    return RandomSampler(dataset, generator=generator), len(dataset)

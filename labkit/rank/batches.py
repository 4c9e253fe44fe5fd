"""A rank's micro-batches, on its device, made outside the timed step (labkit.rank.step_loop fetches a step's
micro-batches before its clock starts).

torch's DataLoader, as the worker used it, indexed and collated one sample at a time on the main thread, inside
the event-timed step, and `inputs.to(device)` from pageable memory blocked the host twice per micro-step
(a copy from pageable memory is synchronous). Here a micro-batch of a `TensorDataset` is one gather per tensor
(any other dataset: collated by torch's `default_collate`), pinned through the accelerator
(`accelerator.pin_memory`) and copied with `non_blocking=True`: the copy is queued on the device's stream before
the step's first event, so neither the gather nor the copy is part of the step's time, and the host never waits.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, DistributedSampler, RandomSampler, Sampler, TensorDataset, default_collate


def sampled_indices(sampler: Sampler[int], micro_batch: int) -> Iterator[list[int]]:
    """Endless micro-batches of indices from `sampler`, epoch after epoch (a DistributedSampler reshuffles per
    epoch, as with `set_epoch`); an epoch's last partial micro-batch is dropped, as DataLoader(drop_last=True),
    except when sampling with replacement, where epochs are only bookkeeping and a micro-batch may span several."""
    carry = isinstance(sampler, RandomSampler) and sampler.replacement
    epoch = 0
    chunk: list[int] = []
    while True:
        if isinstance(sampler, DistributedSampler):
            sampler.set_epoch(epoch)
        if not carry:
            chunk = []
        for index in sampler:
            chunk.append(int(index))
            if len(chunk) == micro_batch:
                yield chunk
                chunk = []
        epoch += 1


def gather(dataset: Dataset, indices: list[int]) -> tuple[torch.Tensor, ...]:
    """The samples at `indices` as batch tensors on the host: one indexing op per tensor of a TensorDataset,
    `default_collate` of the samples otherwise."""
    if isinstance(dataset, TensorDataset):
        picks = torch.as_tensor(indices)
        return tuple(tensor[picks] for tensor in dataset.tensors)
    return tuple(default_collate([dataset[i] for i in indices]))


def to_device(batch: tuple[torch.Tensor, ...], device: torch.device, accelerator: Any) -> tuple[torch.Tensor, ...]:
    """`batch` on `device` without blocking the host: pinned (the accelerator's `pin_memory`, a no-op on CPU),
    then copied non_blocking. torch's pinned-memory allocator keeps each buffer until its copy has completed."""
    return tuple(accelerator.pin_memory(tensor).to(device, non_blocking=True) for tensor in batch)


def device_batches(dataset: Dataset, sampler: Sampler[int], micro_batch: int, device: torch.device,
                   accelerator: Any) -> Iterator[tuple[torch.Tensor, ...]]:
    """Endless micro-batches of `dataset` (as `sampler` orders it) on `device`, each gathered, pinned and copied
    when it is asked for."""
    for indices in sampled_indices(sampler, micro_batch):
        yield to_device(gather(dataset, indices), device, accelerator)

"""The worker's noise-scale probe (labkit.rank.noise_probe.NoiseProbe) on a real model and trainer, in this process:
when it measures, what it draws, and that training is untouched. (The estimator's arithmetic is checked against a
float64 reference in tests/runtime/test_devices.py.)"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from labkit.core.config import RunConfig
from labkit.models.builders import build_model
from labkit.models.data import make_dataset
from labkit.rank.noise_probe import NoiseProbe
from labkit.rank.trainers import PlainTrainer

NOISE_KEYS = {"grad_norm_small_sq", "grad_norm_big_sq", "noise_b_small", "noise_b_big", "noise_scale"}


@pytest.fixture(scope="module")
def config() -> RunConfig:
    return RunConfig(example="pytorch", world_size=1, micro_batch=16, hidden=16, steps=10, noise_scale_every=4)


@pytest.fixture(scope="module")
def dataset(config):
    return make_dataset(config.dataset_size, config.input_size, config.output_size, config.seed)


def trainer_for(config: RunConfig) -> PlainTrainer:
    torch.manual_seed(config.seed)
    return PlainTrainer(build_model(config), config, torch.device("cpu"))


def probe_for(config: RunConfig, dataset, rank: int = 0) -> NoiseProbe:
    return NoiseProbe(config, dataset, rank=rank, make_model=partial(build_model, config))


def test_it_measures_every_noise_scale_every_steps_and_draws_nothing_between(config, dataset):
    probe, trainer = probe_for(config, dataset), trainer_for(config)
    state = probe.rng.get_state()
    assert [probe(step, trainer) for step in (1, 2, 3, 5, 6, 7)] == [{}] * 6
    assert torch.equal(probe.rng.get_state(), state)  # off steps leave the sample of the next probe as it was
    fields = probe(4, trainer)
    assert set(fields) == NOISE_KEYS
    # One rank: the small batch is half a micro-batch, the big one the whole (both halves' mean gradient).
    assert (fields["noise_b_small"], fields["noise_b_big"]) == (8, 16)
    assert fields["grad_norm_small_sq"] > fields["grad_norm_big_sq"] > 0  # a bigger batch, a less noisy gradient


def test_the_probe_leaves_the_trained_model_as_it_was(config, dataset):
    trainer = trainer_for(config)
    before = [p.detach().clone() for p in trainer.parameters()]
    probe_for(config, dataset)(4, trainer)
    assert all(torch.equal(b, p) and p.grad is None for b, p in zip(before, trainer.parameters(), strict=True))


def test_each_rank_draws_its_own_reproducible_sample(config, dataset):
    trainer = trainer_for(config)
    rank0, again, rank1 = (probe_for(config, dataset, rank)(4, trainer) for rank in (0, 0, 1))
    assert rank0 == again  # the run's seed and the rank fix the sample
    assert rank0["grad_norm_small_sq"] != rank1["grad_norm_small_sq"]


def test_off_without_noise_scale_every(dataset):
    config = RunConfig(example="pytorch", world_size=1, micro_batch=16, hidden=16, noise_scale_every=0)
    assert probe_for(config, dataset)(4, trainer_for(config)) == {}

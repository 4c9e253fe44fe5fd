"""The worker's held-out evaluation (labkit.rank.evaluation): the held-out split, when an eval is due, and the eval
itself on a real model and trainer, in this process."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from labkit.core.config import RunConfig
from labkit.models.data import make_dataset, make_eval_set
from labkit.models.mlp import SimpleModel
from labkit.rank.evaluation import EVAL_CHUNK, Evaluation, eval_due, hold_out
from labkit.rank.trainers import PlainTrainer

OWN_DATA = "labkit.models.data:make_dataset"  # any import string: RunConfig checks its syntax only


def config_of(**fields) -> RunConfig:
    return RunConfig(**{"example": "pytorch", "world_size": 1, "micro_batch": 8, "hidden": 16, "steps": 40,
                        "eval_samples": 64, **fields})


def test_evals_fall_on_the_schedule_and_the_last_step_when_no_target_is_set():
    config = config_of(eval_every=10, steps=35)
    due = [step for step in range(1, 36) if eval_due(config, step, [(10, 2.0), (20, 1.9)])]
    assert due == [10, 20, 30, 35]


def test_evals_every_step_once_the_loss_is_within_the_margin_of_the_target():
    config = config_of(eval_every=10, target_loss=1.0)
    assert eval_due(config, 21, [(10, 1.3), (20, 1.09)])  # within 10% of the target
    assert not eval_due(config, 21, [(10, 1.25), (20, 1.2)])  # neither near nor falling fast enough
    assert not eval_due(config, 11, [(10, 1.2)])  # one eval only: no rate of fall yet


def test_evals_every_step_when_the_fall_could_reach_the_target_before_the_next_scheduled_eval():
    config = config_of(eval_every=10, target_loss=1.0)
    # Falling 0.02 a step: twice that over the 10 steps to the next eval (0.4) reaches 1.0 from 1.3.
    assert eval_due(config, 21, [(10, 1.5), (20, 1.3)])
    assert not eval_due(config, 21, [(10, 1.32), (20, 1.3)])  # 0.002 a step: not before the next eval


def test_the_builtin_mlp_trains_on_all_its_data_and_a_models_own_dataset_holds_its_tail_out():
    dataset = make_dataset(256, 100, 10, 0)
    assert hold_out(config_of(eval_every=5), dataset) == (dataset, None)  # its eval set is generated apart
    assert hold_out(config_of(eval_every=0, data=OWN_DATA), dataset) == (dataset, None)  # no eval: nothing out
    train, held = hold_out(config_of(eval_every=5, data=OWN_DATA), dataset)
    assert len(train) == 256 - 64 and held is not None and len(held) == 64
    assert torch.equal(held[0][0], dataset[192][0]) and torch.equal(train[191][0], dataset[191][0])


def test_holding_out_half_the_dataset_or_more_is_refused_with_the_figures():
    with pytest.raises(ValueError, match=r"eval_samples \(64\) would hold out half or more of the model's 128-item"):
        hold_out(config_of(eval_every=5, data=OWN_DATA), make_dataset(128, 100, 10, 0))


def trainer_for(config: RunConfig) -> PlainTrainer:
    torch.manual_seed(0)
    return PlainTrainer(SimpleModel(config.input_size, config.hidden, config.output_size, config.depth), config,
                        torch.device("cpu"))


def test_an_eval_is_the_trainers_loss_on_the_generated_eval_set_on_due_steps_only():
    config = config_of(eval_every=3, steps=7)
    trainer = trainer_for(config)
    evaluate = Evaluation(config, None, trainer.device, world_size=1, all_reduce=lambda t: pytest.fail("1 rank"))
    eval_set = make_eval_set(config.eval_samples, config.dataset_size, config.input_size, config.output_size,
                             config.seed)
    expected = trainer.evaluate(*eval_set.tensors, chunk=EVAL_CHUNK)
    got = {step: evaluate(step, trainer) for step in range(1, 8)}
    assert [step for step, fields in got.items() if fields] == [3, 6, 7]
    assert got[3]["eval_loss"] == pytest.approx(expected) and got[3]["eval_s"] >= 0
    assert evaluate.history == [(6, got[6]["eval_loss"]), (7, got[7]["eval_loss"])]  # the last two


def test_a_models_own_held_out_items_are_what_it_evaluates():
    config = config_of(eval_every=1, data=OWN_DATA)
    trainer = trainer_for(config)
    items = make_dataset(256, config.input_size, config.output_size, 1)
    _, held = hold_out(config, items)
    evaluate = Evaluation(config, held, trainer.device, world_size=1, all_reduce=lambda t: None)
    tail = TensorDataset(*(tensor[-config.eval_samples:] for tensor in items.tensors))
    assert evaluate(1, trainer)["eval_loss"] == pytest.approx(trainer.evaluate(*tail.tensors, chunk=EVAL_CHUNK))


def test_ranks_record_the_mean_of_their_eval_losses():
    config = config_of(eval_every=1)
    trainer = trainer_for(config)
    mine = Evaluation(config, None, trainer.device, world_size=1, all_reduce=lambda t: None)(1, trainer)["eval_loss"]

    def with_a_peer_at_1(total: torch.Tensor) -> None:  # the sum over two ranks, the other one's loss 1.0
        assert total.dtype == torch.float64
        total += 1.0

    agreed = Evaluation(config, None, trainer.device, world_size=2, all_reduce=with_a_peer_at_1)(1, trainer)
    assert agreed["eval_loss"] == pytest.approx((mine + 1.0) / 2)


def test_without_eval_every_there_is_no_eval_set_and_no_eval():
    config = config_of(eval_every=0)
    trainer = trainer_for(config)
    evaluate = Evaluation(config, None, trainer.device, world_size=1, all_reduce=lambda t: None)
    assert evaluate.inputs is None and [evaluate(step, trainer) for step in (1, 40)] == [{}, {}]

"""A rank's held-out evaluation (`eval_every` > 0): which items are held out, when an eval is due, and the eval.

A fixed eval set, evaluated every `eval_every` steps and every step once the loss is near the target, so the first
step that meets it is found without a window's lag. It runs after the step's clock has stopped (its seconds are
recorded apart as `eval_s`), on every rank at the same step: ZeRO-3 gathers parameters in its forward, and the ranks'
mean loss keeps them in lockstep.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import Dataset, Subset, default_collate

from labkit.core.config import RunConfig

EVAL_CHUNK = 1024  # eval forward passes take this many samples at a time (at least a micro-batch)
EVAL_DENSE_MARGIN = 0.1  # evaluate every step once the eval loss is within 10% of the target...
EVAL_LOOKAHEAD = 2.0     # ...or could reach it, falling at twice its recent rate, before the next scheduled eval


def builtin_mlp_data(config: RunConfig) -> bool:
    """The lab's MLP on its generated data: its held-out set is generated apart (labkit.models.data.make_eval_set)."""
    return config.model == "mlp" and config.data is None


def hold_out(config: RunConfig, dataset: Any) -> tuple[Any, Dataset | None]:
    """(the items the rank trains on, the held-out items or None). With eval_every on a model's own dataset, its
    last eval_samples items are held out and never trained on; the built-in MLP's eval set is generated apart."""
    if not config.eval_every or builtin_mlp_data(config):
        return dataset, None
    size = len(dataset)  # a map-style dataset (RunConfig.data's contract)
    if config.eval_samples >= size // 2:
        raise ValueError(f"eval_samples ({config.eval_samples}) would hold out half or more of the model's "
                         f"{size}-item dataset; lower eval_samples or set eval_every=0")
    return Subset(dataset, range(size - config.eval_samples)), Subset(dataset, range(size - config.eval_samples, size))


def eval_due(config: RunConfig, step: int, history: list[tuple[int, float]]) -> bool:
    """Every eval_every steps, the last step, and every step once the target is near: the eval
    loss within EVAL_DENSE_MARGIN of it, or able to reach it before the next scheduled eval at
    EVAL_LOOKAHEAD times its recent rate of fall. The first step that meets it is then found to the
    step (unless the loss suddenly falls faster), at big batches (few steps, a fast fall) as at small
    ones. Every rank decides from the same values, so the ranks evaluate and stop together.
    `history`: (step, eval loss) of the last two evals."""
    if step % config.eval_every == 0 or step == config.steps:
        return True
    if config.target_loss is None or not history:
        return False
    last_step, last = history[-1]
    if last <= config.target_loss * (1 + EVAL_DENSE_MARGIN):
        return True
    if len(history) < 2:
        return False
    first_step, first = history[0]
    fall_per_step = max(0.0, (first - last) / (last_step - first_step))
    return last - EVAL_LOOKAHEAD * fall_per_step * config.eval_every <= config.target_loss


class Evaluation:
    """The run's fixed eval set on the rank's device, evaluated when due. Calling it after a step returns that
    step's `{"eval_loss", "eval_s"}`, or {} (no eval due, or eval_every=0)."""

    def __init__(self, config: RunConfig, held_out: Dataset | None, device: torch.device, *, world_size: int,
                 all_reduce: Callable[[torch.Tensor], Any]):
        """`held_out`: `hold_out`'s items, or None for the built-in MLP (its eval set is generated here).
        `all_reduce`: the sum over ranks (deepspeed.comm.all_reduce), called when world_size > 1."""
        self.config, self.world_size, self.all_reduce = config, world_size, all_reduce
        self.history: list[tuple[int, float]] = []  # (step, loss) of the last two evals
        self.inputs: torch.Tensor | None = None
        self.labels: torch.Tensor | None = None
        if not config.eval_every:
            return
        if held_out is not None:
            inputs, labels = default_collate([held_out[i] for i in range(len(held_out))])  # type: ignore[arg-type]
        else:
            from labkit.models.data import make_eval_set

            inputs, labels = make_eval_set(config.eval_samples, config.dataset_size, config.input_size,
                                           config.output_size, config.seed).tensors
        # On the device once: the trainers' forward takes device tensors.
        self.inputs, self.labels = inputs.to(device), labels.to(device)

    def __call__(self, step: int, trainer: Any) -> dict[str, float]:
        if self.inputs is None or self.labels is None or not eval_due(self.config, step, self.history):
            return {}
        started = time.perf_counter()
        loss = trainer.evaluate(self.inputs, self.labels, chunk=max(self.config.micro_batch, EVAL_CHUNK))
        if self.world_size > 1:  # identical weights give identical losses; the mean keeps ranks in lockstep
            agreed = torch.tensor([loss], dtype=torch.float64, device=trainer.device)
            self.all_reduce(agreed)
            loss = agreed.item() / self.world_size
        evaluated = {"eval_loss": loss, "eval_s": time.perf_counter() - started}
        self.history = [*self.history[-1:], (step, loss)]
        return evaluated

"""The two ways the worker trains: a plain PyTorch loop (Example 1) or a DeepSpeed engine.

Both expose the same small surface (forward, backward, step, lr, census) so the worker's
loop reads the same for every example, and each phase can be timed on its own.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from labkit.core.config import RunConfig
from labkit.models.builders import default_loss
from labkit.rank.census import take_census

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(kw_only=True)
class SavedActivations:
    """What `count_saved_activations` counted: the bytes, and the seconds its hook itself took."""

    bytes: int = 0
    seconds: float = 0.0  # inside the forward, so outside what the census times: reported with it


@contextlib.contextmanager
def count_saved_activations() -> Iterator[SavedActivations]:
    """Bytes autograd saves for backward during the block: the activation memory.

    Parameters saved by layers (leaf tensors that require grad, or views of them such as
    `weight.t()` in nn.Linear) are model states, not activations, and a tensor saved by two
    ops is counted once. The hook times itself, so the instrumentation's own cost
    (`telemetry_s` in the done record) includes it.
    """
    counted = SavedActivations()
    seen: set[int] = set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        base = tensor._base
        owner = tensor if base is None else base
        if not (owner.is_leaf and owner.requires_grad):
            storage = tensor.untyped_storage()  # one Python object per call: they cost
            key = storage.data_ptr()
            if key not in seen:
                seen.add(key)
                counted.bytes += storage.nbytes()
        counted.seconds += time.perf_counter() - started
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield counted


def _mean_loss(forward, inputs: torch.Tensor, labels: torch.Tensor, chunk: int) -> float:
    """The mean cross-entropy over a held-out set, without gradients, in chunks of `chunk` samples."""
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(inputs), chunk):
            part = slice(start, start + chunk)
            total += float(forward(inputs[part], labels[part])) * len(inputs[part])
    return total / len(inputs)


class PlainTrainer:
    """Example 1: model, loss, optimizer and the loop, with no DeepSpeed engine."""

    def __init__(self, model: nn.Module, config: RunConfig, device: torch.device,
                 loss_fn: Callable[..., torch.Tensor] | None = None):
        self.config = config
        self.loss_fn = loss_fn or default_loss
        self.device = device
        self.model = model.to(device)
        params = self.model.parameters()
        if config.optimizer == "adam":
            self.optimizer: torch.optim.Optimizer = torch.optim.Adam(params, lr=config.lr_at(1))
        else:
            # No momentum, as DeepSpeed's {"type": "SGD"} builds it: optimizer="sgd" is the same update on both paths.
            self.optimizer = torch.optim.SGD(params, lr=config.lr_at(1))
        # bf16 as mixed precision: fp32 weights, bf16 compute under autocast.
        self._autocast = config.precision == "bf16"

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # inputs and labels are on the device already (labkit.rank.batches): no copy, no wait here.
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self._autocast):
            return self.loss_fn(self.model, inputs, labels)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.config.grad_accum).backward()

    def step(self, step: int, boundary: bool) -> None:
        if not boundary:
            return
        for group in self.optimizer.param_groups:
            group["lr"] = self.config.lr_at(step)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def census(self) -> dict[str, int]:
        return take_census(self.model, self.optimizer, offload_optimizer=False)

    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor, chunk: int) -> float:
        return _mean_loss(self.forward, inputs, labels, chunk)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.model.parameters()


class DeepSpeedTrainer:
    """Examples 2 and 3: the same model wrapped by `deepspeed.initialize`."""

    def __init__(self, model: nn.Module, config: RunConfig, ds_config: dict[str, Any],
                 loss_fn: Callable[..., torch.Tensor] | None = None):
        import deepspeed

        self.config = config
        self.loss_fn = loss_fn or default_loss
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=ds_config)
        self.device = self.engine.device
        self.dtype = _DTYPES[config.precision]

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # On the device already (labkit.rank.batches). Floating inputs cast to the engine's precision there
        # (a device op, no wait); token ids and other integers as they are.
        if inputs.is_floating_point():
            inputs = inputs.to(dtype=self.dtype)
        return self.loss_fn(self.engine, inputs, labels)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)  # scales by 1/gradient_accumulation_steps itself

    def step(self, step: int, boundary: bool) -> None:
        if boundary:
            # labkit's schedule (warmup, LR scaling) written where every ZeRO optimizer,
            # offloaded CPU Adam included, reads it at its next step.
            for group in self.optimizer.param_groups:
                group["lr"] = self.config.lr_at(step)
        self.engine.step()  # a no-op between accumulation boundaries

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor, chunk: int) -> float:
        # Every rank must call it at the same step: ZeRO-3 gathers the parameters in forward.
        return _mean_loss(self.forward, inputs, labels, chunk)

    def census(self) -> dict[str, int]:
        return take_census(self.engine.module, self.optimizer,
                                 offload_optimizer=bool(self.config.offload_optimizer))

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.engine.module.parameters()

    def write_monitor(self, step: int, fields: dict[str, Any]) -> None:
        """labkit's per-step numbers through DeepSpeed's monitors (TensorBoard, CSV, W&B, Comet) when
        the config enables one; the monitor writes on rank 0 only."""
        if self.engine.monitor.enabled:
            self.engine.monitor.write_events([(f"labkit/{name}", float(value), step) for name, value in fields.items()
                                              if isinstance(value, (int, float)) and not isinstance(value, bool)])

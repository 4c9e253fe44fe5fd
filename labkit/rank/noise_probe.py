"""The rank-side half of the gradient noise scale (labkit.study.noise_scale holds the estimator): squared gradient
norms at a small and a big batch, measured on sampled steps inside a rank (`NoiseProbe`, every
`noise_scale_every` steps)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from labkit.core.config import RunConfig


def unbiased_estimates(g_small_sq: float, g_big_sq: float, b_small: float, b_big: float) -> tuple[float, float]:
    """(|G|² estimate, tr(Σ) estimate) from the squared gradient norms at two batch sizes."""
    if not 0 < b_small < b_big:
        raise ValueError(f"need 0 < b_small < b_big, got {b_small}, {b_big}")
    g2 = (b_big * g_big_sq - b_small * g_small_sq) / (b_big - b_small)
    trace = (g_small_sq - g_big_sq) / (1.0 / b_small - 1.0 / b_big)
    return g2, trace


def noise_scale(g_small_sq: float, g_big_sq: float, b_small: float, b_big: float) -> float | None:
    """B_simple from one pair of measurements (noisy; prefer `aggregate` over many)."""
    g2, trace = unbiased_estimates(g_small_sq, g_big_sq, b_small, b_big)
    return trace / g2 if g2 > 0 else None


class NoiseProbe:
    """The worker's probe (`noise_scale_every` > 0): every N steps, before the step's clock starts, each rank takes
    gradients on a fresh sample of micro_batch examples of its training items, drawn by a generator of its own
    (seeded by the run's seed and the rank), on an fp32 copy of the model (`gradient_noise_probe`). Calling it
    returns the step's noise fields, or {} on other steps (and then draws nothing)."""

    def __init__(self, config: RunConfig, dataset: Any, *, rank: int, make_model: Callable[[], Any],
                 loss_fn: Callable[..., Any] | None = None):
        """`make_model`: builds the model as the run did (the probe's fp32 copy)."""
        import torch

        self.every, self.micro_batch = config.noise_scale_every, config.micro_batch
        self.dataset, self.make_model, self.loss_fn = dataset, make_model, loss_fn
        self.rng = torch.Generator().manual_seed(config.seed * 1_000_003 + 7919 + rank)

    def __call__(self, step: int, trainer: Any) -> dict[str, float]:
        if not self.every or step % self.every:
            return {}
        import torch
        from torch.utils.data import default_collate

        picks = torch.randint(len(self.dataset), (self.micro_batch,), generator=self.rng)
        inputs, labels = default_collate([self.dataset[int(i)] for i in picks])
        return gradient_noise_probe(self.make_model, list(trainer.parameters()), inputs, labels,
                                    device=trainer.device, loss_fn=self.loss_fn)


def gradient_noise_probe(make_model: Callable[[], Any], params: list, inputs, labels, *, device,
                         loss_fn: Callable[..., Any] | None = None) -> dict[str, float]:
    """Squared gradient norms at two batch sizes, for the current weights, on every rank at once.

    `params` are the live parameters of the trained model in `make_model()`'s order (ZeRO-3
    partitions are gathered first). The gradients are taken on an fp32 copy with no DeepSpeed
    hooks, so the training step, its optimizer state and its timing are untouched (the gradients
    are fp32; their squared norms are summed in float64). Every rank
    must call this at the same step (it all-reduces).
    """
    import torch
    import torch.distributed as dist

    # Memory: one fp32 copy of the model and two fp32 gradient sets at most (12 bytes per parameter),
    # not a float64 vector per half (it was ~36 bytes per parameter: GBs at 100M+ parameters, enough
    # to cause the out-of-memory error the run then reports). Sums of squares accumulate in float64.
    clone = make_model().to(device)
    with _gathered(params), torch.no_grad():
        for mine, live in zip(clone.parameters(), params, strict=True):
            mine.copy_(live.detach().view_as(mine))  # converts dtype and device in place
    if loss_fn is None:
        from labkit.models.builders import default_loss

        loss_fn = default_loss
    half = inputs.shape[0] // 2
    if half < 1:
        raise ValueError("the noise-scale probe needs a micro-batch of at least 2 samples")
    # Token ids (the GPT) stay integers; features become fp32 like the clone.
    inputs = inputs.to(device=device, dtype=torch.float32 if inputs.is_floating_point() else inputs.dtype)
    labels = labels.to(device)

    def sum_sq(tensors) -> torch.Tensor:
        return sum(torch.linalg.vector_norm(t, dtype=torch.float64) ** 2 for t in tensors)

    mean_grads: list[torch.Tensor] | None = None
    sq_norms = []
    for part in (slice(0, half), slice(half, 2 * half)):
        loss = loss_fn(clone, inputs[part], labels[part])
        grads = torch.autograd.grad(loss, list(clone.parameters()))
        sq_norms.append(sum_sq(grads))
        if mean_grads is None:
            mean_grads = list(grads)
        else:
            for total, grad in zip(mean_grads, grads, strict=True):
                total.add_(grad).div_(2)
        del grads
    assert mean_grads is not None  # the loop above ran over both halves
    world = dist.get_world_size() if dist.is_initialized() else 1
    small_sq = torch.stack(sq_norms).mean().reshape(1).to(device)
    if world > 1:
        for grad in mean_grads:
            dist.all_reduce(grad)
            grad /= world
        dist.all_reduce(small_sq)
        small_sq /= world
    big_sq = sum_sq(mean_grads)
    g_small_sq, g_big_sq = float(small_sq.item()), float(big_sq.item())
    b_small, b_big = half, 2 * half * world
    return {"grad_norm_small_sq": g_small_sq, "grad_norm_big_sq": g_big_sq, "noise_b_small": b_small,
            "noise_b_big": b_big, "noise_scale": noise_scale(g_small_sq, g_big_sq, b_small, b_big)}


def _gathered(params: list):
    """ZeRO-3 keeps only a partition of each parameter: gather the full tensors for reading."""
    import contextlib

    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    return contextlib.nullcontext()

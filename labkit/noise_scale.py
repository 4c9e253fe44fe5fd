"""Gradient noise scale and critical batch size (McCandlish et al. 2018, "An Empirical Model of
Large-Batch Training", appendix A).

The simple noise scale is B_simple = tr(Σ) / |G|²: Σ is the covariance of per-example gradients
and G the true (full-data) gradient. Training at batches far below B_simple wastes steps on noise
(steps fall ~1/B when the batch grows); far above it, a bigger batch buys few fewer steps. It
estimates the critical batch size B_crit.

Neither tr(Σ) nor |G|² can be read off one gradient, but a batch-B gradient G_B satisfies

    E|G_B|² = |G|² + tr(Σ) / B,

so two batch sizes B_small < B_big give unbiased estimates (appendix A.1):

    |G|²   ≈ (B_big |G_big|² − B_small |G_small|²) / (B_big − B_small)
    tr(Σ)  ≈ (|G_small|² − |G_big|²) / (1/B_small − 1/B_big)

Their ratio is biased, so the paper averages both over many steps before dividing
(`aggregate`). During a run (`RunConfig.noise_scale_every > 0`) each rank computes
`gradient_noise_probe`: the gradients of the two halves of a fresh micro-batch-sized sample
(B_small = micro_batch // 2) and the gradient averaged over both halves and every rank
(B_big = 2 * (micro_batch // 2) * world_size). The rank step records carry `grad_norm_small_sq`,
`grad_norm_big_sq`, `noise_b_small`, `noise_b_big` and the per-step (noisy) `noise_scale`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence


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


@dataclass(frozen=True)
class NoiseScale:
    b_simple: float | None  # tr(Σ)/|G|² from the averaged estimates: the critical batch estimate
    g2: float               # mean |G|² estimate
    trace: float            # mean tr(Σ) estimate
    n: int                  # measurements averaged

    def as_dict(self) -> dict[str, Any]:
        return {"noise_scale": self.b_simple, "noise_g2": self.g2, "noise_trace": self.trace, "noise_probes": self.n}


def aggregate(measurements: Iterable[Sequence[float]]) -> NoiseScale | None:
    """Average |G|² and tr(Σ) over (g_small_sq, g_big_sq, b_small, b_big) tuples, then divide.

    Dividing averages (not averaging ratios) is the paper's recipe: a single |G|² estimate can
    be near zero or negative, which makes per-step ratios explode.
    """
    pairs = [unbiased_estimates(*m) for m in measurements]
    if not pairs:
        return None
    g2 = sum(p[0] for p in pairs) / len(pairs)
    trace = sum(p[1] for p in pairs) / len(pairs)
    return NoiseScale(trace / g2 if g2 > 0 else None, g2, trace, len(pairs))


def from_records(step_records: Iterable[dict[str, Any]], skip_first: int = 0) -> NoiseScale | None:
    """`aggregate` over a rank's step records that carry a probe (rank 0's suffice: probes are global)."""
    measurements = [(r["grad_norm_small_sq"], r["grad_norm_big_sq"], r["noise_b_small"], r["noise_b_big"])
                    for r in step_records
                    if r.get("grad_norm_big_sq") is not None and r.get("step", 0) > skip_first]
    return aggregate(measurements)


def critical_batch_from_steps(batches: Sequence[float], steps: Sequence[float]) -> dict[str, float] | None:
    """Fit S(B) = S_min (1 + B_crit / B) to steps-to-target (McCandlish et al. eq. 2.11).

    Least squares of S on 1/B: intercept S_min, slope S_min * B_crit. Returns None when fewer
    than two batch sizes reached the target or the fit is not physical (S_min <= 0 or slope < 0).
    """
    points = [(1.0 / b, s) for b, s in zip(batches, steps) if b and s and math.isfinite(s)]
    if len({x for x, _ in points}) < 2:
        return None
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx
    s_min = mean_y - slope * mean_x
    if s_min <= 0 or slope < 0:
        return None
    return {"s_min": s_min, "b_crit": slope / s_min, "e_min": slope}


# -- the in-run probe (used by labkit.worker) ---------------------------------------------------
def gradient_noise_probe(make_model: Callable[[], Any], params: list, inputs, labels, *, device,
                         loss_fn: Callable[..., Any] | None = None) -> dict[str, float]:
    """Squared gradient norms at two batch sizes, for the current weights, on every rank at once.

    `params` are the live parameters of the trained model in `make_model()`'s order (ZeRO-3
    partitions are gathered first). The gradients are taken on an fp32 copy with no DeepSpeed
    hooks, so the training step, its optimizer state and its timing are untouched. Every rank
    must call this at the same step (it all-reduces).
    """
    import torch
    import torch.distributed as dist

    with _gathered(params):
        weights = [p.detach().to(device=device, dtype=torch.float32, copy=True) for p in params]
    clone = make_model().to(device)
    with torch.no_grad():
        for mine, weight in zip(clone.parameters(), weights):
            mine.copy_(weight.view_as(mine))
    if loss_fn is None:
        from labkit.builders import default_loss as loss_fn
    half = inputs.shape[0] // 2
    if half < 1:
        raise ValueError("the noise-scale probe needs a micro-batch of at least 2 samples")
    inputs = inputs.to(device=device, dtype=torch.float32 if inputs.is_floating_point() else inputs.dtype)
    labels = labels.to(device)
    halves = []
    for part in (slice(0, half), slice(half, 2 * half)):
        loss = loss_fn(clone, inputs[part], labels[part])
        grads = torch.autograd.grad(loss, list(clone.parameters()))
        halves.append(torch.cat([g.reshape(-1) for g in grads]).double())
    world = dist.get_world_size() if dist.is_initialized() else 1
    small_sq = torch.stack([h.pow(2).sum() for h in halves]).mean().reshape(1)
    mean_grad = (halves[0] + halves[1]) / 2
    if world > 1:
        dist.all_reduce(mean_grad)
        dist.all_reduce(small_sq)
        mean_grad /= world
        small_sq /= world
    g_small_sq, g_big_sq = float(small_sq.item()), float(mean_grad.pow(2).sum().item())
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

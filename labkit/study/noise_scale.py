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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from labkit.rank.noise_probe import noise_scale, unbiased_estimates  # noqa: F401  (the estimator's formulas)
from labkit.runtime.arguments import whole_number


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
    points = [(1.0 / b, s) for b, s in zip(batches, steps, strict=True) if b and s and math.isfinite(s)]
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


def _weighted_fit(points: Sequence[tuple[float, float, float]]) -> tuple[float, float] | None:
    """Weighted least squares of y on x: (intercept, slope), or None when x does not vary."""
    total = sum(w for _, _, w in points)
    mean_x = sum(w * x for x, _, w in points) / total
    mean_y = sum(w * y for _, y, w in points) / total
    sxx = sum(w * (x - mean_x) ** 2 for x, _, w in points)
    if sxx <= 0:
        return None
    slope = sum(w * (x - mean_x) * (y - mean_y) for x, y, w in points) / sxx
    return mean_y - slope * mean_x, slope


def critical_batch_fit(batches: Sequence[float], steps: Sequence[float], *, resolution: Sequence[float] | None = None,
                       n_boot: int = 2000, seed: int = 0, level: float = 0.9) -> dict[str, float] | None:
    """S(B) = S_min (1 + B_crit / B) fitted by weighted least squares of S on 1/B, with a bootstrap
    interval for B_crit.

    Steps to a target are counts whose spread grows with their size, so each point is weighted by
    1 / S^2 (constant relative error), plus the square of `resolution` (how coarsely the target
    was checked, e.g. the eval interval) where given. The interval resamples the relative residuals
    of the fit (wild bootstrap with Rademacher signs: it works with as few as three batch sizes)
    and refits; `b_crit_low`/`b_crit_high` are its `level` percentiles over the physical refits
    (S_min > 0, B_crit >= 0), and `b_crit_physical_share` says how many were; with two batch sizes
    the fit is exact and has no interval. None when fewer than two batch sizes reached the target or
    the fit itself is not physical.
    """
    import random

    res = list(resolution) if resolution is not None else [0.0] * len(batches)
    data = [(1.0 / b, float(s), 1.0 / (float(s) ** 2 + float(r or 0.0) ** 2))
            for b, s, r in zip(batches, steps, res, strict=True) if b and s and math.isfinite(s)]
    if len({x for x, _, _ in data}) < 2:
        return None
    fit = _weighted_fit(data)
    if fit is None or fit[0] <= 0 or fit[1] < 0:
        return None
    s_min, slope = fit
    out = {"s_min": s_min, "b_crit": slope / s_min, "e_min": slope, "n_batches": len({x for x, _, _ in data})}
    if out["n_batches"] < 3:
        return out  # two points fit exactly: no residuals, no interval
    rng = random.Random(seed)
    predicted = [s_min + slope * x for x, _, _ in data]
    relative = [(y - p) / p for (_, y, _), p in zip(data, predicted, strict=True)]
    estimates = []
    for _ in range(n_boot):
        fake = [(x, p * (1 + e * rng.choice((-1.0, 1.0))), w)
                for (x, _, w), p, e in zip(data, predicted, relative, strict=True)]
        refit = _weighted_fit(fake)
        if refit and refit[0] > 0 and refit[1] >= 0:
            estimates.append(refit[1] / refit[0])
    if estimates:
        estimates.sort()
        tail = (1 - level) / 2
        out["b_crit_low"] = estimates[int(tail * (len(estimates) - 1))]
        out["b_crit_high"] = estimates[int((1 - tail) * (len(estimates) - 1))]
        out["b_crit_physical_share"] = len(estimates) / n_boot
    return out


def noise_scale_spread(measurements: Sequence[Sequence[float]], parts: int = 4) -> dict[str, Any] | None:
    """B_simple pooled over the whole run and over `parts` consecutive stretches of it (in the
    order given: by step or by falling loss): its spread over the run. Keys: `b_simple`,
    `b_simple_low`, `b_simple_high` (min and max over the stretches), `b_simple_parts` (the list)."""
    whole_number("parts", parts)  # 0 divided by zero
    whole = aggregate(measurements)
    if whole is None or not whole.b_simple:
        return None
    measurements = list(measurements)
    size = max(1, math.ceil(len(measurements) / parts))
    stretches = [aggregate(measurements[i:i + size]) for i in range(0, len(measurements), size)]
    values = [p.b_simple for p in stretches if p and p.b_simple]
    return {"b_simple": whole.b_simple, "b_simple_low": min(values, default=whole.b_simple),
            "b_simple_high": max(values, default=whole.b_simple), "b_simple_parts": values, "probes": whole.n}


# -- a language model's critical batch from the loss it trains to (published) ------------------------
# A language model's critical batch grows as the loss it trains to falls: B_crit(L) = B_* / L^(1 / alpha_B), B_* ~ 2e8
# tokens, alpha_B ~ 0.21, L the test loss in nats per token (Kaplan et al., "Scaling Laws for Neural Language
# Models", arXiv:2001.08361, 2020, Eq. 1.4 and Figure 10: decoder-only transformers on WebText2 with GPT-2's BPE
# tokens; it "does not depend directly on the model size"). Global, as published: not fitted to anything here.
LM_B_STAR_TOKENS = 2e8
LM_ALPHA_B = 0.21
# The target losses taken: a guard against typos and overflow (L^(1/0.21) of a tiny L), not the paper's range. A
# language model's loss in nats per token lies below ln(vocabulary), a uniform guess (ln 50257 = 10.8 for GPT-2).
LM_LOSS_RANGE_NATS = (0.5, 10.0)


def language_model_b_crit(loss_nats: float, seq: int) -> float:
    """Kaplan et al.'s critical batch at a target loss (nats per token), in sequences of `seq` tokens: the samples
    this model counts. Their loss is on WebText2 with GPT-2's tokenizer: another corpus or tokenizer shifts the loss
    scale, so read it as an order of magnitude."""
    low, high = LM_LOSS_RANGE_NATS
    if not low <= loss_nats <= high or seq < 1:
        raise ValueError(f"the target loss must be {low}-{high} nats per token and seq >= 1, got {loss_nats} and "
                         f"{seq}")
    return LM_B_STAR_TOKENS / loss_nats ** (1.0 / LM_ALPHA_B) / seq


def language_model_b_crit_source(loss_nats: float, seq: int) -> str:
    """Where `language_model_b_crit(loss_nats, seq)` comes from, as `labkit predict` and notebook 06 both say it."""
    return f"Kaplan et al. 2020, Eq. 1.4, at {loss_nats:g} nats per token, in sequences of {seq} tokens"


# -- the in-run probe (used by labkit.rank.worker) ---------------------------------------------------

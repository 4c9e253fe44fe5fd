"""Largest micro-batch per rank that fits, per strategy: doubling, then bisection.

    from labkit.study.maxbatch import search
    result = search(RunConfig(example="zero3", stage=3, world_size=2, hidden=256,
                              device_memory_budget_bytes=2_000_000), out="runs/maxbatch")
    result.max_micro_batch, result.launches

Each probe is a real 2-step run (`labkit.Run`, supervised, OOM classified). On a GPU the
boundary is the device's real out-of-memory error. On a CPU there is no device memory to run
out of, so the run's `device_memory_budget_bytes` acts as an **emulated device capacity**: the
worker counts what a GPU would hold (model states not offloaded + saved activations, see
`labkit.rank.census.check_emulated_capacity`; communication buffers and the params ZeRO-3 gathers
for a moment are not counted) and raises `torch.OutOfMemoryError` past the budget.

The search doubles the micro-batch from `start` until a probe runs out of memory, then bisects
between the last fit and the first OOM until they are adjacent (or within `tolerance`, a
fraction). That is ~2 log2(max) launches. Probes are cached like sweep points: a repeated
search replays finished probes from their run directories (`launches` counts new ones).

On CPU the emulated boundary is therefore the memory model's own prediction enforced: it shows that the
search and the count work, and is no evidence that the model is right (`boundary_evidence` in maxbatch.csv
says which kind each row is).  `find_boundary` is the search's logic as a pure function.

From the probes' own memory numbers it also predicts the boundary: model states on the device
plus activations linear in the micro-batch (`activation_bytes` measured at two micro-batch
sizes), so `predicted_max_micro_batch` = floor((budget - states - a0) / a1).
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from labkit.core.config import RunConfig
from labkit.core.files import write_text_atomic
from labkit.study.sweep import Sweep, settled, strategy_of

# Says what an emulated boundary is: the worker enforces labkit's own count of the bytes a GPU would hold,
# so the boundary agrees with the memory model by construction (maxbatch.csv column `boundary_evidence`).
EMULATED_EVIDENCE = ("emulated: the boundary is the memory model's own prediction enforced (the worker raises "
                     "OutOfMemoryError when labkit's count passes device_memory_budget_bytes), so it is no evidence "
                     "for the model")
DEVICE_EVIDENCE = "the device's own out-of-memory error"

PROBE_STEPS = 2  # the capacity check runs at steps 1 and 2 (step 2: optimizer state exists)


class MaxBatchError(RuntimeError):
    """A probe neither finished nor ran out of memory: no evidence about capacity."""


@dataclass
class Probe:
    micro_batch: int
    status: str
    device_bytes: int | None      # on-device bytes counted (fits) or needed (emulated OOM)
    activation_bytes: int | None
    run_id: str | None
    reused: bool

    @property
    def fits(self) -> bool:
        return self.status == "finished"


@dataclass
class MaxBatchResult:
    strategy: str
    world_size: int
    budget_bytes: int | None          # the emulated capacity (CPU), or None for a real device
    emulated: bool
    max_micro_batch: int              # 0: not even `start`..1 fits
    first_oom: int | None             # smallest micro-batch seen to run out of memory (None: hit `limit`)
    probes: list[Probe] = field(default_factory=list)
    limit: int | None = None          # the largest micro-batch the search would try
    limit_reason: str = ""            # why the limit is what it is
    stopped_by: str | None = None     # a probe that neither finished nor ran out of memory, which ended the search

    @property
    def capped_by(self) -> str | None:
        """Why the boundary is not memory's, in words ("capped by <this>, not memory"); None: a real boundary."""
        if self.stopped_by:
            return f"a probe that neither finished nor ran out of memory ({self.stopped_by})"
        if self.first_oom is None and self.limit is not None and self.max_micro_batch >= self.limit:
            return f"the search's limit of {self.limit} per rank ({self.limit_reason})"
        return None

    @property
    def launches(self) -> int:
        """Probes this search needed (each one launch; cached probes included)."""
        return len(self.probes)

    @property
    def new_launches(self) -> int:
        return sum(not p.reused for p in self.probes)

    @property
    def max_global_batch(self) -> int:
        return self.max_micro_batch * self.world_size

    def activation_fit(self) -> tuple[float, float] | None:
        """(a0, a1): activation bytes = a0 + a1 * micro_batch, from the fitting probes."""
        points = sorted({(p.micro_batch, p.activation_bytes) for p in self.probes if p.fits and p.activation_bytes})
        if len(points) >= 2:
            (m0, b0), (m1, b1) = points[0], points[-1]
            a1 = (b1 - b0) / (m1 - m0)
            return b0 - a1 * m0, a1
        if points:
            return 0.0, points[0][1] / points[0][0]
        return None

    @property
    def state_bytes(self) -> int | None:
        """Model-state bytes on the device (a fitting probe's count minus its activations)."""
        fit = next((p for p in self.probes if p.fits and p.device_bytes is not None and p.activation_bytes), None)
        if fit is None or fit.device_bytes is None or fit.activation_bytes is None:
            return None
        return fit.device_bytes - fit.activation_bytes

    @property
    def predicted_max_micro_batch(self) -> int | None:
        fit, states = self.activation_fit(), self.state_bytes
        if self.budget_bytes is None or fit is None or states is None or fit[1] <= 0:
            return None
        return max(0, math.floor((self.budget_bytes - states - fit[0]) / fit[1]))

    def consistent(self) -> bool:
        """The boundary agrees with the memory numbers: the max fits the budget by the count, the
        first OOM exceeds it, and the linear prediction lands between them."""
        if self.budget_bytes is None:
            return True
        at_max = next((p for p in self.probes if p.micro_batch == self.max_micro_batch), None)
        at_oom = next((p for p in self.probes if p.micro_batch == self.first_oom), None)
        ok = at_max is None or (at_max.device_bytes is not None and at_max.device_bytes <= self.budget_bytes)
        ok &= at_oom is None or (at_oom.device_bytes is not None and at_oom.device_bytes > self.budget_bytes)
        predicted = self.predicted_max_micro_batch
        if predicted is not None and self.first_oom is not None:
            ok &= self.max_micro_batch <= predicted < self.first_oom
        return bool(ok)

    def summary_row(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "world_size": self.world_size, "budget_bytes": self.budget_bytes,
                "emulated_capacity": self.emulated, "max_micro_batch": self.max_micro_batch,
                "max_global_batch": self.max_global_batch, "first_oom": self.first_oom,
                "launches": self.launches, "new_launches": self.new_launches,
                "predicted_max_micro_batch": self.predicted_max_micro_batch,
                "state_bytes": self.state_bytes,
                "activation_bytes_per_sample": (self.activation_fit() or (None, None))[1],
                "consistent": self.consistent(),
                "boundary_evidence": EMULATED_EVIDENCE if self.emulated else DEVICE_EVIDENCE,
                "capped_by": self.capped_by}

    def probe_rows(self) -> list[dict[str, Any]]:
        return [{"strategy": self.strategy, "world_size": self.world_size, "order": i + 1,
                 **dataclasses.asdict(p), "budget_bytes": self.budget_bytes} for i, p in enumerate(self.probes)]


def search(template: RunConfig, out: str | os.PathLike, *, start: int = 1, limit: int | None = None,
           tolerance: float = 0.0, cancel: threading.Event | None = None) -> MaxBatchResult:
    """Find the largest micro-batch of `template` (its other fields unchanged) that fits.

    The dataset is no cap: a probe larger than its share of the dataset samples with replacement
    (RunConfig.sample_with_replacement). The limit is where the input batch alone would fill the device
    (`search_limit`), so the search ends at a real out-of-memory below it. A probe that neither finishes nor runs
    out of memory ends the search with what it found, `capped_by` saying so, rather than the caller's command.
    `cancel` (set from another thread) stops the probe in flight and raises `SweepCancelled`."""
    limit_reason = "given"
    if not limit:
        limit, limit_reason = search_limit(template)
    if start <= 0:
        start = predicted_start(template, limit)
    sweep_out = Path(out)
    result = MaxBatchResult(strategy=strategy_of(template), world_size=template.world_size,
                            budget_bytes=template.device_memory_budget_bytes,
                            emulated=template.device_memory_budget_bytes is not None,
                            max_micro_batch=0, first_oom=None, limit=limit, limit_reason=limit_reason)

    def probe(micro_batch: int) -> bool:
        config = dataclasses.replace(
            template, micro_batch=micro_batch, grad_accum=1, train_batch=None, steps=PROBE_STEPS,
            stop_at_target=False, noise_scale_every=0,
            sample_with_replacement=template.sample_with_replacement
            or micro_batch > template.dataset_size // template.world_size)
        sweep = Sweep([config], sweep_out, parallel=1, results_name=None, progress=False, cancel=cancel)
        row = sweep.run().iloc[0].to_dict()
        status = row["status"]
        if not settled(status, row.get("cause")):
            raise MaxBatchError(f"micro-batch {micro_batch}: probe {status}: {row.get('cause')} "
                                f"(see {row.get('run_dir')})")
        result.probes.append(Probe(micro_batch, status, int_or_none(row.get("device_bytes")),
                                   int_or_none(row.get("activation_bytes")), row.get("run_id"), sweep.launched == 0))
        return status == "finished"

    try:
        result.max_micro_batch, result.first_oom = find_boundary(probe, start=start, limit=limit,
                                                                 tolerance=tolerance)
    except MaxBatchError as exc:
        fits = [p.micro_batch for p in result.probes if p.fits]
        ooms = [p.micro_batch for p in result.probes if not p.fits]
        result.max_micro_batch, result.first_oom = max(fits, default=0), min(ooms, default=None)
        result.stopped_by = str(exc)
    return result


def search_limit(template: RunConfig) -> tuple[int, str]:
    """(largest micro-batch per rank worth probing, why): the one whose input batch alone fills the device (the
    emulated capacity on CPU, the GPU's memory otherwise): a real boundary lies below it, whatever the model."""
    capacity = template.device_memory_budget_bytes
    where = "the emulated capacity"
    if capacity is None:
        from labkit.runtime.devices import detect_devices

        devices = detect_devices()
        capacity, where = (None, "") if devices.is_cpu else (devices.total_memory_bytes, "the device's memory")
    if not capacity:
        per_rank = template.dataset_size // template.world_size
        return per_rank, f"the dataset: {template.dataset_size} samples over {template.world_size} ranks"
    sample_bytes = 4 * template.input_size  # an fp32 input row (token ids: int64, but half as many per byte of text)
    return max(1, capacity // sample_bytes), f"where the input batch alone would fill {where}"


def predicted_start(template: RunConfig, limit: int) -> int:
    """A start for the doubling near the boundary (`search(start=0)`): the power of two at or below half the
    micro-batch labkit's memory model predicts for the capacity (labkit.study.device_need.micro_step_bytes:
    states, bucket, activations of labkit's MLP, overhead; on a GPU, 1 where the optimizer step's peak does not
    fit, which the emulated check does not count).
    Doubling from 1 to a GPU's boundary took ~20 probes; from here it takes 1-3 (a failing start bisects down)."""
    from labkit.study.device_need import DEVICE_OVERHEAD_BYTES, micro_step_bytes, optimizer_step_peak_bytes

    capacity = template.device_memory_budget_bytes
    emulated = capacity is not None  # the emulated check counts states and activations only: no overhead
    if capacity is None:
        from labkit.runtime.devices import detect_devices

        devices = detect_devices()
        capacity = None if devices.is_cpu else devices.total_memory_bytes
    if capacity is None or template.model != "mlp":
        return 1
    if not emulated and optimizer_step_peak_bytes(template) > capacity:
        return 1  # no micro-batch fits: the search finds that out from 1
    overhead = DEVICE_OVERHEAD_BYTES if emulated else 0
    one, two = (micro_step_bytes(dataclasses.replace(template, micro_batch=m, sample_with_replacement=True))
                for m in (1, 2))
    per_sample, fixed = two - one, one - (two - one) - overhead
    predicted = max(1, (capacity - fixed) // max(1, per_sample))
    return int(min(limit, 2 ** max(0, math.floor(math.log2(max(1, predicted // 2))))))


def memory_bound(maxbatch: pd.DataFrame) -> pd.DataFrame:
    """The rows of maxbatch.csv whose boundary is memory's (real or emulated): the only ones a ratio may be
    computed from. Older files without `capped_by`: a row with no first out-of-memory stopped at the limit."""
    if "capped_by" in maxbatch:
        return maxbatch[maxbatch.capped_by.isna() | (maxbatch.capped_by.astype(str) == "")]
    if "first_oom" in maxbatch:
        return maxbatch[maxbatch.first_oom.notna()]
    return maxbatch


def capped_sentences(maxbatch: pd.DataFrame) -> list[str]:
    """One sentence per strategy whose search ended without a memory boundary: "capped by ..., not memory"."""
    capped = maxbatch.drop(memory_bound(maxbatch).index)
    out = []
    for r in capped.itertuples():
        why = getattr(r, "capped_by", None)
        why = why if isinstance(why, str) and why else "the search's limit"
        out.append(f"{r.strategy} x{int(r.world_size)}: at least {int(r.max_micro_batch)} per rank, capped by {why}, "
                   "not memory: no ratio is computed from it.")
    return out


def find_boundary(fits: Callable[[int], bool], *, start: int = 1, limit: int,
                  tolerance: float = 0.0) -> tuple[int, int | None]:
    """(largest micro-batch that fits, smallest that does not) for a monotone `fits` predicate.

    Doubles from `start` (clamped to 1..`limit`) until `fits` is False, then bisects between the last fit
    and that first failure until they are adjacent, or within `tolerance` (a fraction of the fit).  The
    boundary is found wherever it lies in 1..`limit`, not only among the doubled sizes: with a failing
    `start` it bisects down from it.  `(limit, None)`: `limit` fits; `(0, 1)`: nothing fits.  Pure: the
    search calls it with a probe that launches a run; the tests with a fake predicate.
    """
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    low, high = 0, None  # largest fit, smallest failure
    micro_batch = max(1, min(start, limit))
    while True:  # doubling
        if fits(micro_batch):
            low = micro_batch
            if micro_batch >= limit:
                break
            micro_batch = min(2 * micro_batch, limit)
        else:
            high = micro_batch
            break
    while high is not None and high - low > max(1, math.floor(low * tolerance)):  # bisection
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low, high


def search_many(templates: Sequence[RunConfig], out: str | os.PathLike, *, parallel: int = 2,
                **options: Any) -> list[MaxBatchResult]:
    """`search` for several strategies at once (each search is sequential; they run side by side)."""
    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        return list(pool.map(lambda t: search(t, out, **options), templates))


def write_results(results: Sequence[MaxBatchResult], out: str | os.PathLike) -> tuple[pd.DataFrame, pd.DataFrame]:
    """maxbatch.csv (one row per strategy) and maxbatch_probes.csv (one row per launch) in `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summary = pd.DataFrame([r.summary_row() for r in results])
    probes = pd.DataFrame([row for r in results for row in r.probe_rows()])
    write_text_atomic(out / "maxbatch.csv", summary.to_csv(index=False))
    write_text_atomic(out / "maxbatch_probes.csv", probes.to_csv(index=False))
    return summary, probes


def int_or_none(value: Any) -> int | None:
    """A count read from a results row: None for a missing (None or NaN) value."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return int(value)

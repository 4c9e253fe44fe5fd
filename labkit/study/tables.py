"""The sweep's results table read as the answer reads it: strategy labels, the main grid (one LR scaling), the
compute time to target, the LR-scaling study and its best steps per batch. Used by the report, the card and growth
(and by notebooks 04 and 04a as `report.label`, `report.grid`, `report.lr_study`, `report.best_steps`)."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from labkit.study.sweep import STRATEGY_LABELS


def label(strategy: str) -> str:
    return STRATEGY_LABELS.get(strategy, strategy)


def is_nan(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def grid_scaling(results: pd.DataFrame, profile: dict[str, Any] | None = None) -> str | None:
    """The LR scaling of the main grid (the study of the other scalings runs on one strategy)."""
    if profile and profile.get("grid_lr_scaling"):
        return profile["grid_lr_scaling"]
    if "lr_scaling" not in results or results.empty:
        return None
    return results.groupby("lr_scaling")["strategy"].nunique().idxmax()


def with_compute_time(results: pd.DataFrame) -> pd.DataFrame:
    """Adds compute_time_to_target_s = steps to target x median step time: the time to the target
    on an unshared device. (The sum of the measured step times, train_time_to_target_s, also
    holds the stalls other processes caused on a shared machine.)"""
    if "compute_time_to_target_s" in results:
        return results
    frame = results.copy()
    frame["compute_time_to_target_s"] = frame.steps_to_target * frame.median_step_time_s
    return frame


def grid(results: pd.DataFrame, profile: dict[str, Any] | None = None) -> pd.DataFrame:
    results = with_compute_time(results)
    scaling = grid_scaling(results, profile)
    frame = results if scaling is None else results[results.lr_scaling == scaling]
    return frame.sort_values(["strategy", "global_batch"])


def lr_study(results: pd.DataFrame) -> tuple[str | None, pd.DataFrame]:
    """(strategy, rows) of the LR-scaling study: the strategy run with the most scalings."""
    finished = results[results.status == "finished"]
    if finished.empty:
        return None, finished
    counts = finished.groupby("strategy").lr_scaling.nunique()
    strategy = counts.idxmax()
    if counts.max() < 2:
        return None, finished.iloc[0:0]
    study = finished[finished.strategy == strategy]
    study = study[study.world_size == study.world_size.max()]  # the fixed ranks: the 1-rank points are not in it
    if "growth" in study:
        # The study's own points (growth "", or "micro_batch" at the grid's batches); the "grad_accum" way's
        # points at other batches grow the batch another way (they would add a second point per batch).
        ways = study.growth.map(lambda g: set() if is_nan(g) or not g else set(str(g).split("+")))
        study = study[ways.map(lambda w: not w or "micro_batch" in w)]
    return strategy, study


def best_steps(study: pd.DataFrame) -> pd.DataFrame:
    """Per global batch, the fewest steps to target over the LR scalings tried (the tuned LR)."""
    reached = study[study.steps_to_target.notna()]
    if reached.empty:
        return reached
    return reached.loc[reached.groupby("global_batch").steps_to_target.idxmin()].sort_values("global_batch")

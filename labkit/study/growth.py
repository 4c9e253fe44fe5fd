"""The answer read per way of growing the batch, with credit where it is due.

The sweep (`labkit.study.answer`) grows the global batch three ways, recorded in the `growth` column:

- "ranks": more data-parallel ranks at a fixed per-rank micro-batch (1, 2, 4, ... devices);
- "micro_batch": a bigger micro-batch on a fixed number of ranks;
- "grad_accum": more gradient accumulation at a fixed micro-batch and ranks.

A point several ways share holds them joined by "+" ("grad_accum+micro_batch+ranks"). For each way this
module tabulates time per step, time per epoch and time to the same (held-out) loss, from the smallest
batch to the largest (`growth_table`; `labkit.study.card` turns stage 0's into the answer card), and
compares every ZeRO strategy with stage 0 (plain data parallelism) and with plain PyTorch at the SAME
per-rank micro-batch, accumulation and ranks (`credit_table`), so that a saving stage 0 shows too is
never attributed to ZeRO (`credit_sentences`). What ZeRO itself changes is the largest micro-batch that
fits per rank (maxbatch.csv, `max_micro_batches`) and what it costs per step: the card's `deepspeed` line.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from labkit.study.tables import best_steps, is_nan, label, lr_study
from labkit.study.verdict import FLAT_BAND, verdict

WAYS = {"ranks": "more ranks at a fixed per-rank micro-batch",
        "micro_batch": "a bigger micro-batch on fixed ranks",
        "grad_accum": "more gradient accumulation at a fixed micro-batch and ranks"}
ZERO = ("z1", "z2", "z3", "z2-offload", "z3-offload")  # the strategies that partition or offload something
SAME = FLAT_BAND  # ratios within 10% of each other are "the same", the card's flat band
# A wild bootstrap of n batch sizes has 2**n distinct resamples (8 with three): B_crit is placed, with an
# interval, only from this many batch sizes on, and only when the interval lies within the batches measured.
PLACE_BATCHES = 5


def _ways(value: Any) -> set[str]:
    return set(str(value).split("+")) if not is_nan(value) and value else set()


def grid_scaling(results: pd.DataFrame) -> str | None:
    """The LR scaling of the grid: the one most strategies ran with (the LR study adds others)."""
    if "lr_scaling" not in results or results.empty:
        return None
    return results.groupby("lr_scaling")["strategy"].nunique().idxmax()


def in_growth(results: pd.DataFrame, way: str, lr_scaling: str | None = None) -> pd.DataFrame:
    """The rows of one way of growing the batch, at the grid's LR scaling (default)."""
    if way not in WAYS:
        raise ValueError(f"way must be one of {sorted(WAYS)}, got {way!r}")
    if "growth" not in results:
        return results.iloc[0:0]
    scaling = lr_scaling or grid_scaling(results)
    # bool, and .loc: an empty table's mask is an empty object Series, which [] reads as a list of column names
    mask = results.growth.map(lambda g: way in _ways(g)).astype(bool)
    if scaling is not None:
        mask &= results.lr_scaling == scaling
    return results.loc[mask].sort_values(["strategy", "world_size", "global_batch"])


MEASURED_COLUMNS = ("strategy", "growth", "world_size", "micro_batch", "grad_accum", "global_batch", "threads_per_rank",
                    "concurrent_runs", "median_step_time_s", "time_per_epoch_s", "steps_to_target",
                    "compute_time_to_target_s", "eval_loss")
RATIO_COLUMNS = ("batch_ratio", "step_time_ratio", "epoch_time_ratio", "steps_ratio", "time_to_target_ratio")


def growth_table(results: pd.DataFrame, way: str) -> pd.DataFrame:
    """Per strategy and batch of one way: time per step, per epoch, to the target, and each as a
    ratio to the strategy's smallest finished batch of that way (`*_ratio`). No rows (nothing finished, a filter that
    keeps none): the columns still, so the cells that select them say "empty" rather than KeyError."""
    rows = in_growth(results, way)
    if rows.empty:  # also a table without columns (pd.DataFrame()): no `status` to filter on
        return pd.DataFrame(columns=[*MEASURED_COLUMNS, *RATIO_COLUMNS])
    rows = rows[rows.status == "finished"].copy()
    if "compute_time_to_target_s" not in rows:
        rows["compute_time_to_target_s"] = rows.steps_to_target * rows.median_step_time_s
    out = []
    for _, group in rows.groupby("strategy", sort=False):
        group = group.sort_values(["global_batch", "world_size"])
        first = group.iloc[0]
        for r in group.to_dict("records"):
            out.append({**{k: r.get(k) for k in MEASURED_COLUMNS},
                "batch_ratio": r["global_batch"] / first.global_batch,
                "step_time_ratio": _ratio(r.get("median_step_time_s"), first.median_step_time_s),
                "epoch_time_ratio": _ratio(r.get("time_per_epoch_s"), first.time_per_epoch_s),
                "steps_ratio": _ratio(r.get("steps_to_target"), first.steps_to_target),
                "time_to_target_ratio": _ratio(r.get("compute_time_to_target_s"), first.compute_time_to_target_s)})
    return pd.DataFrame(out, columns=[*MEASURED_COLUMNS, *RATIO_COLUMNS])


def _ratio(after: Any, before: Any) -> float | None:
    if is_nan(after) or is_nan(before) or not before:
        return None
    return float(after) / float(before)


def credit_table(results: pd.DataFrame) -> pd.DataFrame:
    """Every finished DeepSpeed point at the grid's LR scaling beside stage 0 at the same world size,
    micro-batch and accumulation, and beside plain PyTorch (one process) at the same micro-batch
    and accumulation on one rank: step time, steps and time to target, and their ratios."""
    scaling = grid_scaling(results)
    table = results[(results.status == "finished") & (results.lr_scaling == scaling)].copy()
    if "compute_time_to_target_s" not in table:
        table["compute_time_to_target_s"] = table.steps_to_target * table.median_step_time_s
    keyed = {(r["strategy"], int(r["world_size"]), int(r["micro_batch"]), int(r["grad_accum"])): r
             for r in table.to_dict("records")}
    out = []
    for (strategy, ranks, micro, accum), r in keyed.items():
        if strategy == "torch":
            continue
        z0, torch = keyed.get(("z0", ranks, micro, accum)), keyed.get(("torch", 1, micro, accum))
        row = {"strategy": strategy, "world_size": ranks, "micro_batch": micro, "grad_accum": accum,
               "global_batch": r["global_batch"], "growth": r.get("growth"),
               "step_time_s": r["median_step_time_s"], "steps_to_target": r.get("steps_to_target"),
               "time_to_target_s": r.get("compute_time_to_target_s")}
        for name, other in (("z0", z0), ("torch", torch)):
            if other is None or (name == "z0" and strategy == "z0"):
                continue
            row[f"{name}_step_time_s"] = other["median_step_time_s"]
            row[f"{name}_steps_to_target"] = other.get("steps_to_target")
            row[f"step_time_vs_{name}"] = _ratio(r["median_step_time_s"], other["median_step_time_s"])
            row[f"time_to_target_vs_{name}"] = _ratio(r.get("compute_time_to_target_s"),
                                                      other.get("compute_time_to_target_s"))
        out.append(row)
    return pd.DataFrame(out).sort_values(["strategy", "world_size", "micro_batch"]) if out else pd.DataFrame()


def _change(ratio: float | None, noun: str) -> str:
    """'time per step slower (1.88x)': the card's verdict word beside the ratio it comes from."""
    if ratio is None or is_nan(ratio):
        return f"{noun} not measured at both ends"
    return f"{noun} {verdict(float(ratio))} ({float(ratio):.2f}x)"


def growth_sentences(results: pd.DataFrame, way: str) -> list[str]:
    """One statement per strategy of one way (smallest -> largest batch): time per step, per epoch and to
    the target, each with its verdict (faster / flat / slower). The report prints them under the way's
    figure; the answer itself, read on stage 0, is the card (`labkit.study.card`)."""
    out: list[str] = []
    table = growth_table(results, way)
    if table.empty:
        return out
    for strategy, group in table.groupby("strategy", sort=False):
        if len(group) < 2:
            continue
        first, last = group.iloc[0], group.iloc[-1]
        how = {"ranks": f"{int(first.world_size)} -> {int(last.world_size)} ranks at micro-batch "
                        f"{int(first.micro_batch)}",
               "micro_batch": f"micro-batch {int(first.micro_batch)} -> {int(last.micro_batch)} on "
                              f"{int(first.world_size)} rank(s)",
               "grad_accum": f"accumulation {int(first.grad_accum)} -> {int(last.grad_accum)} at micro-batch "
                             f"{int(first.micro_batch)} on {int(first.world_size)} rank(s)"}[way]
        steps = ("" if is_nan(first.steps_to_target) or is_nan(last.steps_to_target) else
                 f" ({int(first.steps_to_target)} -> {int(last.steps_to_target)} steps)")
        out.append(f"{label(strategy)}: global batch {int(first.global_batch)} -> {int(last.global_batch)} "
                   f"({how}): {_change(last.step_time_ratio, 'time per step')}, "
                   f"{_change(last.epoch_time_ratio, 'time per epoch')}, "
                   f"{_change(last.time_to_target_ratio, 'time to the target eval loss')}{steps}.")
    return out


def _against(ratio: float, z0: float) -> str:
    """How a strategy's change compares with stage 0's, in words that fit both directions (the card's verdicts:
    a ratio within the flat band neither grew nor fell)."""
    mine, theirs = verdict(ratio), verdict(z0)
    if mine == theirs == "slower":
        return "grew less than stage 0's" if ratio < z0 else "grew more than stage 0's"
    if mine == theirs == "faster":
        return "fell further than stage 0's" if ratio < z0 else "fell less than stage 0's"
    if mine == theirs:
        return "flat, like stage 0's"
    words = {"faster": "fell", "flat": "stayed flat", "slower": "grew"}
    return f"{words[mine]} where stage 0's {words[theirs]}"


def credit_sentences(results: pd.DataFrame) -> list[str]:
    """What ZeRO (stages 1-3, offload) did to the time to target beyond stage 0 over the same growth, and
    DeepSpeed's engine at stage 0 on one rank against the plain PyTorch loop. (Room per rank and the cost
    per step are the card's `deepspeed` line.)"""
    out = []
    credit = credit_table(results)
    for way, words in WAYS.items():
        table = growth_table(results, way)
        if table.empty:
            continue
        last = table.groupby("strategy").last()
        z0 = last.time_to_target_ratio.get("z0") if "z0" in last.index else None
        if z0 is None or is_nan(z0):
            continue
        # A ratio compares like with like only over the same batches as stage 0's: a strategy measured
        # at one batch (its ratio is 1 by definition) or over another range says nothing here.
        reached = table[table.time_to_target_ratio.notna()]
        span = reached.groupby("strategy").global_batch.agg(["min", "max", "size"])
        same: list[str] = []
        worse: list[str] = []
        better: list[str] = []
        for strategy in [s for s in last.index if s in ZERO]:
            ratio = last.time_to_target_ratio.get(strategy)
            if ratio is None or is_nan(ratio) or strategy not in span.index or span.loc[strategy, "size"] < 2:
                continue
            if tuple(span.loc[strategy, ["min", "max"]]) != tuple(span.loc["z0", ["min", "max"]]):
                continue
            bucket = same if abs(ratio / z0 - 1) <= SAME else (better if ratio < z0 else worse)
            text = f"{label(strategy)} {ratio:.2f}x" + ("" if bucket is same else f" ({_against(ratio, z0)})")
            if bucket is better:
                # A smaller ratio can come from a slower start (a fixed per-step cost that a bigger batch
                # amortizes): say where it ends against stage 0, not only how far it fell.
                versus = _ratio(last.compute_time_to_target_s.get(strategy), last.compute_time_to_target_s.get("z0"))
                if versus is not None and not is_nan(versus):
                    text += f" (at the largest batch still {versus:.2f}x stage 0's time to target)"
            bucket.append(text)
        if same or worse or better:
            text = (f"Credit ({words}): stage 0 alone changed the time to target {z0:.2f}x; "
                    + (f"{', '.join(same)} changed it by the same factor (within {SAME:.0%}): that change belongs "
                       "to the bigger batch and data parallelism, not to ZeRO" if same else "")
                    + ("; " if same and (better or worse) else "")
                    + (f"{', '.join(better)}: a smaller ratio than stage 0's" if better else "")
                    + ("; " if better and worse else "")
                    + (f"{', '.join(worse)}: a larger ratio than stage 0's" if worse else ""))
            out.append(text + ".")
    if not credit.empty and "step_time_vs_torch" in credit:
        one = credit[(credit.strategy == "z0") & (credit.world_size == 1) & credit.step_time_vs_torch.notna()]
        for r in one.itertuples():
            out.append(f"DeepSpeed's engine at stage 0 on one rank against the plain PyTorch loop at the same "
                       f"micro-batch {r.micro_batch}: {r.step_time_vs_torch:.2f}x the step time (both timed alone, "
                       "same threads per rank).")
    return out


def max_micro_batches(maxbatch: pd.DataFrame | None) -> dict[tuple[str, int], int]:
    """(strategy, world size) -> the largest micro-batch per rank the search found (maxbatch.csv)."""
    if maxbatch is None or maxbatch.empty or "max_micro_batch" not in maxbatch:
        return {}
    from labkit.study.maxbatch import memory_bound

    maxbatch = memory_bound(maxbatch)  # a search capped short of memory gives no ratio
    return {(r.strategy, int(r.world_size)): int(r.max_micro_batch) for r in maxbatch.itertuples()
            if not is_nan(r.max_micro_batch)}


def critical_batch(results: pd.DataFrame, study_strategy: str | None = None) -> dict[str, Any] | None:
    """B_crit from the LR study's best steps per global batch (weighted fit, bootstrap interval), with
    where the data place it (`placement`, see `place_critical_batch`)."""
    from labkit.study.noise_scale import critical_batch_fit

    strategy, study = lr_study(results)
    if study_strategy is not None and study_strategy != strategy:
        return None
    if strategy is None:
        return None
    best = best_steps(study)
    if best.empty:
        return None
    numbers = critical_batch_fit(best.global_batch.tolist(), best.steps_to_target.tolist())
    if numbers is None:
        return None
    fit: dict[str, Any] = {**numbers, "strategy": strategy, "batches": best.global_batch.tolist(),
                           "steps": best.steps_to_target.tolist(), "lr_scalings": best.lr_scaling.tolist()}
    return {**fit, "placement": place_critical_batch(fit)}


def place_critical_batch(fit: dict[str, Any]) -> dict[str, Any]:
    """Where the measured batches put B_crit: `where` is "below", "within" or "above" the batches measured,
    `placed` says whether they pin it (an interval from at least PLACE_BATCHES batch sizes, lying within
    the batches measured), and `text` says it in words for the card, the report and notebook 04."""
    low, high = min(fit["batches"]), max(fit["batches"])
    b_crit, n = fit["b_crit"], fit["n_batches"]
    interval = (fit["b_crit_low"], fit["b_crit_high"]) if "b_crit_low" in fit else None
    where = "above" if b_crit > high else "below" if b_crit < low else "within"
    placed = (where == "within" and interval is not None and n >= PLACE_BATCHES
              and low <= interval[0] and interval[1] <= high and fit.get("b_crit_physical_share", 1.0) >= 0.9)
    if placed and interval is not None:
        text = (f"B_crit ~ {b_crit:.0f} (90% bootstrap interval {interval[0]:.0f}-{interval[1]:.0f}, "
                f"{n} batch sizes {low}-{high})")
    elif where == "above":
        text = (f"B_crit above the largest batch measured ({high}); these data cannot place it "
                f"(the fit's {b_crit:.0f} is an extrapolation)")
    elif where == "below":
        text = (f"B_crit below the smallest batch measured ({low}); these data cannot place it "
                f"(the fit's {b_crit:.0f} is an extrapolation)")
    else:
        reach = (f"its interval {interval[0]:.0f}-{interval[1]:.0f} reaches past them" if interval else
                 "no interval")
        text = (f"B_crit within the batches measured ({low}-{high}), the fit's {b_crit:.0f}, but {n} batch sizes "
                f"do not pin it ({reach}); these data cannot place it more closely")
    return {"where": where, "placed": placed, "text": text, "low_batch": low, "high_batch": high}


def noise_spread(noise: pd.DataFrame | None, parts: int = 4) -> dict[str, Any] | None:
    """B_simple pooled over every probe, and over `parts` stretches of training ordered by falling
    training loss (early -> late): its spread over the run."""
    from labkit.study.noise_scale import noise_scale_spread

    if noise is None or noise.empty:
        return None
    ordered = noise.sort_values("loss", ascending=False)
    return noise_scale_spread(list(ordered[["grad_norm_small_sq", "grad_norm_big_sq", "noise_b_small",
                                            "noise_b_big"]].itertuples(index=False, name=None)), parts)

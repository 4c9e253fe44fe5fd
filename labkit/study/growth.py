"""The answer read per way of growing the batch, with credit where it is due.

The sweep (`labkit.study.answer`) grows the global batch two ways, recorded in the `growth` column:

- "ranks": more data-parallel ranks at a fixed per-rank micro-batch (1, 2, 4, ... devices);
- "micro_batch": a bigger micro-batch (or more accumulation) on a fixed number of ranks.

A point both ways share holds "micro_batch+ranks". For each way this module tabulates time per
step, time per epoch and time to the same (held-out) loss, from the smallest batch to the largest
(`growth_table`), and compares every ZeRO strategy with stage 0 (plain data parallelism) and with
plain PyTorch at the SAME per-rank micro-batch and the SAME ranks (`credit_table`), so that a
saving stage 0 shows too is never attributed to ZeRO (`credit_sentences`). What ZeRO itself
changes is the largest micro-batch that fits per rank (maxbatch.csv) and what it costs per step.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from labkit.study.report import _nan, label  # the report imports this module only inside its functions

WAYS = {"ranks": "more ranks at a fixed per-rank micro-batch",
        "micro_batch": "a bigger micro-batch on fixed ranks"}
ZERO = ("z1", "z2", "z3", "z2-offload", "z3-offload")  # the strategies that partition or offload something
SAME = 0.1  # ratios within 10% of each other are "the same"


def _ways(value: Any) -> set[str]:
    return set(str(value).split("+")) if not _nan(value) and value else set()


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
    mask = results.growth.map(lambda g: way in _ways(g))
    if scaling is not None:
        mask &= results.lr_scaling == scaling
    return results[mask].sort_values(["strategy", "world_size", "global_batch"])


def growth_table(results: pd.DataFrame, way: str) -> pd.DataFrame:
    """Per strategy and batch of one way: time per step, per epoch, to the target, and each as a
    ratio to the strategy's smallest finished batch of that way (`*_ratio`)."""
    rows = in_growth(results, way)
    rows = rows[rows.status == "finished"].copy()
    if "compute_time_to_target_s" not in rows:
        rows["compute_time_to_target_s"] = rows.steps_to_target * rows.median_step_time_s
    out = []
    for _, group in rows.groupby("strategy", sort=False):
        group = group.sort_values("global_batch")
        first = group.iloc[0]
        for r in group.to_dict("records"):
            out.append({**{k: r.get(k) for k in (
                "strategy", "growth", "world_size", "micro_batch", "grad_accum", "global_batch", "threads_per_rank",
                "concurrent_runs", "median_step_time_s", "time_per_epoch_s", "steps_to_target",
                "compute_time_to_target_s", "eval_loss")},
                "batch_ratio": r["global_batch"] / first.global_batch,
                "step_time_ratio": _ratio(r.get("median_step_time_s"), first.median_step_time_s),
                "epoch_time_ratio": _ratio(r.get("time_per_epoch_s"), first.time_per_epoch_s),
                "steps_ratio": _ratio(r.get("steps_to_target"), first.steps_to_target),
                "time_to_target_ratio": _ratio(r.get("compute_time_to_target_s"), first.compute_time_to_target_s)})
    return pd.DataFrame(out)


def _ratio(after: Any, before: Any) -> float | None:
    if _nan(after) or _nan(before) or not before:
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
    if ratio is None or _nan(ratio):
        return f"{noun} not measured at both ends"
    if 1 - SAME <= ratio <= 1 + SAME:
        return f"{noun} stayed within {abs(ratio - 1) * 100:.0f}%"
    return f"{noun} {'grew' if ratio > 1 else 'fell'} {ratio if ratio > 1 else 1 / ratio:.2f}x"


def growth_sentences(results: pd.DataFrame) -> list[str]:
    """One statement per way and strategy (smallest -> largest batch), then the answer per way,
    read on stage 0 (what data parallelism does) and on plain PyTorch where it ran."""
    out = []
    for way, words in WAYS.items():
        table = growth_table(results, way)
        if table.empty:
            continue
        answers = []
        for strategy, group in table.groupby("strategy", sort=False):
            if len(group) < 2:
                continue
            first, last = group.iloc[0], group.iloc[-1]
            per_rank = [int(r.micro_batch * r.grad_accum) for r in (first, last)]
            how = (f"{int(first.world_size)} -> {int(last.world_size)} ranks at micro-batch {int(first.micro_batch)}"
                   if way == "ranks" else
                   f"micro-batch {per_rank[0]} -> {per_rank[1]} on {int(first.world_size)} rank(s)")
            steps = ("" if _nan(first.steps_to_target) or _nan(last.steps_to_target) else
                     f" ({int(first.steps_to_target)} -> {int(last.steps_to_target)} steps)")
            out.append(f"Growth by {words}, {label(strategy)}: global batch {int(first.global_batch)} -> "
                       f"{int(last.global_batch)} ({how}): {_change(last.step_time_ratio, 'time per step')}, "
                       f"{_change(last.epoch_time_ratio, 'time per epoch')}, "
                       f"{_change(last.time_to_target_ratio, 'time to the target eval loss')}{steps}.")
            answers.append((strategy, last.time_to_target_ratio))
        base = {s: r for s, r in answers if not _nan(r)}
        if "z0" in base:
            verdict = "yes" if base["z0"] <= 1 + SAME else "no"
            out.insert(len(out) - len(answers), (
                f"Answer for {words}: {verdict} with plain data parallelism (ZeRO stage 0): time to the same eval "
                f"loss changed {base['z0']:.2f}x from the smallest to the largest batch"
                + (f"; plain PyTorch: {base['torch']:.2f}x" if base.get("torch") is not None else "") + "."))
    return out


def credit_sentences(results: pd.DataFrame, maxbatch: pd.DataFrame | None = None) -> list[str]:
    """What ZeRO (stages 1-3, offload) did beyond stage 0, stated as what it changes."""
    out = []
    credit = credit_table(results)
    for way, words in WAYS.items():
        table = growth_table(results, way)
        if table.empty:
            continue
        last = table.groupby("strategy").last()
        z0 = last.time_to_target_ratio.get("z0") if "z0" in last.index else None
        if z0 is None or _nan(z0):
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
            if ratio is None or _nan(ratio) or strategy not in span.index or span.loc[strategy, "size"] < 2:
                continue
            if tuple(span.loc[strategy, ["min", "max"]]) != tuple(span.loc["z0", ["min", "max"]]):
                continue
            bucket = same if abs(ratio / z0 - 1) <= SAME else (better if ratio < z0 else worse)
            text = f"{label(strategy)} {ratio:.2f}x"
            if bucket is better:
                # A smaller ratio can come from a slower start (a fixed per-step cost that a bigger batch
                # amortizes): say where it ends against stage 0, not only how far it fell.
                versus = _ratio(last.compute_time_to_target_s.get(strategy), last.compute_time_to_target_s.get("z0"))
                if versus is not None and not _nan(versus):
                    text += f" (at the largest batch still {versus:.2f}x stage 0's time to target)"
            bucket.append(text)
        if same or worse or better:
            text = (f"Credit ({words}): stage 0 alone changed the time to target {z0:.2f}x; "
                    + (f"{', '.join(same)} changed it by the same factor (within {SAME:.0%}): that change belongs "
                       "to the bigger batch and data parallelism, not to ZeRO" if same else "")
                    + ("; " if same and (better or worse) else "")
                    + (f"{', '.join(better)} fell further than stage 0" if better else "")
                    + ("; " if better and worse else "")
                    + (f"{', '.join(worse)} did worse than stage 0 (its per-step cost grew with the batch)"
                       if worse else ""))
            out.append(text + ".")
    if not credit.empty and "step_time_vs_z0" in credit:
        parts = []
        for strategy, rows in credit[credit.step_time_vs_z0.notna()].groupby("strategy", sort=False):
            ratios = rows.step_time_vs_z0
            low, high = f"{ratios.min():.2f}", f"{ratios.max():.2f}"
            parts.append(f"{label(strategy)} {low}x" if low == high else f"{label(strategy)} {low}-{high}x")
        if parts:
            out.append("Cost per step of ZeRO against stage 0 at the same per-rank micro-batch and ranks (step time "
                       "ratio over the points measured): " + "; ".join(parts) + ".")
    if not credit.empty and "step_time_vs_torch" in credit:
        one = credit[(credit.strategy == "z0") & (credit.world_size == 1) & credit.step_time_vs_torch.notna()]
        for r in one.itertuples():
            out.append(f"DeepSpeed's engine at stage 0 on one rank against the plain PyTorch loop at the same "
                       f"micro-batch {r.micro_batch}: {r.step_time_vs_torch:.2f}x the step time (both timed alone, "
                       "same threads per rank).")
    fits = _maxbatch_credit(maxbatch)
    if fits:
        out.append(fits)
    return out


def _maxbatch_credit(maxbatch: pd.DataFrame | None) -> str | None:
    """The largest micro-batch per rank of each ZeRO strategy against stage 0 at the same ranks."""
    if maxbatch is None or maxbatch.empty or "max_micro_batch" not in maxbatch:
        return None
    from labkit.study.maxbatch import memory_bound

    maxbatch = memory_bound(maxbatch)  # a search capped short of memory gives no ratio
    rows = {(r.strategy, int(r.world_size)): int(r.max_micro_batch) for r in maxbatch.itertuples()
            if not _nan(r.max_micro_batch)}
    parts = []
    torch = rows.get(("torch", 1))
    for (strategy, ranks), fit in rows.items():
        if strategy in ZERO and rows.get(("z0", ranks)):
            parts.append(f"{label(strategy)} fits {fit} per rank where stage 0 fits {rows[('z0', ranks)]} on the same "
                         f"{ranks} ranks ({fit / rows[('z0', ranks)]:.2f}x)")
        elif strategy in ZERO and torch:
            # Stage 0 keeps the same unpartitioned fp32 params, grads and Adam states per rank as plain PyTorch.
            parts.append(f"{label(strategy)} fits {fit} per rank on {ranks} ranks where plain PyTorch (the same "
                         f"unpartitioned states per rank as stage 0) fits {torch} ({fit / torch:.2f}x)")
    if torch and any(s == "z0" for s, _ in rows):
        z0 = next(v for (s, _), v in rows.items() if s == "z0")
        parts.append(f"plain PyTorch fits {torch} on one process, stage 0 {z0} per rank: without partitioning the "
                     "per-rank limit is the same, more ranks only multiply the global batch")
    if not parts:
        return None
    return "What ZeRO changes: the largest micro-batch that fits per rank: " + "; ".join(parts) + "."


def critical_batch(results: pd.DataFrame, study_strategy: str | None = None) -> dict[str, Any] | None:
    """B_crit from the LR study's best steps per global batch (weighted fit, bootstrap interval)."""
    from labkit.study.noise_scale import critical_batch_fit

    finished = results[(results.status == "finished") & results.steps_to_target.notna()]
    if finished.empty:
        return None
    if study_strategy is None:
        counts = finished.groupby("strategy").lr_scaling.nunique()
        study_strategy = counts.idxmax()
    study = finished[finished.strategy == study_strategy]
    if "growth" in study:
        study = study[study.growth.map(lambda g: "micro_batch" in _ways(g))]
    best = study.loc[study.groupby("global_batch").steps_to_target.idxmin()].sort_values("global_batch")
    fit = critical_batch_fit(best.global_batch.tolist(), best.steps_to_target.tolist())
    if fit is None:
        return None
    return {**fit, "strategy": study_strategy, "batches": best.global_batch.tolist(),
            "steps": best.steps_to_target.tolist(), "lr_scalings": best.lr_scaling.tolist()}


def noise_spread(noise: pd.DataFrame | None, parts: int = 4) -> dict[str, Any] | None:
    """B_simple pooled over every probe, and over `parts` stretches of training ordered by falling
    training loss (early -> late): its spread over the run."""
    from labkit.study.noise_scale import noise_scale_spread

    if noise is None or noise.empty:
        return None
    ordered = noise.sort_values("loss", ascending=False)
    return noise_scale_spread(list(ordered[["grad_norm_small_sq", "grad_norm_big_sq", "noise_b_small",
                                            "noise_b_big"]].itertuples(index=False, name=None)), parts)

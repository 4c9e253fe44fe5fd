"""The answer's HTML report: the answer card first, then plots, tables and conclusions computed from the
measured numbers.

`build_report(results, path, ...)` writes one self-contained HTML file (plotly.js embedded,
so it opens offline). It opens with the answer card (`labkit.study.card`); every sentence after it is
produced by `conclusions(...)` (or under a figure by `labkit.study.growth.growth_sentences`) from the
tables it is given: nothing in the text is a hard-coded result.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from labkit.study.noise_scale import aggregate, critical_batch_from_steps

# report.label, .grid, .lr_study and .best_steps stay the names notebooks 04 and 04a use
from labkit.study.tables import best_steps, grid, grid_scaling, is_nan, label, lr_study, with_compute_time  # noqa: F401

COLORS = {"torch": "#636efa", "z0": "#ef553b", "z1": "#ab63fa", "z2": "#00cc96", "z3": "#ffa15a",
          "z2-offload": "#19d3f3", "z3-offload": "#ff6692"}
TABLE_COLUMNS = ["strategy", "growth", "world_size", "threads_per_rank", "concurrent_runs", "micro_batch",
                 "grad_accum", "global_batch", "lr_scaling", "status", "median_step_time_s", "samples_per_s",
                 "time_per_epoch_s", "steps_to_target", "compute_time_to_target_s", "train_time_to_target_s",
                 "time_to_target_s", "final_loss", "eval_loss", "model_state_bytes", "activation_bytes",
                 "device_bytes", "peak_rss_bytes", "noise_scale", "run_id"]


# -- where the results come from -------------------------------------------------------------------
def _device_kind(accelerator: Any, device: Any) -> str:
    """'cpu' for every CPU (the CPU model is not a device kind), else accelerator + device name."""
    accelerator = str(accelerator or "unknown")
    return "cpu" if accelerator == "cpu" else f"{accelerator}: {device or 'unknown device'}"


def provenance_banner(machine: dict[str, Any] | None, devices: Any, *, profile: str | None = None) -> str | None:
    """A warning when the results were measured on another device kind than this machine's, else None.

    `machine`: the results' machine.json (None: unknown origin, which is said too).  `devices`: this
    machine's `labkit.runtime.devices.Devices` (`detect_devices()`).  `profile`: the profile the reader asked for;
    results of another profile (notebook 04 falling back to data/reference-ci) are said as well.  Plain
    text: `build_report` puts it at the report's top, notebook 04 prints it above its first table.
    """
    here = _device_kind(devices.accelerator, devices.device_name)
    count_here = f"{devices.device_count} x " if not devices.is_cpu else ""
    if not machine:
        return (f"These results carry no machine.json: where they were measured is unknown. This machine has "
                f"{count_here}{here}.")
    there = _device_kind(machine.get("accelerator"), machine.get("device"))
    parts = []
    if there != here:
        count_there = f"{machine.get('devices')} x " if there != "cpu" and machine.get("devices") else ""
        parts.append(f"These results were measured on {count_there}{there} ({machine.get('cpu_cores')} CPU cores, "
                     f"{machine.get('date')}), not on this machine's {count_here}{here}: their times, memory and "
                     "out-of-memory boundaries are that machine's"
                     + (" (on CPU an emulated device capacity), and say nothing about this device"
                        if there == "cpu" else "")
                     + ". Run `python -m labkit answer` with a profile for this machine to measure here.")
    if profile is not None and machine.get("profile") not in (None, profile):
        parts.append(f"They are the '{machine.get('profile')}' profile's results, not the '{profile}' profile's "
                     "that were asked for (none were found).")
    return " ".join(parts) or None


def _banner_html(machine: dict[str, Any] | None, devices: Any, profile: dict[str, Any] | None) -> str:
    untested = [n for n in (profile or {}).get("notes") or () if "untested" in str(n).lower()]
    text = " ".join(filter(None, [provenance_banner(machine, devices) if devices is not None else None, *untested]))
    return (f"<p class='banner' style='background:#fff3cd;border:1px solid #e0b252;padding:.6em'>"
            f"<b>Note:</b> {html.escape(text)}</p>" if text else "")


def require_growth(results: pd.DataFrame, profile: dict[str, Any] | None = None) -> None:
    """ValueError unless `results` has the `growth` column every results.csv of labkit.study.sweep has: the
    report reads each way of growing the batch from it, and an older labkit's table has none."""
    if "growth" in results:
        return
    name = (profile or {}).get("name")
    raise ValueError(
        "results.csv has no `growth` column: it was written by an older labkit, before the sweep recorded which "
        "way each point grows the batch (ranks, micro_batch, grad_accum), and the report is built from that column. "
        f"Re-run `python -m labkit answer{f' --profile {name}' if name else ' --profile NAME'}` (its points are "
        "measured again) and build the report from the results.csv it writes.")


# -- small helpers ---------------------------------------------------------------------------------
def mb(value: float | None) -> str:
    return "n/a" if value is None or is_nan(value) else f"{value / 1e6:.2f} MB"


def times(ratio: float) -> str:
    return f"{ratio:.1f}x" if ratio >= 1.95 or ratio <= 0.55 else f"{ratio:.2f}x"


# -- conclusions -----------------------------------------------------------------------------------
def conclusions(results: pd.DataFrame, *, maxbatch: pd.DataFrame | None = None, memory: pd.DataFrame | None = None,
                activation: pd.DataFrame | None = None, noise: pd.DataFrame | None = None,
                machine: dict[str, Any] | None = None, profile: dict[str, Any] | None = None) -> list[str]:
    """Plain-text statements, each computed from the tables (skipped when its data is missing). The answer per
    way of growing the batch, and ZeRO's room and cost per step, are the card's (`labkit.study.card`), not here."""
    from labkit.study import growth

    require_growth(results, profile)
    out: list[str] = []
    table = grid(results, profile)

    # 1-2. What ZeRO did to the time to target beyond stage 0 over the same growth.
    out.extend(growth.credit_sentences(results))

    # 3. Out of memory, compared only at the same per-rank micro-batch and the same ranks.
    ooms = table[table.status == "oom"]
    if not ooms.empty:
        capacity = _capacity_text(table, machine)
        for (ranks, micro), rows in ooms.groupby(["world_size", "micro_batch"]):
            same = table[(table.world_size == ranks) & (table.micro_batch == micro) & (table.status == "finished")]
            fit = same.strategy.tolist()
            out.append(f"At micro-batch {int(micro)} per rank on {int(ranks)} rank(s), "
                       f"{', '.join(label(s) for s in rows.strategy)} ran out of memory ({capacity})"
                       + (f" while {', '.join(label(s) for s in fit)} fit at the same micro-batch and ranks."
                          if fit else "."))

    # 4. Max-batch search.
    if maxbatch is not None and not maxbatch.empty:
        out.extend(_maxbatch_text(maxbatch, machine))

    # 5. Gradient noise scale and critical batch.
    out.extend(_noise_text(results, noise, profile))

    # 6. Memory model and activation estimate.
    if memory is not None and not memory.empty:
        out.extend(_memory_text(memory))
    if activation is not None and not activation.empty:
        per_sample = activation.groupby("strategy").per_sample_bytes.first()
        others = activation[activation.micro_batch != activation.profile_micro_batch]
        text = (f"Activations: one measured micro-batch profile gives {per_sample.min() / 1e3:.2f}-"
                f"{per_sample.max() / 1e3:.2f} kB per sample")
        if not others.empty:
            worst = others.loc[others.error.abs().idxmax()]
            text += (f"; scaling it linearly predicted the activation bytes measured at {len(others)} other "
                     f"micro-batch sizes within {abs(worst.error) * 100:.1f}% (worst: {label(worst.strategy)} at "
                     f"micro-batch {int(worst.micro_batch)}, profiled at {int(worst.profile_micro_batch)})")
        out.append(text + ".")

    # 7. How the numbers were taken.
    if machine:
        load = machine.get("load_average_at_start") or machine.get("load_average")
        text = (f"Measured on {machine.get('device') or machine.get('cpu_model')} ({machine.get('cpu_cores')} cores"
                + (f", load average {load[0]:.1f} at the start" if load else "") + "), ")
        if "concurrent_runs" in results and results.concurrent_runs.notna().any():
            beside = int(results.concurrent_runs.max())
            threads = sorted({int(t) for t in results.get("threads_per_rank", pd.Series(dtype=float)).dropna()})
            text += (("every timed run alone (concurrent_runs 0 for every row)" if beside == 0 else
                      f"up to {beside} other run(s) beside a timed one: those step times are confounded")
                     + (f", {', '.join(map(str, threads))} thread(s) per CPU rank" if threads else "")
                     + "; compare step times within this report, not across machines.")
        else:
            text += (f"{machine.get('parallel', 1)} run(s) at a time: step times of concurrent runs share the cores, "
                     "so compare them within this report, not across machines.")
        out.append(text)
    return out


def _capacity_text(table: pd.DataFrame, machine: dict[str, Any] | None) -> str:
    budget = table.device_budget_bytes.dropna()
    if not budget.empty:
        return f"emulated device capacity {mb(budget.iloc[0])} per rank"
    memory_bytes = machine.get("device_memory_bytes") if machine else None
    return f"real device memory{' of ' + mb(memory_bytes) if memory_bytes else ''}"


def _maxbatch_text(maxbatch: pd.DataFrame, machine: dict[str, Any] | None) -> list[str]:
    out = []
    rows = maxbatch.sort_values("max_micro_batch")
    parts = [f"{label(r.strategy)} x{int(r.world_size)}: {_bracket(r)} in {int(r.launches)} launches"
             for r in rows.itertuples()]
    emulated = bool(rows.emulated_capacity.iloc[0])
    capacity = (f"an emulated device capacity of {mb(rows.budget_bytes.iloc[0])} per rank" if emulated
                else "the real device memory")
    out.append(f"Largest micro-batch that fits {capacity} (doubling, then bisection): " + "; ".join(parts) + ".")
    from labkit.study.maxbatch import capped_sentences, memory_bound

    out.extend(capped_sentences(rows))
    rows = memory_bound(rows)  # the ratio only between boundaries memory set
    if len(rows) >= 2 and rows.max_micro_batch.iloc[0] > 0:
        low, high = rows.iloc[0], rows.iloc[-1]
        out.append(f"{label(high.strategy)} fits {times(high.max_micro_batch / low.max_micro_batch)} "
                   "the micro-batch of "
                   f"{label(low.strategy)}; the search took {int(maxbatch.launches.sum())} launches for "
                   f"{len(maxbatch)} strategies ({maxbatch.launches.mean():.1f} each). DeepSpeed's Autotuner needs a "
                   "profiling run plus, per ZeRO stage, a min-batch run, up to 3 runs around its computed maximum, a "
                   "binary search and a list of micro-batch sizes to time (more when it also tunes ZeRO knobs): see "
                   "docs/answer.md.")
    checked = rows[rows.consistent.notna()] if "consistent" in rows else rows.iloc[0:0]
    if not checked.empty:
        good = checked[checked.consistent.astype(str) == "True"]
        predicted = [f"{label(r.strategy)} {int(r.predicted_max_micro_batch)}" for r in checked.itertuples()
                     if not is_nan(r.predicted_max_micro_batch)]
        analytic = [f"{label(r.strategy)} {int(r.analytic_max_micro_batch)}" for r in checked.itertuples()
                    if "analytic_max_micro_batch" in checked and not is_nan(r.analytic_max_micro_batch)]
        out.append(f"The boundaries agree with the memory numbers for {len(good)} of {len(checked)} strategies "
                   "(states + activations counted at the largest fit stay within the capacity, "
                   "the first OOM exceeds it)"
                   + (f"; the linear activation fit predicts {', '.join(predicted)}" if predicted else "")
                   + ("; labkit.core.memory's analytic states plus one activation profile predict "
                      f"{', '.join(analytic)}"
                      if analytic else "") + ".")
    return out


def _bracket(r: Any) -> str:
    """Where the search left the boundary: the largest micro-batch that fit and the first that
    ran out of memory (the search stops within its tolerance, not always at adjacent sizes)."""
    fit, ranks = int(r.max_micro_batch), int(r.world_size)
    capped = getattr(r, "capped_by", None)
    if isinstance(capped, str) and capped:
        return f"at least {fit} per rank ({fit * ranks} global; capped by {capped}, not memory)"
    if is_nan(getattr(r, "first_oom", None)):
        return f"at least {fit} per rank ({fit * ranks} global; no OOM up to the search's limit)"
    oom = int(r.first_oom)
    if oom == fit + 1:
        return f"{fit} per rank ({fit * ranks} global; {oom} ran out of memory)"
    return (f"largest fit {fit}, first OOM {oom} per rank (the boundary lies in {fit}-{oom - 1}; "
            f"{fit * ranks} global fit)")


def pooled_noise(noise: pd.DataFrame | None) -> Any:
    if noise is None or noise.empty:
        return None
    return aggregate(noise[["grad_norm_small_sq", "grad_norm_big_sq", "noise_b_small", "noise_b_big"]]
                     .itertuples(index=False, name=None))


def _noise_text(results: pd.DataFrame, noise: pd.DataFrame | None, profile: dict[str, Any] | None) -> list[str]:
    from labkit.study.growth import critical_batch, noise_spread

    out = []
    spread = noise_spread(noise)
    strategy, study = lr_study(results)
    fit = critical_batch(results, strategy) if strategy is not None else None
    if strategy is not None:
        best = best_steps(study)
        parts = []
        for batch, rows in study.sort_values("global_batch").groupby("global_batch"):
            tried = ", ".join(f"{r.lr_scaling} {'not reached' if is_nan(r.steps_to_target) else int(r.steps_to_target)}"
                              for r in rows.sort_values("lr_scaling").itertuples())
            winner = best[best.global_batch == batch]
            best_rule = f" (best {winner.lr_scaling.iloc[0]})" if not winner.empty else ""
            parts.append(f"{int(batch)}: {tried}{best_rule}")
        warmup = (f"warmup {int(study.warmup_samples.iloc[0])} samples" if "warmup_samples" in study
                  and not is_nan(study.warmup_samples.iloc[0]) and study.warmup_samples.iloc[0] else
                  f"warmup {int(study.warmup_steps.iloc[0])} steps")
        out.append(f"LR study ({label(strategy)}, every global batch, {warmup}): steps to the target by scaling rule "
                   "at global batch " + "; ".join(parts) + ".")
        if len(best) >= 2:
            first, last = best.iloc[0], best.iloc[-1]
            factor = last.global_batch / first.global_batch
            gain = first.steps_to_target / last.steps_to_target
            out.append(f"With the best LR scaling per batch, {int(factor)}x the batch ({int(first.global_batch)} -> "
                       f"{int(last.global_batch)}) cut the steps to target {gain:.1f}x "
                       f"(perfect scaling: {int(factor)}x), "
                       f"i.e. {100 * gain / factor:.0f}% of the ideal step saving.")
    if spread is not None:
        out.append(f"Gradient noise scale B_simple = tr(Sigma)/|G|^2 ~ {spread['b_simple']:.0f} samples "
                   f"(McCandlish et al. 2018, unbiased two-batch estimator, pooled over {spread['probes']} probes); "
                   f"over the run (probes in {len(spread['b_simple_parts'])} stretches of falling training loss) it "
                   f"ranged {spread['b_simple_low']:.0f}-{spread['b_simple_high']:.0f} ("
                   + " -> ".join(f"{v:.0f}" for v in spread["b_simple_parts"]) + "). It estimates the critical batch "
                   "size: far below it a doubling of the batch nearly halves the steps (at B_crit/2 it saves a third, "
                   "at B_crit a quarter), far above it the saving fades.")
    if fit:
        placement = fit["placement"]
        text = (f"Fitting steps-to-target S(B) = S_min (1 + B_crit/B) (weighted least squares, weights 1/S^2) to the "
                f"best-LR steps at {fit['n_batches']} global batches ({', '.join(str(b) for b in fit['batches'])}): "
                f"{placement['text']}")
        if spread is not None and placement["placed"]:
            ratio = fit["b_crit"] / spread["b_simple"]
            text += (f", {'consistent with' if 0.33 <= ratio <= 3 else 'unlike'} the noise-scale estimate "
                     f"({ratio:.1f}x)")
        out.append(text + ".")
    return out


def _memory_text(memory: pd.DataFrame) -> list[str]:
    out = []
    errors = {k: memory[f"error_{k}"].abs() for k in ("param_bytes", "grad_bytes", "optim_bytes")
              if f"error_{k}" in memory}
    if errors:
        within = [k.replace("_bytes", "") for k, e in errors.items() if e.max() <= 0.05]
        off = memory[memory.get("error_grad_bytes", pd.Series(0.0, index=memory.index)).abs() > 0.05]
        text = ("Memory model (labkit.core.memory, ZeRO paper Sec. 3 adapted to DeepSpeed 0.19.8) vs the "
                "per-rank census: "
                + (f"{', '.join(within)} bytes within 5% for every strategy" if within
                   else "no state within 5% everywhere"))
        worst = {k.replace("_bytes", ""): e.max() for k, e in errors.items() if e.max() > 0.05}
        if worst:
            text += "; largest deviations " + ", ".join(f"{k} {v * 100:.0f}%" for k, v in worst.items())
        if not off.empty:
            # The partition layout explains a grad deviation only where predicting with it lands close.
            layout = off.get("error_layout_grad_bytes", pd.Series(float("nan"), index=off.index)).abs()
            explained, unexplained = off[layout <= 0.05], off[~(layout <= 0.05)]
            notes = []
            if not explained.empty:
                notes.append(f"grads at {', '.join(label(s) for s in explained.strategy)}: DeepSpeed keeps the whole "
                             "gradient of a parameter that straddles the partition boundary, the paper's Psi/N assumes "
                             "an exact split; predicted with that layout "
                             "(labkit.core.memory.zero12_grad_elements) they are "
                             f"within {layout[explained.index].max() * 100:.1f}%")
            if not unexplained.empty:
                notes.append(f"grads at {', '.join(label(s) for s in unexplained.strategy)}: not explained by the "
                             "partition layout")
            text += " (" + "; ".join(notes) + ")"
        out.append(text + ".")
    stage0 = memory[(memory.stage == 0) & (memory.world_size > 1)]
    stage3 = memory[(memory.stage == 3) & (~memory.offload_optimizer.astype(bool))]
    if not stage0.empty and not stage3.empty:
        ratio = stage0.measured_device_bytes.iloc[0] / stage3.measured_device_bytes.iloc[0]
        text = (f"Measured model states on the device per rank: {mb(stage0.measured_device_bytes.iloc[0])} at ZeRO-0 "
                f"vs {mb(stage3.measured_device_bytes.iloc[0])} at ZeRO-3 with {int(stage3.world_size.iloc[0])} ranks "
                f"({times(ratio)} less")
        persistent = stage3.get("persistent_params", pd.Series(dtype=float)).dropna()
        if not persistent.empty and persistent.iloc[0] > 0:
            text += (f"; {int(persistent.iloc[0])} parameters in small tensors stay whole on every rank under "
                     "ZeRO-3's persistence threshold")
        out.append(text + ").")
    if "deepspeed_estimate_device_bytes" in memory:
        estimated = memory[memory.deepspeed_estimate_device_bytes.notna()]
        if not estimated.empty:
            parts = [f"{label(r.strategy)} {mb(r.deepspeed_estimate_device_bytes)} vs {mb(r.measured_device_bytes)} "
                     "measured" for r in estimated.itertuples()]
            out.append("DeepSpeed's own estimates (assume fp16 mixed precision and count the fp32 gradient partition "
                       "built during step): " + "; ".join(parts) + ".")
    return out


# -- figures ---------------------------------------------------------------------------------------
def figures(results: pd.DataFrame, *, maxbatch: pd.DataFrame | None = None, probes: pd.DataFrame | None = None,
            memory: pd.DataFrame | None = None, activation: pd.DataFrame | None = None,
            noise: pd.DataFrame | None = None, profile: dict[str, Any] | None = None) -> list[tuple[str, Any]]:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    require_growth(results, profile)
    figs = _growth_figures(results, go, make_subplots)
    figs.extend(_study_figures(results, noise, memory, probes, activation, go))
    for _, fig in figs:
        fig.update_layout(height=420, margin={"l": 50, "r": 20, "t": 50, "b": 40}, template="plotly_white")
    return figs


def _growth_figures(results: pd.DataFrame, go: Any, make_subplots: Any) -> list[tuple[str, Any]]:
    """Per way of growing the batch: time per step, per epoch and to the target vs global batch;
    then every ZeRO point's step time against stage 0 and plain PyTorch at the same micro-batch and ranks."""
    from labkit.study import growth

    figs = []
    keys = (("median_step_time_s", "time per step (s)"), ("time_per_epoch_s", "time per epoch (s)"),
            ("compute_time_to_target_s", "time to target eval loss (s)"))
    for way, words in growth.WAYS.items():
        table = growth.growth_table(results, way)
        if table.empty:
            continue
        fig = make_subplots(rows=1, cols=3, subplot_titles=[t for _, t in keys])
        for strategy, rows in table.groupby("strategy", sort=False):
            text = [f"{int(w)} rank(s) x micro {int(m)}" + (f" x accumulation {int(a)}" if a > 1 else "")
                    for w, m, a in zip(rows.world_size, rows.micro_batch, rows.grad_accum, strict=True)]
            for col, (key, _) in enumerate(keys, start=1):
                fig.add_trace(go.Scatter(x=rows.global_batch, y=rows[key].astype(float).round(5), text=text,
                                         mode="lines+markers", name=label(strategy), legendgroup=strategy,
                                         showlegend=col == 1, line={"color": COLORS.get(strategy)}), row=1, col=col)
        fig.update_xaxes(type="log", title_text="global batch")
        figs.append((f"Growing the batch by {words}", fig))
    credit = growth.credit_table(results)
    if not credit.empty and "step_time_vs_z0" in credit:
        fig = go.Figure()
        for name, key in (("vs ZeRO-0 (same micro-batch, same ranks)", "step_time_vs_z0"),
                          ("vs plain PyTorch (same micro-batch, 1 process)", "step_time_vs_torch")):
            if key not in credit:
                continue
            rows = credit[credit[key].notna()]
            fig.add_trace(go.Bar(x=[f"{label(r.strategy)} x{r.world_size} micro {r.micro_batch}"
                                    for r in rows.itertuples()], y=rows[key].round(3), name=name))
        fig.add_hline(y=1.0, line_dash="dot")
        fig.update_yaxes(title_text="step time ratio")
        figs.append(("Credit: each DeepSpeed point's step time against stage 0 and plain PyTorch", fig))
    return figs


def _study_figures(results: pd.DataFrame, noise: pd.DataFrame | None, memory: pd.DataFrame | None,
                   probes: pd.DataFrame | None, activation: pd.DataFrame | None, go: Any) -> list[tuple[str, Any]]:
    figs = []
    strategy, study = lr_study(results)
    pooled = pooled_noise(noise)
    if strategy is not None:
        fig = go.Figure()
        for scaling, rows in study.sort_values("global_batch").groupby("lr_scaling"):
            fig.add_trace(go.Scatter(x=rows.global_batch, y=rows.steps_to_target, mode="lines+markers",
                                     name=f"LR scaling {scaling}"))
        best = best_steps(study)
        from labkit.study.growth import critical_batch

        unweighted = critical_batch_from_steps(best.global_batch.tolist(), best.steps_to_target.tolist())
        weighted = critical_batch(results, strategy)
        fit: dict[str, Any] | None = {**unweighted, **weighted} if unweighted and weighted else unweighted
        if fit:
            xs = [best.global_batch.min() * (best.global_batch.max() / best.global_batch.min()) ** (i / 40)
                  for i in range(41)]
            placed = bool(weighted and weighted["placement"]["placed"])
            fig.add_trace(go.Scatter(x=xs, y=[fit["s_min"] * (1 + fit["b_crit"] / x) for x in xs], mode="lines",
                                     line={"dash": "dot"}, name=f"fit S_min(1+B_crit/B), B_crit~{fit['b_crit']:.0f}"
                                     + ("" if placed else " (not placed by these data)")))
            if best.global_batch.min() <= fit["b_crit"] <= best.global_batch.max():
                _vline_on_log_x(fig, fit["b_crit"], "dot", "B_crit (fit)" if placed else "B_crit (fit, not placed)")
        if pooled and pooled.b_simple:
            _vline_on_log_x(fig, pooled.b_simple, "dash", "B_simple (noise scale)")
        fig.update_xaxes(type="log", title_text="global batch")
        fig.update_yaxes(type="log", title_text="steps to target")
        figs.append((f"LR scaling and critical batch ({label(strategy)})", fig))

    if noise is not None and not noise.empty:
        frame = noise.copy()
        frame["bin"] = pd.qcut(frame.loss, q=min(8, max(1, len(frame) // 6)), duplicates="drop")
        xs, ys = [], []
        for interval, rows in frame.groupby("bin", observed=True):
            estimate = pooled_noise(rows)
            if estimate and estimate.b_simple:
                xs.append(round(float(interval.mid), 4))
                ys.append(round(estimate.b_simple, 1))
        fig = go.Figure(go.Scatter(x=xs, y=ys, mode="lines+markers", name="B_simple (pooled per loss bin)"))
        if pooled and pooled.b_simple:
            fig.add_hline(y=pooled.b_simple, line_dash="dash", annotation_text=f"pooled {pooled.b_simple:.0f}")
        fig.update_xaxes(title_text="training loss", autorange="reversed")
        fig.update_yaxes(title_text="B_simple (samples)")
        figs.append(("Gradient noise scale during training", fig))

    if memory is not None and not memory.empty:
        fig = go.Figure()
        names = [label(s) for s in memory.strategy]
        for key, title in (("param_bytes", "params"), ("grad_bytes", "grads"), ("optim_master_bytes", "optim+master")):
            fig.add_trace(go.Bar(x=names, y=memory[f"measured_{key}"] / 1e6, name=f"measured {title}",
                                 offsetgroup="measured"))
        base = [0.0] * len(memory)
        for key, title in (("param_bytes", "params"), ("grad_bytes", "grads"), ("optim_bytes", "optim+master")):
            values = (memory[f"predicted_{key}"] / 1e6).tolist()
            fig.add_trace(go.Bar(x=names, y=values, base=base, name=f"predicted {title}", offsetgroup="predicted",
                                 marker_pattern_shape="/"))
            base = [b + v for b, v in zip(base, values, strict=True)]
        if "deepspeed_estimate_device_bytes" in memory:
            fig.add_trace(go.Scatter(x=names, y=memory.deepspeed_estimate_device_bytes / 1e6, mode="markers",
                                     marker={"symbol": "diamond", "size": 12}, name="DeepSpeed estimate (device)"))
        fig.update_layout(barmode="stack")
        fig.update_yaxes(title_text="MB per rank")
        figs.append(("Model states per rank: measured vs labkit.core.memory vs DeepSpeed's estimate", fig))

    if probes is not None and not probes.empty:
        fig = go.Figure()
        for strategy, rows in probes.groupby("strategy"):
            fig.add_trace(go.Scatter(x=rows.micro_batch, y=rows.device_bytes / 1e6, mode="markers+text",
                                     text=rows.order, textposition="top center", name=label(strategy),
                                     marker={"color": COLORS.get(strategy), "size": 10,
                                             "symbol": ["circle" if s == "finished" else "x" for s in rows.status]}))
        budget = probes.budget_bytes.dropna()
        if not budget.empty:
            fig.add_hline(y=budget.iloc[0] / 1e6, line_dash="dash", annotation_text="emulated device capacity")
        fig.update_xaxes(title_text="micro-batch per rank")
        fig.update_yaxes(title_text="on-device MB per rank (states + activations)")
        figs.append(("Max-batch search: every launch (number = order, x = out of memory)", fig))

    if activation is not None and not activation.empty:
        fig = go.Figure()
        for strategy, rows in activation.groupby("strategy"):
            fig.add_trace(go.Scatter(x=rows.micro_batch, y=rows.measured_activation_bytes / 1e6, mode="markers",
                                     name=f"{label(strategy)} measured", marker={"color": COLORS.get(strategy)}))
            fig.add_trace(go.Scatter(x=rows.micro_batch, y=rows.predicted_activation_bytes / 1e6, mode="lines",
                                     name=f"{label(strategy)} from 1 profile",
                                     line={"color": COLORS.get(strategy), "dash": "dot"}))
        fig.update_xaxes(type="log", title_text="micro-batch per rank")
        fig.update_yaxes(type="log", title_text="activation MB per rank")
        figs.append(("Activation memory: measured vs a one-profile linear estimate", fig))
    return figs


def _vline_on_log_x(fig: Any, x: float, dash: str, text: str) -> None:
    """A labelled vertical line at data value ``x`` on a figure's log x axis.

    Plotly.js takes a shape's x0/x1 on a log axis in data units but an annotation's x in log10 units, and
    ``add_vline(annotation_text=...)`` gives both the data value: the label then sits at 10**x and drags
    the autorange there (an axis from 1 to 10^279).  So the line is a shape and the label is placed at log10(x).
    """
    fig.add_vline(x=x, line_dash=dash)
    fig.add_annotation(x=math.log10(x), xref="x", y=1, yref="y domain", yanchor="bottom", text=text, showarrow=False)


# -- the page --------------------------------------------------------------------------------------
def build_report(results: pd.DataFrame, path: str | Path, *, maxbatch: pd.DataFrame | None = None,
                 probes: pd.DataFrame | None = None, memory: pd.DataFrame | None = None,
                 activation: pd.DataFrame | None = None, noise: pd.DataFrame | None = None,
                 machine: dict[str, Any] | None = None, profile: dict[str, Any] | None = None,
                 devices: Any = "detect", card: dict[str, Any] | None = None,
                 sections: Sequence[str] = ()) -> Path:
    """Write the report and return its path. It opens with the answer card (`card`; None: built here from the
    same tables, `labkit.study.card.build_card`). `sections`: HTML placed after the figures, before the tables.

    `devices`: the machine the report is written on (`labkit.runtime.devices.Devices`; default: detected), compared with
    `machine` for the banner above the title and the card (:func:`provenance_banner`); None: no comparison.
    A profile note that says "untested" goes in the banner too."""
    from plotly.offline import get_plotlyjs

    from labkit.core.files import write_text_atomic
    from labkit.study import card as answer_card
    from labkit.study.growth import WAYS, growth_sentences

    require_growth(results, profile)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(devices, str) and devices == "detect":
        from labkit.runtime.devices import detect_devices

        devices = detect_devices()
    if card is None:
        card = answer_card.build_card(results, maxbatch=maxbatch, noise=noise, machine=machine)
    statements = conclusions(results, maxbatch=maxbatch, memory=memory, activation=activation, noise=noise,
                             machine=machine, profile=profile)
    figs = figures(results, maxbatch=maxbatch, probes=probes, memory=memory, activation=activation, noise=noise,
                   profile=profile)
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>DeepSpeed Batch Lab: the answer</title>",
        f"<script type='text/javascript'>{get_plotlyjs()}</script>",
        "<style>body{font-family:system-ui,sans-serif;max-width:1200px;margin:auto;padding:1em;color:#222}"
        "table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}"
        "th{background:#f4f4f4}.note{color:#555;font-size:13px}li{margin:.3em 0}</style></head><body>",
        _banner_html(machine, devices, profile),  # where the numbers come from, before any of them
        "<h1>Can DeepSpeed keep training time flat while the batch size grows?</h1>",
        answer_card.card_html(card, "The answer card (answer_card.json)") if card else "",
        f"<p class='note'>{_header(machine, profile, results)}</p>",
        "<h2>More conclusions (computed from the measurements below)</h2><ul>",
        *[f"<li>{html.escape(s)}</li>" for s in statements],
        "</ul>",
    ]
    under = {f"Growing the batch by {words}": growth_sentences(results, way) for way, words in WAYS.items()}
    for number, (title, fig) in enumerate(figs):
        parts.append(f"<h2>{html.escape(title)}</h2>")
        # a fixed id (plotly draws a random one): the same tables rebuild the same page
        parts.append(fig.to_html(full_html=False, include_plotlyjs=False, config={"displaylogo": False},
                                 div_id=f"figure-{number}"))
        if under.get(title):
            parts.append("<ul>" + "".join(f"<li>{html.escape(s)}</li>" for s in under[title]) + "</ul>")
    parts += list(sections)  # ready-made HTML, e.g. labkit.study.predict.report_section
    parts.append("<h2>Results (results.csv)</h2>")
    parts.append(_html_table(results, [c for c in TABLE_COLUMNS if c in results]))
    if maxbatch is not None and not maxbatch.empty:
        parts += ["<h2>Max-batch search (maxbatch.csv)</h2>", _html_table(maxbatch, list(maxbatch.columns))]
    if memory is not None and not memory.empty:
        parts += ["<h2>Memory model comparison (memory.csv)</h2>", _html_table(memory, list(memory.columns))]
    parts.append(f"<p class='note'>{html.escape(_method_note(results))}</p></body></html>")
    write_text_atomic(path, "\n".join(parts))
    return path


def _header(machine: dict[str, Any] | None, profile: dict[str, Any] | None, results: pd.DataFrame) -> str:
    bits = []
    if profile:
        bits.append(f"profile <b>{html.escape(str(profile.get('name')))}</b>")
    if machine:
        bits.append(html.escape(f"{machine.get('cpu_model')} ({machine.get('cpu_cores')} cores, "
                                f"{(machine.get('ram_bytes') or 0) / 2**30:.0f} GiB RAM), accelerator "
                                f"{machine.get('accelerator')}, torch {machine.get('torch')}, deepspeed "
                                f"{machine.get('deepspeed')}, {machine.get('date')}"))
        if machine.get("answer_runtime_s"):
            bits.append(f"measured in {machine['answer_runtime_s']:.0f} s with {machine.get('launches', '?')} launches")
        if machine.get("report_regenerated"):
            rebuilt = html.escape(str(machine["report_regenerated"]))
            bits.append(f"this report rebuilt from those measurements on {rebuilt} (its sweep not measured again)")
    bits.append(f"{len(results)} sweep points")
    return "; ".join(bits)


def _method_note(results: pd.DataFrame) -> str:
    emulated = results.device_budget_bytes.notna().any() if "device_budget_bytes" in results else False
    return ("Step time: median over rank 0's steps after the first two. Time per epoch: step time x dataset size / "
            "global batch. Steps to target (target_measured_on = eval_loss): the first step at which the loss on a "
            "fixed held-out eval set (eval_samples, the same for every run) is at or below the target, evaluated "
            "every eval_every steps and every step once within 10% of it, outside the step's clock (older results: "
            "the mean training loss over a 5-step window). Warmup in samples (warmup_samples; warmup_steps is what "
            "it came to at each batch). Every timed run ran alone (concurrent_runs: the other launches computing "
            "beside it), its CPU ranks with threads_per_rank threads each. Time to target (compute_time_to_target_s, "
            "used in the conclusions): steps to target x median step time; train_time_to_target_s sums rank 0's "
            "measured step times instead (stalls caused by other processes included); time_to_target_s is the wall "
            "clock from process start. "
            + ("Out of memory on CPU means the emulated device capacity (device_memory_budget_bytes): the worker "
               "counts the model states a GPU would hold (params, grads, optimizer states and fp32 master, less what "
               "optimizer offload keeps on the host) plus saved activations, and raises torch.OutOfMemoryError past "
               "it. It leaves out communication buffers (buffer_bytes: ZeRO-3's reduce bucket, offload staging "
               "buffers) and the parameters ZeRO-3 gathers transiently for forward and backward, so a real GPU needs "
               "more. "
               if emulated else "Out of memory is the device's own error. ")
            + "Bytes are per rank, the largest over ranks.")


def _html_table(frame: pd.DataFrame, columns: Iterable[str]) -> str:
    def fmt(value: Any) -> str:
        if is_nan(value):
            return ""
        if isinstance(value, float):
            return f"{value:.4g}"
        return html.escape(str(value))

    columns = list(columns)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{fmt(row.get(c))}</td>" for c in columns) + "</tr>"
                   for row in frame.to_dict("records"))
    return f"<div style='overflow-x:auto'><table><tr>{head}</tr>{body}</table></div>"

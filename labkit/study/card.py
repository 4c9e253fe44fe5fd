"""The answer card: the lab's question answered in one table, from the measured results.

Rows are the ways to grow the batch (`ranks`, `micro_batch`, `grad_accum`: the sweep's `growth` column),
columns the three clocks (`per_step`, `per_epoch`, `to_target`). Each cell holds a verdict, faster / flat /
slower (`labkit.study.verdict.verdict`, flat within +-FLAT_BAND), the ratio it comes from (time at the largest
batch over time at the smallest, for ONE strategy: ZeRO stage 0, DeepSpeed's plain data parallelism), the two
global batches, and the measured condition the verdict depends on, computed from the same results:

    {"ways": {way: {clock: {"verdict", "ratio", "from_batch", "to_batch", "condition"}}},
     "deepspeed": "...", "measured_on": {"device", "accelerator", "count", "profile", "model", "date"},
     "strategy": "z0", "flat_band": 0.1}

A cell that could not be measured has `verdict` and `ratio` null and a condition saying why. `labkit answer`
writes the card as `answer_card.json` and puts it first in `report.html`; notebook 04 shows it at its top and
at its end. `labkit predict` writes PREDICTED cards of the same shape.
"""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any

import pandas as pd

from labkit.study import growth
from labkit.study.tables import is_nan, label, with_compute_time
from labkit.study.verdict import FLAT_BAND, verdict

CARD_FILE = "answer_card.json"
STRATEGY = "z0"  # the strategy the card reads: stage 0 is data parallelism, without ZeRO's partitioning
CLOCKS = {"per_step": ("median_step_time_s", "time per step"),
          "per_epoch": ("time_per_epoch_s", "time per epoch"),
          "to_target": ("compute_time_to_target_s", "time to the same loss")}
WAY_NAMES = {"ranks": "more ranks (fixed micro-batch per rank)",
             "micro_batch": "bigger micro-batch (fixed ranks)",
             "grad_accum": "more gradient accumulation (fixed micro-batch and ranks)"}


# -- the card --------------------------------------------------------------------------------------
def build_card(results: pd.DataFrame, *, maxbatch: pd.DataFrame | None = None, noise: pd.DataFrame | None = None,
               machine: dict[str, Any] | None = None, strategy: str = STRATEGY) -> dict[str, Any]:
    """The card of one sweep's results (results.csv; maxbatch.csv, noise.csv and machine.json where there)."""
    results = with_compute_time(results)
    scale = _batch_scale(results, noise)
    return {"ways": {way: _way(results, way, strategy, scale) for way in WAY_NAMES},
            "deepspeed": deepspeed_line(results, maxbatch, strategy),
            "measured_on": measured_on(machine),
            "strategy": strategy, "flat_band": FLAT_BAND}


def cell(ratio: float | None, from_batch: int | None, to_batch: int | None, condition: str) -> dict[str, Any]:
    """One cell; the verdict is always the one its (rounded) ratio gives."""
    if ratio is None or is_nan(ratio) or not math.isfinite(ratio) or ratio <= 0:
        return {"verdict": None, "ratio": None, "from_batch": from_batch, "to_batch": to_batch,
                "condition": condition}
    ratio = round(float(ratio), 4)
    return {"verdict": verdict(ratio), "ratio": ratio, "from_batch": from_batch, "to_batch": to_batch,
            "condition": condition}


def _unmeasured(condition: str) -> dict[str, dict[str, Any]]:
    return {clock: cell(None, None, None, condition) for clock in CLOCKS}


def _way(results: pd.DataFrame, way: str, strategy: str, scale: dict[str, Any]) -> dict[str, dict[str, Any]]:
    rows = growth.in_growth(results, way)
    rows = rows[rows.strategy == strategy].sort_values(["global_batch", "world_size"])
    ranks = int(results.world_size.max()) if len(results) else 0
    if way == "ranks" and ranks <= 1:
        return _unmeasured(f"{ranks} device: ranks cannot grow")
    if rows.global_batch.nunique() < 2:
        run = f" (only batch {int(rows.global_batch.iloc[0])} ran)" if len(rows) else ""
        return _unmeasured(f"not measured: no {label(strategy)} points grew the batch this way{run}")
    finished = rows[rows.status == "finished"]
    left_out = rows[(rows.status != "finished")]
    if finished.global_batch.nunique() < 2:
        return _unmeasured(f"fewer than two {label(strategy)} points finished" + _left_out_text(left_out, ""))
    first, last = finished.iloc[0], finished.iloc[-1]
    note = _left_out_text(left_out[left_out.global_batch > first.global_batch])
    out = {}
    for clock, (key, _) in CLOCKS.items():
        before, after = first.get(key), last.get(key)
        batches = (int(first.global_batch), int(last.global_batch))
        if clock == "to_target" and (is_nan(before) or is_nan(after)):
            missed = first if is_nan(before) else last
            out[clock] = cell(None, *batches, f"batch {int(missed.global_batch)} did not reach the target loss "
                                              f"{_number(missed.get('target_loss'))} within its "
                                              f"{_number(missed.get('steps_completed'))} steps: no time to target"
                              + note)
            continue
        ratio = None if is_nan(before) or is_nan(after) or not before else float(after) / float(before)
        condition = CONDITIONS[(way, clock)](finished, first, last, scale)
        out[clock] = cell(ratio, *batches, condition + note)
    return out


def _left_out_text(rows: pd.DataFrame, lead: str = "not in the ratio: ") -> str:
    """' (not in the ratio: batch 512 oom)': the points of the way that did not finish."""
    if rows.empty:
        return ""
    return f" ({lead}" + ", ".join(f"batch {int(r.global_batch)} {r.status}" for r in rows.itertuples()) + ")"


def _number(value: Any) -> str:
    return "?" if value is None or is_nan(value) else f"{float(value):g}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


# -- the conditions, each computed from the rows it reads -------------------------------------------
def _ranks_step(rows: pd.DataFrame, first: Any, last: Any, scale: dict[str, Any]) -> str:
    before, after = first.median_step_time_s, last.median_step_time_s
    said = verdict(round(after / before, 4))  # the cell's own rounding: condition and verdict agree
    same = (f"the same {int(first.micro_batch)} samples per rank, {int(first.world_size)} -> {int(last.world_size)} "
            f"ranks, step {_ms(before)} -> {_ms(after)}")
    if said == "faster":
        # More ranks add communication and never remove work per rank: a shorter step is the machine's doing.
        return (f"no communication cost shows: {same}, shorter with more ranks at the same work per rank, which "
                "only a change in what else ran on the machine explains (machine.json: load average)")
    return (f"communication {'hidden behind' if said == 'flat' else 'not hidden behind'} compute: {same} "
            f"({'+' if after >= before else ''}{_ms(after - before)} for the gradient all-reduce and whatever the "
            "ranks share)")


def _ranks_epoch(rows: pd.DataFrame, first: Any, last: Any, scale: dict[str, Any]) -> str:
    more = last.world_size / first.world_size
    return (f"{more:g}x the ranks share an epoch ({more:g}x fewer steps per epoch) while the step took "
            f"{last.median_step_time_s / first.median_step_time_s:.2f}x as long")


def _saturation(rows: pd.DataFrame) -> str:
    rates = rows.samples_per_s.astype(float).tolist()
    rising = len(rates) >= 2 and rates[-1] > rates[-2] * (1 + FLAT_BAND)
    series = " -> ".join(f"{r:,.0f}" for r in rates)
    return (f"device not saturated: samples/s still rising with the micro-batch ({series})" if rising else
            f"device saturated: samples/s flat at the largest micro-batches ({series})")


def _micro_step(rows: pd.DataFrame, first: Any, last: Any, scale: dict[str, Any]) -> str:
    return (f"{_saturation(rows)}, so {last.micro_batch / first.micro_batch:g}x the micro-batch took "
            f"{last.median_step_time_s / first.median_step_time_s:.2f}x the step time")


def _micro_epoch(rows: pd.DataFrame, first: Any, last: Any, scale: dict[str, Any]) -> str:
    return f"an epoch takes dataset / (samples/s): {_saturation(rows)}"


def _accum_step(rows: pd.DataFrame, first: Any, last: Any, scale: dict[str, Any]) -> str:
    m0, m1 = first.median_step_time_s / first.grad_accum, last.median_step_time_s / last.grad_accum
    return (f"a step runs {int(last.grad_accum)} micro-steps instead of {int(first.grad_accum)} "
            f"({last.grad_accum / first.grad_accum:g}x), {_ms(m0)} -> {_ms(m1)} per micro-step")


def _accum_epoch(rows: pd.DataFrame, first: Any, last: Any, scale: dict[str, Any]) -> str:
    m0, m1 = first.median_step_time_s / first.grad_accum, last.median_step_time_s / last.grad_accum
    return (f"the same micro-steps per epoch at {_ms(m0)} -> {_ms(m1)} each: the optimizer step and the "
            f"all-reduce, once per step, are shared by {int(last.grad_accum)} micro-steps instead of "
            f"{int(first.grad_accum)}")


def _to_target(rows: pd.DataFrame, first: Any, last: Any, scale: dict[str, Any]) -> str:
    s0, s1 = int(first.steps_to_target), int(last.steps_to_target)
    text = (f"steps {s0} -> {s1} for {last.global_batch / first.global_batch:g}x the batch, each step "
            f"{last.median_step_time_s / first.median_step_time_s:.2f}x as long")
    relation = batch_relation(int(first.global_batch), int(last.global_batch), scale)
    return text + (f"; {relation}" if relation else "")


CONDITIONS = {("ranks", "per_step"): _ranks_step, ("ranks", "per_epoch"): _ranks_epoch,
              ("ranks", "to_target"): _to_target,
              ("micro_batch", "per_step"): _micro_step, ("micro_batch", "per_epoch"): _micro_epoch,
              ("micro_batch", "to_target"): _to_target,
              ("grad_accum", "per_step"): _accum_step, ("grad_accum", "per_epoch"): _accum_epoch,
              ("grad_accum", "to_target"): _to_target}


def _batch_scale(results: pd.DataFrame, noise: pd.DataFrame | None) -> dict[str, Any]:
    """B_simple (noise.csv, pooled) and the fitted B_crit with its placement: what the batch is set against."""
    spread = growth.noise_spread(noise)
    fit = growth.critical_batch(results)
    return {"b_simple": spread["b_simple"] if spread else None, "fit": fit}


def batch_relation(low: int, high: int, scale: dict[str, Any]) -> str:
    """Where batches low..high sit against B_simple and the fitted B_crit, in words."""
    def where(value: float) -> str:
        return "below" if high <= value else "above" if low >= value else "across"

    parts = []
    b_simple = scale.get("b_simple")
    if b_simple:
        parts.append(f"batch {low}-{high} {where(b_simple)} B_simple ~ {b_simple:.0f} (noise.csv)")
    fit = scale.get("fit")
    if fit and fit["placement"]["placed"]:
        parts.append(f"{where(fit['b_crit'])} the fitted {fit['placement']['text']}")
    elif fit:
        parts.append(fit["placement"]["text"])
    return "; ".join(parts)


# -- DeepSpeed's part, and where it was measured ---------------------------------------------------
def deepspeed_line(results: pd.DataFrame, maxbatch: pd.DataFrame | None, strategy: str = STRATEGY) -> str:
    """What stage 0 gave (the card's rows) and what each ZeRO strategy changed: the largest micro-batch per
    rank (maxbatch.csv) and its time per step against stage 0 at the same micro-batch, accumulation and ranks."""
    credit = growth.credit_table(results)
    fits = growth.max_micro_batches(maxbatch)
    parts = []
    if not credit.empty and "step_time_vs_z0" in credit:
        for zero in [s for s in growth.ZERO if s in set(credit.strategy)]:
            rows = credit[(credit.strategy == zero) & credit.step_time_vs_z0.notna()]
            if rows.empty:
                continue
            plain = rows[rows.grad_accum == 1].step_time_vs_z0
            cost = (f"{plain.min():.2f}x" if f"{plain.min():.2f}" == f"{plain.max():.2f}" else
                    f"{plain.min():.2f}-{plain.max():.2f}x") if not plain.empty else None
            accumulated = rows[rows.grad_accum > 1].sort_values("grad_accum")
            most = accumulated.iloc[-1] if not accumulated.empty else None
            text = label(zero)
            room = _room(zero, fits)
            if room:
                text += f" fits {room}"
            costs = [f"{cost} stage 0's time per step" if cost else None,
                     f"{most.step_time_vs_z0:.2f}x with {int(most.grad_accum)} accumulation micro-steps"
                     if most is not None else None]
            text += (", at " if room else ": ") + " and ".join(c for c in costs if c)
            parts.append(text)
    head = (f"The card reads {label(strategy)}: DeepSpeed's data parallelism (every rank holds the whole model and "
            "the gradients are all-reduced), which is what spreads a batch over more ranks.")
    if not parts:
        return head
    return (head + " The ZeRO stages changed the room per rank, at a cost per step (same micro-batch and ranks): "
            + "; ".join(parts) + ".")


def _room(strategy: str, fits: dict[tuple[str, int], int]) -> str | None:
    """'640 samples per rank where stage 0 fits 288 (2.22x)', from the max-batch search."""
    mine = [(ranks, fit) for (s, ranks), fit in fits.items() if s == strategy]
    if not mine:
        return None
    ranks, fit = mine[0]
    base = fits.get(("z0", ranks))
    source = "stage 0"
    if base is None and ("torch", 1) in fits:
        # Plain PyTorch's search stands in: stage 0 keeps the same unpartitioned states per rank.
        base, source = fits[("torch", 1)], "stage 0 (plain PyTorch's search: the same unpartitioned states)"
    if not base:
        return f"{fit} samples per rank on {ranks} ranks"
    return f"{fit} samples per rank where {source} fits {base} ({fit / base:.2f}x)"


def measured_on(machine: dict[str, Any] | None) -> dict[str, Any]:
    """device, accelerator, count (GPUs; on CPU the cores the ranks ran on), profile, model, date."""
    machine = machine or {}
    cpu = machine.get("accelerator") == "cpu"
    return {"device": machine.get("device") or machine.get("cpu_model"), "accelerator": machine.get("accelerator"),
            "count": machine.get("cpu_cores") if cpu else machine.get("devices"),
            "profile": machine.get("profile"), "model": machine.get("model"), "date": machine.get("date")}


def write_card(card: dict[str, Any], out: str | Path) -> Path:
    from labkit.core.files import write_json_atomic

    path = Path(out) / CARD_FILE
    write_json_atomic(path, card)
    return path


# -- the card on a page ----------------------------------------------------------------------------
COLORS = {"faster": "#1a7f37", "flat": "#6e5600", "slower": "#b42318", None: "#666"}


def card_html(card: dict[str, Any], title: str | None = None) -> str:
    """The card as an HTML table (the report's first section, notebook 04's top and end)."""
    band = card.get("flat_band", FLAT_BAND)
    head = "".join(f"<th>{html.escape(name)}</th>" for _, name in CLOCKS.values())
    body = []
    for way in [w for w in WAY_NAMES if w in card["ways"]]:  # the card's order, whatever order the JSON kept
        cells = card["ways"][way]
        tds = []
        for clock in CLOCKS:
            c = cells[clock]
            word = c["verdict"] or "not measured"
            ratio = f" {c['ratio']:.2f}x" if c["ratio"] is not None else ""
            batches = (f" <span style='color:#555'>(batch {c['from_batch']} &rarr; {c['to_batch']})</span>"
                       if c["from_batch"] is not None and c["ratio"] is not None else "")
            tds.append(f"<td style='text-align:left;vertical-align:top;padding:4px 8px'>"
                       f"<b style='color:{COLORS.get(c['verdict'], '#666')}'>{html.escape(word)}</b>{ratio}{batches}"
                       f"<br><span style='font-size:11px;color:#444'>{html.escape(c['condition'])}</span></td>")
        body.append(f"<tr><th style='text-align:left;vertical-align:top'>{html.escape(WAY_NAMES.get(way, way))}"
                    f"</th>{''.join(tds)}</tr>")
    where = card.get("measured_on") or {}
    measured = ", ".join(f"{k} {v}" for k, v in where.items() if v not in (None, ""))
    caption = html.escape(title) if title else "The answer card"
    return ("<div class='answer-card'>"
            f"<table style='border-collapse:collapse;font-size:13px'><caption style='text-align:left;"
            f"font-weight:bold;padding:4px 0'>{caption}</caption>"
            f"<tr><th></th>{head}</tr>{''.join(body)}</table>"
            f"<p style='font-size:12px;margin:4px 0'>Ratio: time at the largest batch / time at the smallest, for "
            f"{html.escape(label(card.get('strategy', STRATEGY)))}; <b>flat</b> within &plusmn;{band:.0%}, "
            f"<b>faster</b> below, <b>slower</b> above. Time to the same loss = steps to the target x the median "
            f"step time.</p>"
            f"<p style='font-size:12px;margin:4px 0'><b>DeepSpeed's part:</b> {html.escape(card['deepspeed'])}</p>"
            + "".join(f"<p style='font-size:12px;margin:4px 0;color:#b42318'><b>Caveat:</b> {html.escape(text)}</p>"
                      for text in card.get("caveats", []))
            + f"<p style='font-size:11px;color:#555;margin:4px 0'>Measured on: {html.escape(measured)}</p></div>")


def card_markdown(card: dict[str, Any]) -> str:
    """The card's table in Markdown, verdict and ratio per cell (READMEs, issues; the conditions stay in the JSON)."""
    lines = ["| way | " + " | ".join(name for _, name in CLOCKS.values()) + " |", "|---" * (len(CLOCKS) + 1) + "|"]
    for way in [w for w in WAY_NAMES if w in card["ways"]]:
        cells = []
        for clock in CLOCKS:
            c = card["ways"][way][clock]
            cells.append(f"**{c['verdict']}** {c['ratio']:.2f}x ({c['from_batch']} -> {c['to_batch']})"
                         if c["ratio"] is not None else "not measured")
        lines.append(f"| {WAY_NAMES[way]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cards_side_by_side(cards: dict[str, dict[str, Any]]) -> str:
    """Several cards next to each other (notebook 04: the MLP's and the GPT's references)."""
    cells = "".join(f"<div style='flex:1;min-width:420px'>{card_html(card, title)}</div>"
                    for title, card in cards.items())
    return f"<div style='display:flex;gap:16px;flex-wrap:wrap'>{cells}</div>"


def show(card: dict[str, Any] | None = None, *, title: str | None = None,
         side_by_side: dict[str, dict[str, Any]] | None = None) -> Any:
    """The card (or several side by side) as an IPython HTML object, for a notebook cell's output."""
    from IPython.display import HTML

    if side_by_side is not None:
        return HTML(cards_side_by_side(side_by_side))
    if card is None:
        raise ValueError("show() needs a card or side_by_side")
    return HTML(card_html(card, title))


# -- two references, two regimes -------------------------------------------------------------------
def regime(results: pd.DataFrame, noise: pd.DataFrame | None = None, strategy: str = STRATEGY,
           way: str = "micro_batch") -> dict[str, Any] | None:
    """What decides time to target as the batch grows one way: steps x time per step, and why each moved."""
    table = growth.growth_table(results, way)
    rows = table[(table.strategy == strategy) & table.steps_to_target.notna()].sort_values("global_batch")
    if len(rows) < 2:
        return None
    first, last = rows.iloc[0], rows.iloc[-1]
    in_rows = growth.in_growth(results, way)
    rates = in_rows[(in_rows.strategy == strategy) & (in_rows.status == "finished")].sort_values("global_batch")
    spread = growth.noise_spread(noise)
    return {"from_batch": int(first.global_batch), "to_batch": int(last.global_batch),
            "time_ratio": float(last.time_to_target_ratio), "steps": (int(first.steps_to_target),
                                                                      int(last.steps_to_target)),
            "step_time_ratio": float(last.step_time_ratio),
            "samples_per_s_ratio": float(rates.samples_per_s.iloc[-1] / rates.samples_per_s.iloc[0]),
            "b_simple": spread["b_simple"] if spread else None}


def regime_sentence(name: str, r: dict[str, Any]) -> str:
    """One sentence: time to target = steps x time per step, each factor with the measured reason."""
    batch = r["to_batch"] / r["from_batch"]
    s0, s1 = r["steps"]
    if r["b_simple"]:
        b = r["b_simple"]
        where = (f"its batches lie below its gradient noise scale B_simple ~ {b:.0f}, where a bigger batch saves "
                 "steps nearly in proportion" if r["to_batch"] <= b else
                 f"all its batches lie above B_simple ~ {b:.0f}, past the critical batch, where a bigger batch "
                 "saves few steps" if r["from_batch"] >= b else
                 f"its batches straddle B_simple ~ {b:.0f}")
    else:
        where = "no noise scale measured"
    rate, step = r["samples_per_s_ratio"], r["step_time_ratio"]
    # Time per step against the work per step: far below proportional, the step is mostly fixed overhead.
    work = (f"{batch:g}x the work per step cost only {step:.2f}x the time, samples/s rose {rate:.1f}x: its steps "
            "were mostly fixed overhead, the device far from saturated" if step < batch / 2 else
            f"samples/s changed only {rate:.2f}x: the device was saturated, so each step's time grew nearly with "
            "its work")
    return (f"{name}: time to the same loss {verdict(r['time_ratio'])} ({r['time_ratio']:.2f}x) from batch "
            f"{r['from_batch']} to {r['to_batch']} = steps {s0} -> {s1} ({s0 / s1:.2f}x fewer for {batch:g}x the "
            f"batch: {where}) x time per step {step:.2f}x ({work}).")

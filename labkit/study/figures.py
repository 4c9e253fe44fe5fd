"""Static plotly figures the lesson notebooks draw from measured runs: one function per picture.

Importing this module sets plotly's renderer to one that shows in JupyterLab (the plotly
mimetype) and in a static HTML export (`make docs`: nbconvert keeps the HTML part, which loads
plotly.js from its CDN). Every function takes measured numbers and returns a `go.Figure`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio

# JupyterLab renders the mimetype; nbconvert's HTML export has no plotly mimetype renderer and
# keeps the HTML part. Jupyter's own default ("plotly_mimetype") leaves the export blank.
RENDERER = "plotly_mimetype+notebook_connected"
pio.renderers.default = RENDERER

MiB = 2**20
HEIGHT = 400
STATE_PARTS = ("param_MiB", "grad_MiB", "optim_MiB", "master_MiB")
_COLOURS = {"param_MiB": "#636efa", "grad_MiB": "#ef553b", "optim_MiB": "#00cc96", "master_MiB": "#ab63fa",
            "activation_MiB": "#ffa15a"}


def _layout(fig: go.Figure, title: str, xaxis: str, yaxis: str) -> go.Figure:
    fig.update_layout(title=title, xaxis_title=xaxis, yaxis_title=yaxis, height=HEIGHT, margin=dict(t=60, b=40),
                      legend=dict(orientation="h", yanchor="bottom", y=1.0, x=0))
    return fig


def capacity_figure(result: Any, capacity_bytes: int, *, emulated: bool) -> go.Figure:
    """Bytes one rank needs against the micro-batch: the measured probes (fits / out of memory),
    the fit (model states + intercept + slope x batch), the capacity line and the prediction.

    `result`: a `labkit.study.maxbatch.MaxBatchResult` (e.g. from `lessons.maxbatch_result`).
    """
    fig = go.Figure()
    fits = [p for p in result.probes if p.device_bytes is not None and p.fits]
    failed = [p for p in result.probes if p.device_bytes is not None and not p.fits]
    fig.add_trace(go.Scatter(name="measured: fits", x=[p.micro_batch for p in fits],
                             y=[p.device_bytes / MiB for p in fits], mode="markers",
                             marker=dict(size=11, color="#00cc96")))
    if failed:
        fig.add_trace(go.Scatter(name="out of memory (bytes counted when it failed)", x=[p.micro_batch for p in failed],
                                 y=[p.device_bytes / MiB for p in failed], mode="markers",
                                 marker=dict(size=13, symbol="x", color="#ef553b")))
    fit, states = result.activation_fit(), result.state_bytes
    predicted = result.predicted_max_micro_batch
    if fit is not None and states is not None:
        intercept, slope = fit  # MaxBatchResult.activation_fit: (bytes per step, bytes per sample)
        right = max([p.micro_batch for p in result.probes] + [predicted or 0]) * 1.15
        fig.add_trace(go.Scatter(name="model states + activation fit", x=[0, right],
                                 y=[(states + intercept) / MiB, (states + intercept + slope * right) / MiB],
                                 mode="lines", line=dict(dash="dot", color="#636efa")))
        fig.add_trace(go.Scatter(name="model states (batch-independent)", x=[0, right], y=[states / MiB] * 2,
                                 mode="lines", line=dict(color="#ab63fa")))
    fig.add_hline(y=capacity_bytes / MiB, line_dash="dash", line_color="black",
                  annotation_text="EMULATED capacity" if emulated else "device capacity")
    if predicted:
        fig.add_vline(x=predicted, line_dash="dash", line_color="grey",
                      annotation_text=f"predicted max {predicted:,}")
    return _layout(fig, "Bytes one rank needs, by micro-batch", "micro-batch (samples per rank)", "MiB")


def holdings_figure(held: pd.DataFrame, *, title: str = "What the rank holds (MiB)") -> go.Figure:
    """One stacked bar per run (rows of `held`, MiB columns as `lessons.rank_table` names them):
    parameters, gradients and optimizer states + fp32 master, the parts offload put on the host
    hatched. Needs param/grad/optim/master; host_optim/host_grad are 0 where absent."""
    get = lambda column: held[column].fillna(0) if column in held else pd.Series(0.0, index=held.index)  # noqa: E731
    host_grad, host_optim = get("host_grad_MiB"), get("host_optim_MiB")
    parts = [("parameters", get("param_MiB"), "#636efa", ""),
             ("gradients", (get("grad_MiB") - host_grad).clip(lower=0), "#ef553b", ""),
             ("gradients, on the host", host_grad, "#ef553b", "/"),
             ("optimizer states + fp32 master", (get("optim_MiB") + get("master_MiB") - host_optim).clip(lower=0),
              "#00cc96", ""),
             ("optimizer states + fp32 master, on the host", host_optim, "#00cc96", "/")]
    x = [str(i) for i in held.index]
    fig = go.Figure([go.Bar(name=name, x=x, y=values, marker=dict(color=colour, pattern_shape=pattern))
                     for name, values, colour, pattern in parts if (values > 0).any()])
    fig.update_layout(barmode="stack")
    return _layout(fig, title, "run", "MiB")


def zero_partition_figure(rows: pd.DataFrame | Sequence[dict[str, Any]]) -> go.Figure:
    """The ZeRO partition diagram, drawn from measured bytes: one bar per (stage, rank), stacked
    by what the rank holds (parameters, gradients, optimizer states, fp32 master).

    `rows`: one per (stage, rank) with `stage`, `rank` and the MiB columns of `STATE_PARTS`
    (e.g. `lessons.partition_rows(runs)`). Stage 0 is plain data parallelism (every rank all
    of it); 1 partitions the optimizer states, 2 the gradients too, 3 the parameters too.
    """
    table = pd.DataFrame(list(rows) if not isinstance(rows, pd.DataFrame) else rows)
    table = table.sort_values(["stage", "rank"])
    x = [[f"stage {s}" for s in table["stage"]], [f"rank {r}" for r in table["rank"]]]
    names = {"param_MiB": "parameters", "grad_MiB": "gradients", "optim_MiB": "optimizer states",
             "master_MiB": "fp32 master"}
    fig = go.Figure([go.Bar(name=names[c], x=x, y=table[c].fillna(0), marker_color=_COLOURS[c])
                     for c in STATE_PARTS if c in table])
    fig.update_layout(barmode="stack")
    return _layout(fig, "ZeRO: what each rank holds, per stage (measured)", "", "MiB per rank")


def timeline_figure(spans: pd.DataFrame, *, title: str) -> go.Figure:
    """A Gantt-like timeline: one row per `lane`, one bar per span from `start_ms` to `end_ms`,
    coloured by `kind` (hover shows `label`). Built by `lessons.step_timeline`."""
    fig = go.Figure()
    for kind, group in spans.groupby("kind", sort=False):
        fig.add_trace(go.Bar(name=kind, y=group["lane"], x=group["end_ms"] - group["start_ms"],
                             base=group["start_ms"], orientation="h", hovertext=group["label"],
                             hoverinfo="text+x"))
    fig.update_layout(barmode="overlay", bargap=0.3)
    fig.update_yaxes(autorange="reversed", type="category")
    return _layout(fig, title, "ms since the step began", "")


def bars(table: pd.DataFrame, columns: Sequence[str], *, title: str, yaxis: str, xaxis: str = "",
         stacked: bool = False) -> go.Figure:
    """Grouped (or stacked) bars: one group per row of `table`, one bar per column."""
    x = [str(i) for i in table.index]
    fig = go.Figure([go.Bar(name=c, x=x, y=table[c]) for c in columns if c in table])
    fig.update_layout(barmode="stack" if stacked else "group")
    return _layout(fig, title, xaxis or (table.index.name or ""), yaxis)


def loss_curves(curves: pd.DataFrame, *, title: str, column: str = "eval_loss", log_y: bool = True) -> go.Figure:
    """Loss against samples trained on, one line per `run` (`lessons.loss_by_samples`). A run whose
    loss left the finite numbers ends at its last finite point, with an x there and "diverged"."""
    import numpy as np

    fig = go.Figure()
    for run, group in curves.groupby("run", sort=False):
        is_finite = np.isfinite(group[column].to_numpy(dtype=float))
        finite, blew_up = group[is_finite], not is_finite.all()
        fig.add_trace(go.Scatter(name=f"{run} (diverged)" if blew_up else str(run), x=finite["samples"],
                                 y=finite[column], mode="lines+markers"))
        if blew_up:
            first_bad = group.loc[~is_finite, "samples"].iloc[0]
            fig.add_vline(x=first_bad, line_dash="dot", line_color="#ef553b",
                          annotation_text=f"{run}: {column} not finite from {first_bad:,} samples")
    if log_y:
        fig.update_yaxes(type="log")
    return _layout(fig, title, "samples trained on", column.replace("_", " "))

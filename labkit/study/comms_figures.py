"""The figures of notebook 03b (what the ranks send each other): one function per picture, from
`labkit.study.comms` tables. Plotly, rendered like `labkit.study.figures` (importing it sets the renderer)."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import plotly.graph_objects as go

import labkit.study.figures  # noqa: F401  (plotly's renderer for JupyterLab and `make docs`)
from labkit.study.figures import HEIGHT

_WHAT_COLOURS = {"gradients": "#ef553b", "updated parameters": "#636efa", "parameters": "#00cc96",
                 "persistent parameters": "#ab63fa", "gradient norm": "#ffa15a", "overflow check": "#19d3f3"}


def sent_figure(table: pd.DataFrame, *, world_size: int) -> go.Figure:
    """MiB one rank sends per optimizer step (ring), per run: the formula's bar and the comms log's bar
    side by side, each stacked by what is sent. `table`: `labkit.study.comms.compare_runs`."""
    fig = go.Figure()
    runs = list(dict.fromkeys(table["run"]))
    for what in dict.fromkeys(table["what"]):
        part = table[table["what"] == what].set_index("run")
        for source, column, pattern in (("formula", "sent_MiB_per_rank_predicted", ""),
                                        ("comms log", "sent_MiB_per_rank_measured", "/")):
            y = [float(part.loc[[r], column].sum()) if r in part.index else 0.0 for r in runs]
            fig.add_trace(go.Bar(name=f"{what} ({source})", x=[runs, [source] * len(runs)], y=y,
                                 marker=dict(color=_WHAT_COLOURS.get(what, "#7f7f7f"), pattern_shape=pattern),
                                 legendgroup=what, showlegend=source == "formula"))
    fig.update_layout(barmode="stack", title=f"What one rank sends per optimizer step ({world_size} ranks, ring): "
                      "DeepSpeed 0.19.8's code paths against its comms log", yaxis_title="MiB per rank per step",
                      height=HEIGHT + 60, margin=dict(t=60, b=40), legend=dict(orientation="h", y=-0.25))
    return fig


def link_figure(raw: pd.DataFrame, fits: dict, *, world_size: int, title: str) -> go.Figure:
    """Measured seconds per call against message size (every timed call), and the alpha-beta line per op."""
    from labkit.study.comms import ring_factor, ring_steps

    fig = go.Figure()
    colours = {"all_reduce": "#ef553b", "all_gather": "#636efa", "reduce_scatter": "#00cc96"}
    for op, group in raw.groupby("op", sort=False):
        colour = colours.get(str(op), "#7f7f7f")
        fig.add_trace(go.Scatter(name=f"{op} (measured)", x=group["msg_bytes"], y=group["seconds"] * 1e3,
                                 mode="markers", marker=dict(color=colour, size=6, opacity=0.6)))
        fit = fits[op]
        sizes = sorted(set(group["msg_bytes"]))
        fig.add_trace(go.Scatter(name=f"{op}: {fit.alpha_s * 1e6:.0f} us/step, {fit.bus_gbps:.1f} Gbit/s", x=sizes,
                                 y=[(ring_steps(str(op), world_size) * fit.alpha_s
                                     + ring_factor(str(op), world_size) * s * fit.beta_s_per_byte) * 1e3
                                    for s in sizes], mode="lines", line=dict(color=colour)))
    fig.update_xaxes(type="log")
    fig.update_yaxes(type="log")
    fig.update_layout(title=title, xaxis_title="message bytes", yaxis_title="ms per call", height=HEIGHT,
                      margin=dict(t=60, b=40))
    return fig


def scaling_figure(predicted: pd.DataFrame, measured: pd.DataFrame | None, *, series: Sequence[str],
                   title: str) -> go.Figure:
    """Predicted time per step against ranks (`predicted`: world_size and one column per series),
    with measured points (`measured`: world_size, step_s) where there are some."""
    fig = go.Figure()
    for name in series:
        fig.add_trace(go.Scatter(name=f"predicted: {name}", x=predicted["world_size"], y=predicted[name] * 1e3,
                                 mode="lines+markers"))
    if measured is not None and not measured.empty:
        fig.add_trace(go.Scatter(name="measured (stage 0, one rank per core)", x=measured["world_size"],
                                 y=measured["step_s"] * 1e3, mode="markers", marker=dict(size=13, symbol="x")))
    fig.update_xaxes(type="log", title="ranks")
    fig.update_yaxes(rangemode="tozero")
    fig.update_layout(title=title, yaxis_title="ms per step", height=HEIGHT, margin=dict(t=60, b=40))
    return fig

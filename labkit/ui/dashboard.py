"""Live plotly charts of a run: throughput, memory per rank, model states, loss.

    dash = Dashboard(run)     # starts one background thread that follows the run's rank files
    dash                      # (in a notebook) shows four FigureWidgets
    dash.overlay(["runs/<id>"])  # past runs on the same axes
    dash.close()              # or let it end by itself when the run is done

Two layers:

- pure data shaping, unit-tested without widgets: `step_columns` turns new records into numpy
  columns, `Decimated` keeps a trace in at most max_points points (min/max buckets whose width
  doubles as the run grows: spikes stay, the last point is always there), `RankSeries` holds a
  rank's traces and latest values, `RunSeries` the ranks and the traces that combine them,
  `run_traces` turns a run's series into the trace list of each chart. Memory and work per
  refresh are bounded by max_points per trace, at step 100 as at step 1,000,000;
- `Dashboard`: four `go.FigureWidget`s refreshed from ONE background thread with
  `fig.batch_update()` and numpy arrays. Never `widget.hold_sync()`: it silently drops
  FigureWidget updates. The thread only reads files and sends comm messages, so the
  kernel stays free to run other cells. A thread is bound to the run and the series it
  was started for: it never touches a later run's.
"""

from __future__ import annotations

import functools
import math
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from labkit.core.files import read_json
from labkit.core.records import RecordTail, rank_file, read_records
from labkit.core.schema import HOST_KEYS, STATE_KEYS
from labkit.launch.run import FINAL_STATUSES

# Record keys the charts use; each becomes one float64 column per rank (NaN where absent).
STEP_KEYS = ("step", "time_s", "samples_per_s", "step_time_s", "loss", "rss_bytes", "peak_rss_bytes",
             "device_allocated_bytes", "device_peak_bytes", *STATE_KEYS, *HOST_KEYS)
CHARTS = ("throughput", "memory", "state", "loss")
DEFAULT_MAX_POINTS = 2000
REFRESH_S = 0.25       # 4 Hz (>= 2 Hz wanted): the thread polls the rank files this often (replots on new records)
MIN_REFRESH_S = 0.01   # 100 Hz: faster is a busy loop reading the rank files on the cores the ranks train on
JOIN_TIMEOUT_S = 10.0  # close() waits this long for the update thread's current tick
# A reloaded run (no supervisor handle) reads "starting" until its supervisor writes status.json,
# which it does within seconds of starting; still "starting" after this long, it died first.
STARTING_TIMEOUT_S = 120.0
MIB = float(2**20)

RANK_COLORS = ("#636EFA", "#EF553B", "#00CC96", "#AB63FA", "#FFA15A", "#19D3F3", "#FF6692", "#B6E880",
               "#FF97FF", "#FECB52")
OVERLAY_COLORS = ("#7f7f7f", "#8c564b", "#bcbd22", "#17becf", "#9467bd", "#d62728", "#2ca02c", "#1f77b4")
STATE_PARTS = (  # (trace name, colour) of the stacked model-state bars
    ("params", "#636EFA"), ("grads", "#EF553B"), ("optimizer + master", "#00CC96"),
    ("offloaded to host", "#AB63FA"))


# -- pure data shaping -------------------------------------------------------------------
def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def step_columns(records: Iterable[dict[str, Any]], keys: Sequence[str] = STEP_KEYS,
                 event: str = "step") -> dict[str, np.ndarray]:
    """The `event` records (`step`, or the guard's `sample`) among `records` as one float64 array per
    key (NaN where a record lacks it)."""
    steps = [r for r in records if r.get("event") == event]
    return {k: np.fromiter((_number(r.get(k)) for r in steps), dtype=np.float64, count=len(steps)) for k in keys}


class Decimated:
    """An (x, y) trace held in at most `max_points` points, whatever its length: O(1) per point.

    Appended points (x increasing) fall into buckets of `width` consecutive points; a full bucket
    keeps only its lowest and its highest point, in x order, so a spike or a dip is never
    decimated away, and every point drawn is a real one. When the full buckets would no longer
    fit, neighbours merge pairwise and the width doubles: O(max_points) once per doubling of the
    run's length, O(1) per point amortised. The first and the last point appended are always
    drawn. Points with a NaN y (records without the key) are not part of the trace.
    """

    def __init__(self, max_points: int = DEFAULT_MAX_POINTS):
        if max_points < 8:
            raise ValueError(f"max_points must be >= 8, got {max_points}")
        self.max_points = max_points
        # Points of the full buckets; the open bucket's two, the first and the last make max_points.
        # A multiple of 4: buckets merge in pairs, from 1 point each (width 1) to 2 each.
        self.room = (max_points - 4) // 4 * 4
        self.width = 1      # points appended per full bucket
        self.count = 0      # full buckets held
        self.n = 0          # points appended (NaN ones left out)
        self._lo = np.empty((self.room, 2))  # per full bucket: (x, y) of its lowest point
        self._hi = np.empty((self.room, 2))  # ... and of its highest (the same point at width 1)
        self._open: tuple[tuple[float, float], tuple[float, float]] | None = None  # lowest, highest
        self._open_n = 0
        self._first: tuple[float, float] | None = None
        self._last: tuple[float, float] | None = None

    @property
    def capacity(self) -> int:
        """Full buckets that fit: one point each at width 1, two (lowest, highest) beyond."""
        return self.room if self.width == 1 else self.room // 2

    def extend(self, x: np.ndarray, y: np.ndarray) -> None:
        x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
        keep = ~np.isnan(y)
        x, y = x[keep], y[keep]
        if not len(x):
            return
        self.n += len(x)
        if self._first is None:
            self._first = (float(x[0]), float(y[0]))
        self._last = (float(x[-1]), float(y[-1]))
        i = 0
        while i < len(x):
            if self._open_n or len(x) - i < self.width:  # into the open bucket
                take = min(self.width - self._open_n, len(x) - i)
                self._absorb(x[i:i + take], y[i:i + take])
                i += take
                if self._open_n == self.width and self._open is not None:
                    low, high = self._open
                    self._open, self._open_n = None, 0
                    self._close(np.array([low]), np.array([high]))
                continue
            # As many whole buckets as fit before the next merge, at once.
            whole = min(self.capacity - self.count, (len(x) - i) // self.width)
            end = i + whole * self.width
            xs, ys = x[i:end].reshape(whole, self.width), y[i:end].reshape(whole, self.width)
            rows = np.arange(whole)
            low, high = ys.argmin(axis=1), ys.argmax(axis=1)
            self._close(np.column_stack([xs[rows, low], ys[rows, low]]),
                        np.column_stack([xs[rows, high], ys[rows, high]]))
            i = end

    def _absorb(self, x: np.ndarray, y: np.ndarray) -> None:
        low, high = int(y.argmin()), int(y.argmax())
        new_low, new_high = (float(x[low]), float(y[low])), (float(x[high]), float(y[high]))
        if self._open is not None:  # ties keep the earlier point, as argmin/argmax do
            old_low, old_high = self._open
            new_low = old_low if old_low[1] <= new_low[1] else new_low
            new_high = old_high if old_high[1] >= new_high[1] else new_high
        self._open = (new_low, new_high)
        self._open_n += len(x)

    def _close(self, lo: np.ndarray, hi: np.ndarray) -> None:
        self._lo[self.count:self.count + len(lo)] = lo
        self._hi[self.count:self.count + len(hi)] = hi
        self.count += len(lo)
        while self.count >= self.capacity:  # neighbours merge: half the buckets, twice as wide
            lo3, hi3 = self._lo[:self.count].reshape(-1, 2, 2), self._hi[:self.count].reshape(-1, 2, 2)
            pairs = np.arange(len(lo3))
            merged_lo = lo3[pairs, lo3[:, :, 1].argmin(axis=1)]
            merged_hi = hi3[pairs, hi3[:, :, 1].argmax(axis=1)]
            self.count //= 2
            self._lo[:self.count], self._hi[:self.count] = merged_lo, merged_hi
            self.width *= 2

    @property
    def held(self) -> int:
        """Points kept (full buckets, the open one's, first and last): at most max_points."""
        per_bucket = 1 if self.width == 1 else 2
        return self.count * per_bucket + (2 if self._open is not None else 0) + 2 * (self._first is not None)

    def points(self) -> tuple[np.ndarray, np.ndarray]:
        """The points to draw, x increasing: at most max_points, the first and last appended included."""
        lo, hi = self._lo[:self.count], self._hi[:self.count]
        if self._open is not None:
            lo, hi = np.vstack([lo, [self._open[0]]]), np.vstack([hi, [self._open[1]]])
        low_first = (lo[:, 0] <= hi[:, 0])[:, None]
        first, second = np.where(low_first, lo, hi), np.where(low_first, hi, lo)
        pts = np.stack([first, second], axis=1).reshape(-1, 2)
        keep = np.ones(len(pts), dtype=bool)
        keep[1::2] = first[:, 0] != second[:, 0]  # a bucket whose lowest point is its highest: once
        pts = pts[keep]
        if self._first is not None and self._last is not None:
            if not len(pts) or pts[0, 0] != self._first[0]:
                pts = np.vstack([[self._first], pts])
            if pts[-1, 0] != self._last[0]:
                pts = np.vstack([pts, [self._last]])
        return pts[:, 0].copy(), pts[:, 1].copy()


# Keys drawn as a line per rank; every other key only as its latest value (the model-state bars).
RANK_TRACE_KEYS = ("samples_per_s", "rss_bytes", "device_allocated_bytes", "device_peak_bytes")


class RankSeries:
    """One rank's step records, held in bounded memory: a `Decimated` trace (x = step) per key in
    RANK_TRACE_KEYS and the latest finite value of every key (the census comes every
    census_every steps). Each record costs O(1), at step 10 as at step 1,000,000; only new records
    are converted (the dashboard feeds it `RecordTail.poll()` output).
    """

    def __init__(self, keys: Sequence[str] = STEP_KEYS, max_points: int = DEFAULT_MAX_POINTS):
        self.keys = tuple(keys)
        self.n = 0
        self.last_step = 0
        self.traces = {k: Decimated(max_points) for k in RANK_TRACE_KEYS if k in self.keys}
        self._latest = dict.fromkeys(self.keys, math.nan)

    @classmethod
    def from_records(cls, records: Iterable[dict[str, Any]], keys: Sequence[str] = STEP_KEYS,
                     max_points: int = DEFAULT_MAX_POINTS) -> RankSeries:
        series = cls(keys, max_points)
        series.extend(records)
        return series

    def extend(self, records: Iterable[dict[str, Any]]) -> int:
        """Append the step records among `records`; returns how many were added."""
        return self.extend_columns(step_columns(records, self.keys))

    def extend_columns(self, columns: dict[str, np.ndarray]) -> int:
        added = len(columns["step"])
        if not added:
            return 0
        steps = columns["step"]
        for key, trace in self.traces.items():
            trace.extend(steps, columns[key])
        for key in self.keys:
            hits = np.flatnonzero(np.isfinite(columns[key]))
            if len(hits):
                self._latest[key] = float(columns[key][hits[-1]])
        self.n += added
        self.last_step = int(steps[-1])
        return added

    def last(self, key: str) -> float:
        """The last finite value of `key`, NaN if none yet."""
        return self._latest[key]

    def trace(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of `key` to draw: at most max_points."""
        return self.traces[key].points()

    @property
    def points_held(self) -> int:
        return sum(t.held for t in self.traces.values())


class RunSeries:
    """Every rank's `RankSeries` of one run, and the two traces that combine the ranks step by
    step: the global throughput (the slowest rank's samples/s: ranks step in lockstep) and the loss
    (the mean over ranks). A step is combined once every rank has recorded it; ranks write steps
    1, 2, ... in order, so only the steps some ranks are ahead by wait here.
    Indexable like the list of its ranks (`series[0].last_step`).
    """

    def __init__(self, world_size: int, max_points: int = DEFAULT_MAX_POINTS):
        self.ranks = [RankSeries(max_points=max_points) for _ in range(world_size)]
        self.global_rate = Decimated(max_points)
        self.loss = Decimated(max_points)
        self.device_memory = False  # whether any rank recorded accelerator memory (GPU ranks)
        # Per rank: (step, samples_per_s, loss) columns of steps not every rank has recorded yet.
        self._waiting: list[list[np.ndarray]] = [[] for _ in range(world_size)]

    def __len__(self) -> int:
        return len(self.ranks)

    def __getitem__(self, rank: int) -> RankSeries:
        return self.ranks[rank]

    def __iter__(self) -> Iterator[RankSeries]:
        return iter(self.ranks)

    @classmethod
    def from_records(cls, records: Sequence[Iterable[dict[str, Any]]],
                     max_points: int = DEFAULT_MAX_POINTS) -> RunSeries:
        series = cls(len(records), max_points)
        series.extend([step_columns(r) for r in records])
        return series

    def extend(self, columns: Sequence[dict[str, np.ndarray]]) -> int:
        """Append each rank's new columns (`step_columns` of its new records); returns how many records."""
        added = 0
        for rank, (series, cols) in enumerate(zip(self.ranks, columns, strict=True)):
            added += series.extend_columns(cols)
            if len(cols["step"]):
                self._waiting[rank].append(np.stack([cols["step"], cols["samples_per_s"], cols["loss"]]))
                self.device_memory = self.device_memory or bool(np.isfinite(cols["device_allocated_bytes"]).any())
        self._combine()
        return added

    def _combine(self) -> None:
        if not self.ranks:
            return
        waiting = [np.concatenate(w, axis=1) if w else np.empty((3, 0)) for w in self._waiting]
        common = min(w.shape[1] for w in waiting)
        if common:
            steps = waiting[0][0, :common]
            self.global_rate.extend(steps, np.minimum.reduce([w[1, :common] for w in waiting]))
            self.loss.extend(steps, np.mean([w[2, :common] for w in waiting], axis=0))
        self._waiting = [[w[:, common:]] if w.shape[1] > common else [] for w in waiting]

    @property
    def points_held(self) -> int:
        """Points the traces keep, bounded by max_points per trace whatever the run's length."""
        return sum(s.points_held for s in self.ranks) + self.global_rate.held + self.loss.held


@dataclass
class TraceData:
    """One plotly trace: its data and its look (plotly keyword arguments)."""

    name: str
    x: np.ndarray
    y: np.ndarray
    kind: str = "scatter"  # or "bar"
    style: dict[str, Any] = field(default_factory=dict)


def memory_kind(series: RunSeries) -> str:
    """"device" when the ranks recorded accelerator memory (GPU), else "host" (CPU ranks: RSS)."""
    return "device" if series.device_memory else "host"


MEMORY_SERIES = {  # kind -> ((key, name suffix, dash), ...)
    "device": (("device_allocated_bytes", "allocated", "solid"), ("device_peak_bytes", "peak", "dash")),
    # CPU ranks: RSS only (peak RSS is in the run's summary); half the traces to refresh at 8 ranks.
    "host": (("rss_bytes", "RSS", "solid"),),
}
MEMORY_TITLES = {"device": "device memory (MiB)", "host": "host RSS (MiB)",
                 "sampled": "RSS of the rank's processes (MiB)"}

# Script mode (labkit.rank.script): the rank guard's `sample` records, the RSS of each rank's process tree
# seen from outside every second, charted against time (a script need not record any step).
SAMPLE_KEYS = ("time_s", "rss_bytes")


def sampled_memory(world_size: int, max_points: int = DEFAULT_MAX_POINTS) -> list[Decimated]:
    """One bounded (time_s, rss_bytes) trace per rank for a script run's outside samples."""
    return [Decimated(max_points) for _ in range(world_size)]


def extend_samples(samples: Sequence[Decimated], polled: Sequence[Iterable[dict[str, Any]]]) -> int:
    """Add each rank's new `sample` records to its trace; returns how many were added."""
    added = 0
    for trace, records in zip(samples, polled, strict=True):
        columns = step_columns(records, SAMPLE_KEYS, "sample")
        trace.extend(columns["time_s"], columns["rss_bytes"])
        added += len(columns["time_s"])
    return added


def run_traces(series: RunSeries, *, memory: str = "host", label: str | None = None,
               color: str | None = None, samples: Sequence[Decimated] | None = None) -> dict[str, list[TraceData]]:
    """The traces of each chart for one run, x = optimizer step; with `samples` (script mode: the
    guard's outside RSS samples per rank) the memory chart is those samples against time.

    Live run (`label` None): global and per-rank throughput, per-rank memory and peak,
    stacked model-state bars per rank, mean loss. Overlay of a past run (`label` = its id):
    the same minus per-rank throughput, every trace dotted in `color`, names prefixed.
    Global throughput is the slowest rank's global_batch / step time at each step (ranks
    step in lockstep); a rank's own throughput is the samples it processed per second.
    Every trace comes decimated (`Decimated`): the work is O(max_points) per trace, whatever the
    run's length.
    """
    world = len(series)
    overlay = label is not None
    prefix = f"{label} · " if overlay else ""
    group = {"legendgroup": label} if overlay else {}

    def line(rank: int | None, dash: str = "solid", width: float = 1.5) -> dict[str, Any]:
        if overlay:
            return {"mode": "lines", "line": {"color": color, "dash": "dot", "width": width}, **group}
        shade = "#222222" if rank is None else RANK_COLORS[rank % len(RANK_COLORS)]
        return {"mode": "lines", "line": {"color": shade, "dash": dash, "width": width}}

    out: dict[str, list[TraceData]] = {chart: [] for chart in CHARTS}
    # -- throughput ------------------------------------------------------------------------
    x, y = series.global_rate.points()
    out["throughput"].append(TraceData(f"{prefix}global", x, y, style=line(None, width=2.5)))
    if not overlay:
        for rank, s in enumerate(series):
            x, y = s.trace("samples_per_s")
            out["throughput"].append(TraceData(f"rank {rank}", x, y / world, style=line(rank)))

    # -- memory per rank -------------------------------------------------------------------
    for rank, sampled in enumerate(samples or ()):
        x, y = sampled.points()
        out["memory"].append(TraceData(f"{prefix}rank {rank} RSS (sampled)", x, y / MIB, style=line(rank)))
    if samples is None:  # script mode: the memory chart is the samples'
        for rank, s in enumerate(series):
            for key, suffix, dash in MEMORY_SERIES[memory]:
                x, y = s.trace(key)
                out["memory"].append(TraceData(f"{prefix}rank {rank} {suffix}", x, y / MIB,
                                               style=line(rank, dash)))

    # -- model states, stacked per rank (latest census) ------------------------------------
    names = np.array([f"{label} r{rank}" if overlay else f"rank {rank}" for rank in range(world)], dtype=object)

    def latest(s: RankSeries, key: str) -> float:
        value = s.last(key)
        return 0.0 if math.isnan(value) else value

    parts = {
        "params": [latest(s, "param_bytes") for s in series],
        # With optimizer offload, host_optim_bytes (optimizer + master) and host_grad_bytes (the
        # gradient partitions the optimizer reads) live on the host: their own bar.
        "grads": [latest(s, "grad_bytes") - latest(s, "host_grad_bytes") for s in series],
        "optimizer + master": [latest(s, "optim_bytes") + latest(s, "master_bytes") - latest(s, "host_optim_bytes")
                               for s in series],
        "offloaded to host": [latest(s, "host_optim_bytes") + latest(s, "host_grad_bytes") for s in series],
    }
    for name, shade in STATE_PARTS:
        style = {"marker": {"color": shade, "opacity": 0.5 if overlay else 1.0}, "showlegend": not overlay, **group}
        out["state"].append(TraceData(f"{prefix}{name}", names, np.array(parts[name]) / MIB, kind="bar",
                                      style=style))

    # -- loss: mean over ranks -------------------------------------------------------------
    x, y = series.loss.points()
    out["loss"].append(TraceData(f"{prefix}loss", x, y, style=line(None, width=2)))
    return out


def overlay_label(run_id: str) -> str:
    """A run's short name in legends: its id without the date and time ("zero3-z3-w2-b64-3eb0")."""
    parts = run_id.split("-", 2)  # ids are "<YYYYMMDD>-<HHMMSS>-<name>-<hex>"
    return parts[2] if len(parts) == 3 and parts[0].isdigit() and parts[1].isdigit() else run_id


def load_series(run_dir: str | Path, max_points: int = DEFAULT_MAX_POINTS) -> RunSeries:
    """Every rank's series of a run directory (a past run, for overlays)."""
    return load_run_series(run_dir, max_points)[0]


def load_run_series(run_dir: str | Path,
                    max_points: int = DEFAULT_MAX_POINTS) -> tuple[RunSeries, list[Decimated] | None]:
    """A past run's series and, for a script run, every rank's outside memory samples (None for
    labkit's own runs); each rank file is read once."""
    config = read_json(Path(run_dir) / "config.json") or {}
    records = [read_records(rank_file(run_dir, rank)) for rank in range(int(config.get("world_size", 1)))]
    samples = None
    if config.get("script"):
        samples = sampled_memory(len(records), max_points)
        extend_samples(samples, records)
    return RunSeries.from_records(records, max_points), samples


# -- widgets -----------------------------------------------------------------------------
FIGURE_WIDTH = 470  # two charts side by side in a JupyterLab notebook of a 1400 px wide window
CHART_LAYOUT = {
    "throughput": ("Throughput", "samples/s"),
    "memory": ("Memory per rank", MEMORY_TITLES["host"]),
    "state": ("Model states per rank (latest census)", "MiB"),
    "loss": ("Loss (mean over ranks)", "loss"),
}


@functools.cache
def _locked_figure_class() -> type:
    """A FigureWidget that handles the browser's messages under its dashboard's lock.

    ipywidgets handles each message from the browser (plotly.js answers every edit with a
    delta) inside `hold_trait_notifications()`, which is per widget, not per thread. A trait the
    update thread sets meanwhile is held and compressed with its next change, and plotly sends
    each edit as `_py2js_addTraces = msg` then `= None`: the browser receives only the None. A
    lost addTraces left a chart empty for the rest of the run (about one run in three under
    load, seen in the browser test). So incoming messages and the update thread's edits take
    turns on one lock.
    """
    import plotly.graph_objects as go

    class LockedFigureWidget(go.FigureWidget):
        def __init__(self, *args: Any, sync_lock: threading.RLock, **kwargs: Any):
            self._sync_lock = sync_lock  # before super(): the comm may deliver messages from then on
            super().__init__(*args, **kwargs)

        def _handle_msg(self, msg: dict) -> None:
            with self._sync_lock:
                super()._handle_msg(msg)

    return LockedFigureWidget


def _new_figure(chart: str, sync_lock: threading.RLock):
    title, ytitle = CHART_LAYOUT[chart]
    layout: dict[str, Any] = {
        # A fixed size: FigureWidget does not follow its container, and plotly's default
        # width (700 px) would be clipped in a two-column grid.
        "title": {"text": title, "font": {"size": 14}}, "width": FIGURE_WIDTH, "height": 360,
        "template": "plotly_white", "margin": {"l": 60, "r": 10, "t": 40, "b": 40},
        "yaxis": {"title": {"text": ytitle}}, "uirevision": "keep",  # keep the user's zoom across updates
        # Below the plot, so long overlay names never squeeze it.
        "legend": {"font": {"size": 10}, "orientation": "h", "yanchor": "top", "y": -0.18, "x": 0},
    }
    if chart == "state":
        layout["barmode"] = "stack"
    else:
        layout["xaxis"] = {"title": {"text": "step"}}
    return _locked_figure_class()(layout=layout, sync_lock=sync_lock)


def _same(old: Any, new: np.ndarray) -> bool:
    """Whether a trace already holds `new` (NaN equal to NaN; the bars' labels are strings)."""
    if old is None or len(old) != len(new):
        return False
    if new.dtype.kind == "f":
        return np.array_equal(old, new, equal_nan=True)
    return list(old) == list(new)


def _plotly_trace(trace: TraceData):
    import plotly.graph_objects as go

    kind = go.Bar if trace.kind == "bar" else go.Scatter
    return kind(name=trace.name, x=trace.x, y=trace.y, **trace.style)


def check_refresh_s(refresh_s: Any) -> float:
    """The update thread's poll interval: at least MIN_REFRESH_S seconds (0 or 1e-6 polled the rank files in a busy
    loop), else a ValueError naming `refresh_s`. Pure."""
    if isinstance(refresh_s, bool) or not isinstance(refresh_s, (int, float)) or not math.isfinite(refresh_s) \
            or refresh_s < MIN_REFRESH_S:
        raise ValueError(f"refresh_s must be a number of seconds of at least {MIN_REFRESH_S} (how often the charts "
                         f"poll the run), got {refresh_s!r}")
    return float(refresh_s)


class Dashboard:
    """Four live FigureWidgets for one run at a time, plus overlays of past runs.

    `on_tick(run, series, final, error)` (optional) is called from the update thread after
    every poll, and once more with final=True when the thread ends on its own: the run is
    done, or the thread gave up (`error` then says why; None otherwise). The panel hangs
    its status line and log tail on it, so a run costs one thread, not several. `run` and
    `series` are the ones the thread follows, not whatever the dashboard shows by then.
    """

    def __init__(self, run: Any = None, *, refresh_s: float = REFRESH_S, max_points: int = DEFAULT_MAX_POINTS,
                 on_tick: Callable[[Any, RunSeries, bool, str | None], None] | None = None):
        import ipywidgets as W

        self.refresh_s = check_refresh_s(refresh_s)
        self.max_points = max_points
        self.on_tick = on_tick
        self.starting_timeout_s = STARTING_TIMEOUT_S
        # Guards series, overlays and figures: the thread extends and plots, the kernel's
        # thread overlays, rebuilds and handles the browser's messages to the figures.
        self._lock = threading.RLock()
        self.figures = {chart: _new_figure(chart, self._lock) for chart in CHARTS}
        # Two per row where there is room, one per row where there is not.
        self.widget = W.Box(list(self.figures.values()), layout=W.Layout(display="flex", flex_flow="row wrap",
                                                                         grid_gap="8px"))
        self.run: Any = None
        self.series = RunSeries(0, max_points)
        self.samples: list[Decimated] | None = None  # script mode: the guard's memory samples per rank
        self.memory = "host"
        self.overlays: dict[str, dict[str, list[TraceData]]] = {}  # run id -> traces per chart
        self.first_point_at: float | None = None  # time.monotonic() of the first plotted step
        self.refreshes = 0
        self.ticks = 0                             # polls of the current thread
        self.last_refresh_s: float | None = None  # how long the last refresh took (kernel-side)
        self.points_sent = 0                      # x and y values the last refresh sent to the figures
        self.error: str | None = None             # why the update thread gave up, if it did
        self._live_counts = {chart: 0 for chart in CHARTS}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        if run is not None:
            self.watch(run)

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    # -- the live run ----------------------------------------------------------------------
    def watch(self, run: Any) -> None:
        """Follow `run` (a started `labkit.Run`, or `Run.load(dir)` of a past one) until it is done."""
        from labkit.runtime.devices import detect_devices

        if not self.close():
            raise RuntimeError(f"the update thread of {self.run.run_dir.name} did not stop within "
                               f"{JOIN_TIMEOUT_S:g} s; not following a second run beside it")
        tails = [RecordTail(rank_file(run.run_dir, rank)) for rank in range(run.config.world_size)]
        series = RunSeries(len(tails), self.max_points)
        samples = sampled_memory(len(tails), self.max_points) if getattr(run.config, "script", None) else None
        kind = "host" if detect_devices().is_cpu else "device"
        with self._lock:
            self.run = run
            self.first_point_at = None
            self.refreshes = 0
            self.ticks = 0
            self.error = None
            self.show_series(series, memory=kind, samples=samples)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(run, series, tails, self._stop, samples),
                                        name="labkit-dashboard", daemon=True)
        self._thread.start()

    def show_series(self, series: RunSeries, memory: str = "host",
                    samples: list[Decimated] | None = None) -> None:
        """Make `series` (and a script run's memory `samples`) the live traces (rebuilding the
        figures); `refresh()` plots them.

        An update thread following other series stops at its next poll.
        """
        with self._lock:
            self.series = series
            self.samples = samples
            self.memory = memory
            self._rebuild()

    def _loop(self, run: Any, series: RunSeries, tails: list[RecordTail], stop: threading.Event,
              samples: list[Decimated] | None = None) -> None:
        error = None
        final = False
        started = time.monotonic()
        try:
            while not stop.is_set():
                # Ask "done?" before polling: the ranks' last records are on disk before
                # summary.json is, so the poll after a True answer reads everything.
                status = run.status
                done = status in FINAL_STATUSES
                # Only the bytes written since the last poll (RecordTail), read outside the lock.
                polled = [t.poll() for t in tails]
                columns = [step_columns(records) for records in polled]
                with self._lock:
                    if series is not self.series:
                        return  # the dashboard moved on (watch, show_series): not ours to plot
                    added = series.extend(columns)
                    if samples is not None:
                        added += extend_samples(samples, polled)
                    if added or done or self.refreshes == 0:
                        self.refresh()
                    self.ticks += 1
                if done:
                    final = True
                    return
                # Only a reloaded run reads "starting" (a launched one has its supervisor's handle).
                if status == "starting" and time.monotonic() - started > self.starting_timeout_s:
                    final = True
                    error = (f"{run.run_dir.name} still reads 'starting' after {self.starting_timeout_s:g} s: "
                             "its supervisor never wrote status.json (it probably died); stopped following it")
                    return
                if self.on_tick is not None:
                    self.on_tick(run, series, False, None)
                if stop.wait(self.refresh_s):
                    return
        except Exception:
            final = True
            error = traceback.format_exc()
            print(f"labkit dashboard update thread stopped:\n{error}", file=sys.stderr)
        finally:
            with self._lock:
                current = series is self.series
                if current:
                    self.error = error
            # The final tick re-enables the panel's controls, even after an error.
            if final and current and self.on_tick is not None:
                try:
                    self.on_tick(run, series, True, error)
                except Exception:
                    print(f"labkit dashboard final update failed:\n{traceback.format_exc()}", file=sys.stderr)

    def refresh(self) -> float:
        """Re-plot the live traces from the series; returns the seconds it took (kernel-side cost).
        At most max_points points per trace are shaped and sent, whatever the run's length."""
        start = time.perf_counter()
        with self._lock:
            traces = run_traces(self.series, memory=self.memory, samples=self.samples)
            sent = 0
            for chart, fig in self.figures.items():
                with fig.batch_update():
                    # Live traces come first in fig.data; overlays follow and never change. Same count:
                    # _rebuild counted them from the same series and memory kind, under this lock.
                    for trace, data in zip(traces[chart], fig.data[:self._live_counts[chart]], strict=True):
                        # Each assignment costs plotly's validation (~0.2 ms): skip unchanged data.
                        if not _same(data.x, trace.x):
                            data.x = trace.x
                            sent += len(trace.x)
                        if not _same(data.y, trace.y):
                            data.y = trace.y
                            sent += len(trace.y)
            self.points_sent = sent
            self.refreshes += 1
            if self.first_point_at is None and any(len(t.x) for t in traces["throughput"] + traces["memory"]):
                self.first_point_at = time.monotonic()
        self.last_refresh_s = time.perf_counter() - start
        return self.last_refresh_s

    def last_step(self) -> int:
        """The last step rank 0 recorded in the live series (0 before the first)."""
        with self._lock:
            return self.series[0].last_step if self.series else 0

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the update thread to end (the run done); True if it has."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        return not self.running

    def close(self) -> bool:
        """Stop the update thread (the figures keep what they show); False if it did not end in time.

        A thread that outlives the join is kept (`running` stays True) so that nobody starts
        a second one beside it; it ends at its next poll.
        """
        self._stop.set()
        thread = self._thread
        if thread is None:
            return True
        if thread is threading.current_thread():
            return False  # from on_tick: the loop ends when the tick returns
        thread.join(timeout=JOIN_TIMEOUT_S)
        if thread.is_alive():
            return False
        self._thread = None
        return True

    # -- past runs -------------------------------------------------------------------------
    def overlay(self, runs: str | Path | Iterable[str | Path]) -> list[str]:
        """Draw past runs (directories or ids in the run store, or one of them) on the same axes; returns their
        ids."""
        from labkit.launch.store import default_root

        loaded = []
        # one run's id, not its letters; the files are read outside the lock: the update thread keeps going
        for run in [runs] if isinstance(runs, (str, Path)) else runs:
            path = Path(run)
            if not path.is_dir():
                path = default_root() / str(run)
            loaded.append((path, *load_run_series(path, self.max_points)))
        with self._lock:
            for path, series, samples in loaded:
                color = OVERLAY_COLORS[len(self.overlays) % len(OVERLAY_COLORS)]
                label = overlay_label(path.name)
                self.overlays[label] = run_traces(series, memory=memory_kind(series), label=label, color=color,
                                                  samples=samples)
            self._rebuild()
        return [path.name for path, _, _ in loaded]

    def clear_overlays(self) -> None:
        with self._lock:
            self.overlays.clear()
            self._rebuild()

    def _rebuild(self) -> None:
        """(Under the lock.) Replace every figure's traces: the live run's (empty until refreshed), then the
        overlays'."""
        live = run_traces(self.series, memory=self.memory, samples=self.samples)
        for chart, fig in self.figures.items():
            traces = live[chart] + [t for overlay in self.overlays.values() for t in overlay[chart]]
            self._live_counts[chart] = len(live[chart])
            fig.data = ()  # plotly only allows assigning a subset of the current traces
            if traces:
                fig.add_traces([_plotly_trace(t) for t in traces])
            if chart == "memory":
                fig.layout.yaxis.title.text = MEMORY_TITLES["sampled" if self.samples is not None else self.memory]
                fig.layout.xaxis.title.text = "time since the run started (s)" if self.samples is not None else "step"

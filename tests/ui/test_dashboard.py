"""The dashboard's data shaping (pure functions) and the panel's binding to RunConfig/Run, without a browser.

ipywidgets and FigureWidget work without a frontend (their comm messages go nowhere), so the
panel and the dashboard thread are exercised here on synthetic run directories; real runs in
a real browser are tests/browser/test_panel_browser.py.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

import labkit.ui.dashboard
import labkit.ui.panel
from labkit import RunConfig
from labkit.core.config import ConfigError
from labkit.core.files import write_json_atomic
from labkit.launch.run import Run, run_name
from labkit.launch.store import new_run_dir
from labkit.launch.summary import summarize
from labkit.ui.dashboard import (
    REFRESH_S,
    STEP_KEYS,
    Dashboard,
    Decimated,
    RankSeries,
    RunSeries,
    load_series,
    memory_kind,
    run_traces,
    step_columns,
)
from labkit.ui.panel import LabPanel, rank_log, status_line, tail_text

MIB = 2**20


def step_record(rank: int, step: int, world: int = 2, **extra) -> dict:
    return {"rank": rank, "event": "step", "step": step, "time_s": step * 0.1, "step_time_s": 0.1 + 0.01 * rank,
            "samples_per_s": 640.0 / (0.1 + 0.01 * rank), "loss": 2.0 / step + rank, "rss_bytes": (100 + step) * MIB,
            "peak_rss_bytes": (200 + step) * MIB, "param_bytes": 4 * MIB, "grad_bytes": 2 * MIB,
            "optim_bytes": 8 * MIB, "master_bytes": 4 * MIB, "host_optim_bytes": 0, **extra}


def write_run(run_dir: Path, config: RunConfig, steps: int, *, status: str | None = "finished") -> Path:
    """A run directory as a real run leaves it: config, rank files, (summary)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_dir / "config.json", config.to_dict())
    for rank in range(config.world_size):
        lines = [{"rank": rank, "time_s": 0.0, "event": "start", "pid": 1}]
        lines += [step_record(rank, step, config.world_size) for step in range(1, steps + 1)]
        if status == "finished":
            lines.append({"rank": rank, "time_s": steps * 0.1 + 0.05, "event": "done", "steps": steps})
        (run_dir / f"rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        (run_dir / "logs").mkdir(exist_ok=True)
        (run_dir / "logs" / f"20260101_rank{rank}.log").write_text(f"hello from rank {rank}\n")
    if status is not None:
        write_json_atomic(run_dir / "summary.json", summarize(run_dir, config.to_dict(), status=status, cause=None))
    return run_dir


def config(**overrides) -> RunConfig:
    return RunConfig(**{"example": "zero3", "world_size": 2, "micro_batch": 32, "steps": 10, **overrides})


# -- decimation ----------------------------------------------------------------------------
def _decimated(y, max_points: int = 2000, chunks: int = 1) -> tuple[Decimated, np.ndarray, np.ndarray]:
    """A Decimated fed y (x = 1, 2, ...) in `chunks` pieces, and the points it draws."""
    trace = Decimated(max_points)
    x = np.arange(1, len(y) + 1, dtype=float)
    for part in np.array_split(np.arange(len(y)), chunks):
        trace.extend(x[part], np.asarray(y, dtype=float)[part])
    return (trace, *trace.points())


@pytest.mark.parametrize("n", [0, 1, 2, 7, 1995, 1996, 1997, 2000, 2001, 3999, 4001, 100_000, 123_457])
def test_decimation_keeps_at_most_max_points_first_and_last(n):
    y = np.sin(np.arange(n) / 50.0)
    trace, xs, ys = _decimated(y)
    assert len(xs) <= 2000 and trace.n == n
    if n:
        assert xs[0] == 1 and xs[-1] == n and ys[-1] == y[-1]
        assert np.all(np.diff(xs) > 0)
        assert np.array_equal(ys, y[xs.astype(int) - 1])  # real points, not averages
    if n < 1996:  # below the room for full buckets: every point
        assert list(xs) == list(range(1, n + 1))
    if n >= 4001:  # and not a handful: the buckets use the room they have
        assert len(xs) >= 990


@pytest.mark.parametrize("chunks", [1, 7, 1000])
def test_decimation_keeps_spikes_and_dips_whatever_the_chunks(chunks):
    y = np.full(100_000, 100.0)
    y[54_320], y[77_776] = 1000.0, 1.0  # one step each, in 100,000
    y[np.arange(0, 100_000, 3)] += 0.5   # and noise that must not crowd them out
    _, xs, ys = _decimated(y, max_points=200, chunks=chunks)
    assert len(xs) <= 200
    assert ys.max() == 1000.0 and xs[ys.argmax()] == 54_321
    assert ys.min() == 1.0 and xs[ys.argmin()] == 77_777
    assert xs[-1] == 100_000


def test_decimation_in_one_go_or_point_by_point_draws_the_same():
    y = np.random.default_rng(0).normal(size=5_000)
    _, whole_x, whole_y = _decimated(y, max_points=100)
    _, split_x, split_y = _decimated(y, max_points=100, chunks=5_000)
    assert np.array_equal(whole_x, split_x) and np.array_equal(whole_y, split_y)


def test_decimation_skips_missing_values():
    trace, xs, ys = _decimated([1.0, math.nan, 3.0, math.nan])
    assert list(xs) == [1, 3] and list(ys) == [1.0, 3.0] and trace.n == 2
    with pytest.raises(ValueError):
        Decimated(4)


# -- records -> columns --------------------------------------------------------------------
def test_step_columns_skip_lifecycle_records_and_mark_missing_keys_nan():
    records = [{"event": "start"}, step_record(0, 1), {"event": "step", "step": 2, "loss": None}, {"event": "done"}]
    cols = step_columns(records)
    assert list(cols["step"]) == [1.0, 2.0]
    assert cols["loss"][0] == pytest.approx(2.0) and math.isnan(cols["loss"][1])
    assert math.isnan(cols["device_allocated_bytes"][0])
    assert all(c.dtype == np.float64 for c in cols.values())  # float64: plotly sends it as a binary buffer


def test_rank_series_grows_and_remembers_last_census():
    series = RankSeries()
    for step in range(1, 1001):
        extra = {} if step % 10 == 0 else {"param_bytes": None}  # census only every 10 steps
        series.extend([step_record(0, step, **extra)])
    assert series.n == 1000 and series.last_step == 1000
    assert list(series.trace("rss_bytes")[0][:3]) == [1, 2, 3]
    assert series.last("param_bytes") == 4 * MIB
    series.extend([step_record(0, 1001, param_bytes=None)] * 100)
    assert series.last("param_bytes") == 4 * MIB  # found beyond the last 64 records too
    assert math.isnan(RankSeries().last("loss"))


# -- series -> traces ----------------------------------------------------------------------
def two_ranks(steps: int = 50, max_points: int = 2000, **extra) -> RunSeries:
    return RunSeries.from_records([[step_record(r, s, **extra) for s in range(1, steps + 1)] for r in range(2)],
                                  max_points)


def test_live_traces_per_chart():
    series = two_ranks()
    series.extend([step_columns([]), step_columns([step_record(1, 51)])])  # rank 1 one step ahead:
    # global throughput and loss are drawn for the steps every rank has recorded
    traces = run_traces(series)
    names = {chart: [t.name for t in ts] for chart, ts in traces.items()}
    assert names == {
        "throughput": ["global", "rank 0", "rank 1"],
        "memory": ["rank 0 RSS", "rank 1 RSS"],  # CPU ranks: RSS; GPU: allocated and peak
        "state": ["params", "grads", "optimizer + master", "offloaded to host"],
        "loss": ["loss"],
    }
    glob, r0, r1 = traces["throughput"]
    assert len(glob.x) == 50 and len(r0.x) == 50 and len(r1.x) == 51
    # Global: the slowest rank (rank 1) bounds the lockstep throughput; per rank: its own samples.
    assert glob.y[0] == pytest.approx(640.0 / 0.11)
    assert r0.y[0] == pytest.approx(640.0 / 0.1 / 2)
    assert traces["memory"][0].y[0] == pytest.approx(101)  # MiB
    params, _grads, optim, host = traces["state"]
    assert list(params.x) == ["rank 0", "rank 1"] and list(params.y) == [4, 4]
    assert list(optim.y) == [12, 12] and list(host.y) == [0, 0]
    assert traces["loss"][0].y[0] == pytest.approx((2.0 + 3.0) / 2)  # mean over ranks
    series.extend([step_columns([step_record(0, 51)]), step_columns([])])  # rank 0 catches up
    caught_up = run_traces(series)
    assert caught_up["throughput"][0].x[-1] == 51 and caught_up["loss"][0].x[-1] == 51


def test_device_memory_and_offload_split():
    series = two_ranks(device_allocated_bytes=10 * MIB, device_peak_bytes=20 * MIB, host_optim_bytes=12 * MIB,
                       host_grad_bytes=1 * MIB)
    assert memory_kind(series) == "device" and memory_kind(two_ranks()) == "host"
    traces = run_traces(series, memory="device")
    assert [t.name for t in traces["memory"]] == ["rank 0 allocated", "rank 0 peak", "rank 1 allocated",
                                                  "rank 1 peak"]
    assert traces["memory"][1].y[-1] == pytest.approx(20) and traces["memory"][1].style["line"]["dash"] == "dash"
    # Offloaded: optimizer + master (12 MiB) and the host gradient partition (1 of the 2 MiB of grads).
    assert list(traces["state"][1].y) == [1, 1]
    assert list(traces["state"][2].y) == [0, 0] and list(traces["state"][3].y) == [13, 13]


def test_long_runs_are_decimated_with_the_last_point():
    traces = run_traces(two_ranks(steps=5000, max_points=100))
    for chart in ("throughput", "memory", "loss"):
        for trace in traces[chart]:
            assert len(trace.x) <= 100 and trace.x[-1] == 5000, (chart, trace.name)


def test_overlay_traces_are_labelled_and_dotted():
    traces = run_traces(two_ranks(), label="old-run", color="#123456")
    assert [t.name for t in traces["throughput"]] == ["old-run · global"]  # no per-rank throughput
    assert traces["memory"][0].name == "old-run · rank 0 RSS"
    assert traces["memory"][0].style["line"] == {"color": "#123456", "dash": "dot", "width": 1.5}
    assert list(traces["state"][0].x) == ["old-run r0", "old-run r1"]


def test_empty_run_has_empty_traces():
    traces = run_traces(RunSeries(2))
    assert all(len(t.x) == 0 for t in traces["throughput"] + traces["memory"] + traces["loss"])


def _columns(rank: int, steps: np.ndarray) -> dict[str, np.ndarray]:
    """step_columns of step_record(rank, s) for s in steps, built as arrays (100,000 dicts would be slow)."""
    n = len(steps)
    step_time = np.full(n, 0.1 + 0.01 * rank)
    cols = {key: np.full(n, math.nan) for key in STEP_KEYS}
    cols.update(step=steps.astype(float), time_s=steps * 0.1, step_time_s=step_time, samples_per_s=640.0 / step_time,
                loss=2.0 / steps + rank, rss_bytes=(100 + steps) * MIB, peak_rss_bytes=(200 + steps) * MIB)
    cols["param_bytes"][steps % 10 == 0] = 4 * MIB  # the census, every 10 steps
    return cols


def test_a_refresh_costs_the_same_at_step_100_and_100000():
    """Counted, not timed: the values the series keep, the points a refresh shapes and sends, and
    the memory the series hold do not grow with the run (the columns of every step did: 24 MB
    at 100,000 steps of 2 ranks)."""
    import tracemalloc

    max_points = 200
    series = RunSeries(2, max_points)
    dash = Dashboard(max_points=max_points)
    dash.show_series(series)

    def grow_to(step: int) -> int:
        steps = np.arange(series[0].last_step + 1, step + 1, dtype=float)
        return series.extend([_columns(rank, steps) for rank in range(2)])

    work = {}
    tracemalloc.start()
    try:
        for step in (100, 100_000):
            grow_to(step - 1)
            dash.refresh()
            assert grow_to(step) == 2  # a poll's new records: one per rank, whatever came before
            dash.refresh()
            traces = run_traces(series)
            shaped = sum(len(t.x) for chart in ("throughput", "memory", "loss") for t in traces[chart])
            work[step] = {"sent": dash.points_sent, "shaped": shaped, "held": series.points_held,
                          "bytes": tracemalloc.get_traced_memory()[0]}
    finally:
        tracemalloc.stop()
    lines = 3 + 2 + 1  # throughput (global + 2 ranks), memory (2 ranks' RSS), loss
    for step, counts in work.items():
        assert counts["shaped"] <= lines * max_points, (step, counts)
        assert counts["sent"] <= 2 * lines * max_points + 2 * 2 * 4, (step, counts)  # x and y; the 4 bars
        assert counts["held"] <= (2 * len(series[0].traces) + 2) * max_points, (step, counts)
    assert work[100_000]["bytes"] - work[100]["bytes"] < 256 * 1024, work
    # What the charts show stays right: the last step, and the census's latest value.
    throughput = {t.name: t for t in dash.figures["throughput"].data}
    assert throughput["global"].x[-1] == 100_000 and throughput["rank 1"].x[-1] == 100_000
    assert series[0].last("param_bytes") == 4 * MIB


def test_the_dashboard_thread_reads_each_byte_of_the_rank_files_once(tmp_path, rank_file_reads):
    run_dir = write_run(tmp_path / "live", config(), steps=3, status=None)
    dash = Dashboard(Run.load(run_dir), refresh_s=0.01)
    try:
        for step in range(4, 40):
            for rank in (0, 1):
                with open(run_dir / f"rank{rank}.jsonl", "a") as handle:
                    handle.write(json.dumps(step_record(rank, step)) + "\n")
            _wait(lambda step=step: dash.last_step() == step)
        ticks = dash.ticks
        _wait(lambda: dash.ticks >= ticks + 5)  # polls with nothing new read nothing
    finally:
        dash.close()
    sizes = sum((run_dir / f"rank{rank}.jsonl").stat().st_size for rank in (0, 1))
    # Every byte once: each poll read what was appended since the last one, never the file so far.
    assert sum(rank_file_reads.reads) == sizes and len(rank_file_reads.reads) > 2 * 36


# -- small panel helpers -------------------------------------------------------------------
def test_status_lines():
    assert status_line("created") == "status: idle"
    assert status_line("running", step=0, steps=20, run_id="r").startswith("status: starting · r")
    assert status_line("running", step=3, steps=20, run_id="r") == "status: running step 3/20 · r"
    done = status_line("finished", steps=20, summary={"steps_completed": 20, "samples_per_s": 1234.5,
                                                      "final_loss": 0.5})
    assert done == "status: finished 20/20 steps · 1234 samples/s · final loss 0.5000"
    assert status_line("stopped", step=4, steps=20) == "status: stopped at step 4/20"
    failed = status_line("failed", summary={"cause": "rank 1: RuntimeError: boom", "failed_rank": 1})
    assert failed == "status: failed · rank 1: RuntimeError: boom"
    assert status_line("oom", summary={"cause": "out of memory", "failed_rank": 0}) == \
        "status: oom · rank 0: out of memory"
    assert "finished" not in status_line("stopped", steps=20)  # the browser test waits for "finished"


def test_tail_text(tmp_path):
    path = tmp_path / "x.log"
    path.write_text("".join(f"line {i}\n" for i in range(1000)))
    assert tail_text(path, max_lines=3) == "line 997\nline 998\nline 999"
    assert tail_text(path, max_lines=10**6, max_bytes=100).splitlines()[0].startswith("line 9")
    assert tail_text(tmp_path / "missing.log") == ""


# -- the dashboard thread ------------------------------------------------------------------
def test_dashboard_plots_a_finished_run_and_stops(tmp_path):
    run = Run.load(write_run(tmp_path / "r1", config(), steps=12))
    ticks = []
    dash = Dashboard(run, refresh_s=0.05, on_tick=lambda r, series, final, error: ticks.append((r, final, error)))
    assert dash.join(timeout=30), "the update thread must end when the run is done"
    assert dash.error is None and ticks[-1] == (run, True, None)
    assert [final for _, final, _ in ticks].count(True) == 1
    data = {chart: {t.name: len(t.x) for t in fig.data} for chart, fig in dash.figures.items()}
    assert data["throughput"] == {"global": 12, "rank 0": 12, "rank 1": 12}
    assert data["memory"] == {"rank 0 RSS": 12, "rank 1 RSS": 12}
    assert dash.first_point_at is not None and dash.refreshes >= 1


def test_dashboard_follows_new_records_until_closed(tmp_path):
    run_dir = write_run(tmp_path / "live", config(), steps=3, status=None)  # no summary: still going
    run = Run.load(run_dir)
    dash = Dashboard(run, refresh_s=0.05)
    try:
        _wait(lambda: len(dash.figures["throughput"].data[1].x) == 3)
        with open(run_dir / "rank0.jsonl", "a") as handle:
            handle.write(json.dumps(step_record(0, 4)) + "\n" + json.dumps(step_record(0, 5))[:20])  # 2nd cut short
        _wait(lambda: len(dash.figures["throughput"].data[1].x) == 4)
        assert len(dash.figures["throughput"].data[0].x) == 3  # global waits for rank 1
        assert dash.running
    finally:
        dash.close()
    assert not dash.running


def test_overlay_and_clear(tmp_path):
    old = write_run(tmp_path / "20260101-000000-zero3-z3-w2-b64-abcd", config(), steps=5)
    dash = Dashboard()
    dash.show_series(RunSeries(2))
    assert dash.overlay([old]) == [old.name]
    names = [t.name for t in dash.figures["loss"].data]
    assert names == ["loss", "zero3-z3-w2-b64-abcd · loss"]
    dash.clear_overlays()
    assert dash.overlay(str(old)) == [old.name]  # one run as a string: not its letters, each a missing run
    names = [t.name for t in dash.figures["loss"].data]
    assert names == ["loss", "zero3-z3-w2-b64-abcd · loss"]
    assert len(dash.figures["loss"].data[1].x) == 5
    assert len(load_series(old)) == 2
    dash.clear_overlays()
    assert [t.name for t in dash.figures["loss"].data] == ["loss"]


def test_refresh_is_at_least_twice_a_second():
    assert 0 < REFRESH_S <= 0.5
    assert Dashboard().refresh_s == REFRESH_S


def test_no_labkit_module_calls_hold_sync():
    """hold_sync() silently drops FigureWidget updates: batch_update() only."""
    calls = []
    for path in sorted(Path(labkit.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "hold_sync":
                calls.append(f"{path.name}:{node.lineno}")
    assert calls == []
    assert len(list(Path(labkit.__file__).parent.rglob("*.py"))) > 10  # the right directory


def dashboard_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "labkit-dashboard" and t.is_alive()]


def test_a_thread_never_touches_series_it_was_not_started_for(tmp_path):
    run_dir = write_run(tmp_path / "live", config(), steps=3, status=None)
    ticks = []
    dash = Dashboard(Run.load(run_dir), refresh_s=0.05, on_tick=lambda r, series, final, error: ticks.append(final))
    _wait(lambda: dash.series[0].n == 3)
    fresh = RunSeries(2)
    dash.show_series(fresh)  # e.g. a re-launch: the old thread must stop, not feed these
    with open(run_dir / "rank0.jsonl", "a") as handle:
        handle.write(json.dumps(step_record(0, 4)) + "\n")
    assert dash.join(timeout=10)
    assert fresh[0].n == 0 and dash.series is fresh
    assert True not in ticks  # no final tick: that would re-enable Launch for whatever runs now


def test_close_keeps_a_thread_that_did_not_stop_and_watch_refuses_a_second(tmp_path, monkeypatch):
    monkeypatch.setattr(labkit.ui.dashboard, "JOIN_TIMEOUT_S", 0.2)
    first = Run.load(write_run(tmp_path / "a", config(), steps=3, status=None))
    second = Run.load(write_run(tmp_path / "b", config(), steps=5, status=None))
    release = threading.Event()
    dash = Dashboard(refresh_s=0.05, on_tick=lambda r, s, final, error: release.wait(20) if r is first else None)
    dash.watch(first)
    try:
        _wait(lambda: dash.ticks >= 1)  # the thread is now stuck in its tick
        assert dash.close() is False and dash.running
        with pytest.raises(RuntimeError, match="did not stop"):
            dash.watch(second)
        assert len(dashboard_threads()) == 1
    finally:
        release.set()
    assert dash.join(timeout=10)
    dash.watch(second)
    try:
        _wait(lambda: dash.series[0].n == 5)
        assert len(dashboard_threads()) == 1 and dash.run is second
    finally:
        assert dash.close()
    assert dashboard_threads() == []


def test_a_run_stuck_starting_is_given_up(tmp_path):
    run_dir = tmp_path / "dead"
    run_dir.mkdir()
    write_json_atomic(run_dir / "config.json", config().to_dict())  # its supervisor died before status.json
    run = Run.load(run_dir)
    assert run.status == "starting"
    ticks = []
    dash = Dashboard(refresh_s=0.05, on_tick=lambda r, s, final, error: ticks.append((final, error)))
    dash.starting_timeout_s = 0.3
    dash.watch(run)
    assert dash.join(timeout=10)
    assert "still reads 'starting'" in dash.error
    assert ticks[-1][0] is True and ticks[-1][1] == dash.error


def _wait(condition, timeout: float = 20.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


# -- the panel binds to RunConfig and Run --------------------------------------------------
def plain(widget) -> str:
    return re.sub(r"<[^>]+>", "", widget.value)


def test_widgets_build_the_config_and_the_global_batch(runs_root):
    panel = LabPanel(world_size=2, micro_batch=16, grad_accum=2, dataset_size=2048)
    assert "= 64" in plain(panel.derived) and panel.message.value == ""
    panel.controls["micro_batch"].value = 8
    assert "8 × 2 × 2 = 32" in plain(panel.derived)
    panel.controls["grad_accum"].value = 4
    panel.controls["lr_scaling"].value = "linear"
    built = panel.config()
    assert (built.global_batch, built.dataset_size, built.lr_scaling) == (64, 2048, "linear")
    assert "peak LR 0.001" in plain(panel.derived)
    panel.controls["stage"].value = 1
    assert panel.config().stage == 1 and "ZeRO stage 1" in plain(panel.derived)
    with pytest.raises(TypeError):
        LabPanel(no_such_field=1)


def test_a_world_size_above_the_machine_shows_the_config_error(runs_root):
    from labkit.runtime.devices import detect_devices

    too_many = detect_devices().max_ranks + 1
    panel = LabPanel(world_size=too_many, micro_batch=4)
    assert panel.controls["world_size"].value == too_many  # kept as asked, not clamped to the maximum
    assert plain(panel.message).startswith(f"⚠ world_size: {too_many} ranks requested but this machine has")
    assert panel.launch() is None and not runs_root.exists()


@pytest.mark.parametrize("defaults,message", [
    # A dropdown cannot hold it: traitlets' "Invalid selection: value not found" named no field.
    ({"example": "bogus"}, "example: must be one of ('pytorch', 'deepspeed', 'offload', 'zero3'), got 'bogus'"),
    ({"stage": 7}, "stage: must be one of (0, 1, 2, 3) or None, got 7"),
    ({"precision": "fp8"}, "precision: must be one of ('fp32', 'bf16', 'fp16'), got 'fp8'"),
    ({"offload_optimizer": "yes"}, "offload_optimizer: must be True or False or None, got 'yes'"),
    # An integer box cannot hold text, and would round a fraction.
    ({"micro_batch": "abc"}, "micro_batch: must be a positive integer, got 'abc'"),
    ({"steps": 2.5}, "steps: must be a positive integer, got 2.5"),
    # The LR box clamped these to 1e-09 and 10 without a word.
    ({"lr": 0.0}, "lr: must be a number from 1e-09 to 10 (the LR box's range), got 0.0"),
    ({"lr": -1.0}, "lr: must be a number from 1e-09 to 10 (the LR box's range), got -1.0"),
    ({"lr": 100.0}, "lr: must be a number from 1e-09 to 10 (the LR box's range), got 100.0"),
    ({"model": 3}, "model: must be a string, got 3"),
])
def test_a_default_no_control_can_hold_is_refused_naming_the_field(runs_root, defaults, message):
    with pytest.raises(ConfigError) as info:
        LabPanel(**defaults)
    assert str(info.value) == message and info.value.field == next(iter(defaults))
    assert not runs_root.exists() and dashboard_threads() == []


def test_defaults_the_controls_hold_are_kept_as_given(runs_root):
    panel = LabPanel(lr=10.0, world_size=0)  # the LR box's top; an int box shows 0 and the message says why
    assert panel.controls["lr"].value == 10.0 and panel.controls["world_size"].value == 0
    assert plain(panel.message).startswith("⚠ world_size:")


@pytest.mark.parametrize("refresh_s", [0, -1, 1e-6, 0.009, float("nan"), "1"])
def test_a_refresh_interval_below_a_hundredth_of_a_second_is_refused(runs_root, refresh_s):
    """refresh_s=0 (or 1e-6) polled the rank files in a busy loop for the whole run."""
    with pytest.raises(ValueError, match=r"^refresh_s must be a number of seconds of at least 0.01 .*, got "):
        LabPanel(refresh_s=refresh_s)
    with pytest.raises(ValueError, match=r"^refresh_s must be a number of seconds of at least 0.01"):
        Dashboard(refresh_s=refresh_s)
    assert Dashboard(refresh_s=0.01).refresh_s == 0.01


@pytest.mark.parametrize("env,message", [
    ({"FOO": 1}, "env: FOO=1: the value must be a string (an environment holds only strings), got int"),
    ({"": "x"}, "env: '' is not a variable name (a non-empty string without '=')"),
    ({"A=B": "x"}, "env: 'A=B' is not a variable name"),
    (["FOO=1"], "env: must be a dict of variable names to strings, got list"),
])
def test_an_env_that_is_not_strings_is_refused_naming_env_before_anything_is_written(runs_root, env, message):
    """LabPanel(env={"FOO": 1}).launch() showed a TypeError naming nothing, after writing a run directory that
    `labkit runs` then listed as "created" forever."""
    with pytest.raises(ConfigError) as info:
        LabPanel(env=env, world_size=2, micro_batch=32)
    assert str(info.value).startswith(message) and info.value.field == "env"
    with pytest.raises(ConfigError, match=r"^env: "):
        Run(config(), env=env)  # the Python API, too
    assert not runs_root.exists()


@pytest.mark.parametrize("changes,field", [
    ({"example": "pytorch"}, "world_size"),                    # plain PyTorch is one process
    ({"stage": 0, "offload_optimizer": True}, "offload_optimizer"),  # DeepSpeed would ignore it silently
])
def test_invalid_combination_shows_the_error_and_launches_nothing(runs_root, changes, field):
    panel = LabPanel(world_size=2, micro_batch=32)
    for name, value in changes.items():
        panel.controls[name].value = value
    assert plain(panel.message).startswith(f"⚠ {field}:")
    assert panel.launch() is None and panel.run is None
    assert f"⚠ {field}:" in plain(panel.message)
    assert not runs_root.exists() or not any(runs_root.iterdir())
    assert dashboard_threads() == [] and plain(panel.status) == "status: idle"
    assert not panel.launch_button.disabled and panel.stop_button.disabled


class SyntheticRun(Run):
    """A Run whose start() writes what a finished run leaves, instead of launching processes."""

    def start(self):
        self.run_dir = new_run_dir(run_name(self.config), self._root)
        write_run(self.run_dir, self.config, steps=self.config.steps)
        return self


def test_launch_runs_the_config_and_reports_the_outcome(runs_root, monkeypatch):
    monkeypatch.setattr(labkit.ui.panel, "Run", SyntheticRun)
    panel = LabPanel(world_size=2, micro_batch=32, steps=7, hidden=64, refresh_s=0.05)
    run = panel.launch()
    assert run is panel.run and run.config == panel.config()
    assert panel.dashboard.join(timeout=30)
    assert plain(panel.status).startswith("status: finished 7/7 steps")
    assert run.run_dir.name in plain(panel.status)
    assert (panel.launch_button.disabled, panel.stop_button.disabled) == (False, True)
    assert {t.name: len(t.x) for t in panel.dashboard.figures["throughput"].data} == \
        {"global": 7, "rank 0": 7, "rank 1": 7}
    assert [v.value.count("hello from rank") for v in panel.logs.children] == [1, 1]
    assert panel.logs.titles == ("rank 0 log", "rank 1 log")
    assert rank_log(run.run_dir, 1).name == "20260101_rank1.log"
    assert panel.run_select.options[0][1] == str(run.run_dir)  # the history knows it


def test_history_and_overlays_reload_from_the_run_store(runs_root):
    for name in ("20260101-000000-a", "20260101-000001-b"):
        write_run(runs_root / name, config(), steps=4)
    panel = LabPanel()  # a fresh kernel: only the run store
    assert [label for label, _ in panel.run_select.options] == ["20260101-000001-b (finished)",
                                                               "20260101-000000-a (finished)"]
    table = panel.history.outputs[0]["data"]["text/plain"]
    assert "20260101-000000-a" in table and "finished" in table
    panel.run_select.value = (str(runs_root / "20260101-000000-a"),)
    panel.overlay_button.click()
    assert "a · global" in [t.name for t in panel.dashboard.figures["throughput"].data]


def test_preset_choice_maps_to_none(runs_root):
    panel = LabPanel(example="offload", world_size=2)
    assert panel.controls["stage"].label == "preset"  # shown, not a blank dropdown
    assert (panel.config().stage, panel.config().offload_optimizer) == (2, True)  # the example's preset
    panel.controls["offload_optimizer"].value = False
    assert panel.config().offload_optimizer is False
    assert LabPanel(stage=1).controls["stage"].value == 1


class LiveRun(Run):
    """A run the test drives: start() writes 2 steps per rank, it is "running" until finish()."""

    stop_gate: threading.Event | None = None  # set: stop() waits for it (a slow supervisor)

    def start(self):
        self.run_dir = new_run_dir(run_name(self.config), self._root)
        write_run(self.run_dir, self.config, steps=2, status=None)
        return self

    @property
    def status(self) -> str:
        summary = self.summary
        return summary["status"] if summary else "running"

    def finish(self, status: str = "finished") -> None:
        write_json_atomic(self.run_dir / "summary.json",
                          summarize(self.run_dir, self.config.to_dict(), status=status, cause=None))

    def stop(self, timeout: float = 6.0) -> str:
        if self.stop_gate is not None:
            assert self.stop_gate.wait(timeout=20)
        if not self.summary:
            self.finish("stopped")
        return self.status


def test_launching_twice_leaves_one_update_thread_and_none_after(runs_root, monkeypatch):
    monkeypatch.setattr(labkit.ui.panel, "Run", LiveRun)
    panel = LabPanel(world_size=2, micro_batch=32, steps=9, refresh_s=0.05)
    assert dashboard_threads() == []
    first = panel.launch()
    assert len(dashboard_threads()) == 1
    assert panel.launch() is None and "still going" in plain(panel.message)  # one run at a time
    first.finish()
    assert panel.dashboard.join(timeout=20) and dashboard_threads() == []
    assert plain(panel.status).startswith("status: finished") and not panel.launch_button.disabled

    second = panel.launch()
    assert second is not first and len(dashboard_threads()) == 1
    _wait(lambda: plain(panel.status).startswith("status: running step 2/9"))
    assert second.run_dir.name in plain(panel.status)
    with open(first.run_dir / "rank0.jsonl", "a") as handle:  # the first run's files change: not plotted
        handle.write(json.dumps(step_record(0, 3)) + "\n")
    ticks = panel.dashboard.ticks
    _wait(lambda: panel.dashboard.ticks >= ticks + 3)
    assert panel.dashboard.last_step() == 2 and panel.launch_button.disabled
    assert panel.stop() == "stopped"
    assert dashboard_threads() == []
    assert plain(panel.status).startswith("status: stopped at step 2/9")


def test_stop_shows_stopping_until_the_run_is_done(runs_root, monkeypatch):
    monkeypatch.setattr(labkit.ui.panel, "Run", LiveRun)
    monkeypatch.setattr(LiveRun, "stop_gate", threading.Event())
    panel = LabPanel(world_size=2, micro_batch=32, steps=9, refresh_s=0.05)
    run = panel.launch()
    _wait(lambda: plain(panel.status).startswith("status: running step 2/9"))
    stopper = threading.Thread(target=panel.stop)  # the kernel's thread, in the Stop button's callback
    stopper.start()
    try:
        _wait(lambda: plain(panel.status).startswith("status: stopping"))
        ticks = panel.dashboard.ticks
        _wait(lambda: panel.dashboard.ticks >= ticks + 3)  # ticks go on and must not overwrite it
        assert plain(panel.status) == f"status: stopping · {run.run_dir.name}"
    finally:
        LiveRun.stop_gate.set()
        stopper.join(timeout=30)
    assert plain(panel.status).startswith("status: stopped at step 2/9")
    assert (panel.launch_button.disabled, panel.stop_button.disabled) == (False, True)


class RecoveringRun(LiveRun):
    """A run whose supervisor dies between the update thread's poll and the panel's tick: the tick
    recovers it (kills what is left, writes the summary), which takes seconds. Here it takes until
    the test says so."""

    recovering = threading.Event()  # the tick's recover() has begun
    recovered = threading.Event()   # the test lets it end
    stop_called = threading.Event()  # Run.stop() was reached: the run's processes are being ended

    def recover(self) -> bool:
        in_tick = any(frame.f_code.co_name == "_on_tick" for frame in _frames())
        if in_tick and not self.recovering.is_set():
            self.recovering.set()
            assert self.recovered.wait(timeout=20)
        return super().recover()

    def stop(self, timeout: float = 6.0) -> str:
        self.stop_called.set()
        return super().stop(timeout)


def _frames():
    frame = sys._getframe(1)
    while frame is not None:
        yield frame
        frame = frame.f_back


def test_stop_is_not_held_back_by_a_tick_recovering_the_run(runs_root, monkeypatch):
    """The tick recovered a run whose supervisor died (seconds of killing and summarising) while
    holding the panel's lock, and Stop waited for that lock."""
    monkeypatch.setattr(labkit.ui.panel, "Run", RecoveringRun)
    for event in (RecoveringRun.recovering, RecoveringRun.recovered, RecoveringRun.stop_called):
        event.clear()
    panel = LabPanel(world_size=2, micro_batch=32, steps=9, refresh_s=0.05)
    run = panel.launch()
    stopper = threading.Thread(target=panel.stop)  # the kernel's thread, in the Stop button's callback
    try:
        assert RecoveringRun.recovering.wait(timeout=20)
        stopper.start()
        # Stop shows "stopping" and ends the run while the tick is still recovering.
        assert RecoveringRun.stop_called.wait(timeout=5), "Stop waited for the tick's recovery"
        assert plain(panel.status) == f"status: stopping · {run.run_dir.name}"
    finally:
        RecoveringRun.recovered.set()
        if stopper.ident is not None:
            stopper.join(timeout=30)
    assert panel.dashboard.join(timeout=20)
    assert plain(panel.status).startswith("status: stopped at step 2/9")
    assert (panel.launch_button.disabled, panel.stop_button.disabled) == (False, True)


def test_an_error_in_the_update_thread_is_shown_and_frees_the_controls(runs_root, monkeypatch):
    monkeypatch.setattr(labkit.ui.panel, "Run", LiveRun)
    real = labkit.ui.dashboard.run_traces

    def failing(*args, **kwargs):  # fails in the update thread only: launch() itself draws empty traces
        if threading.current_thread().name == "labkit-dashboard":
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    monkeypatch.setattr(labkit.ui.dashboard, "run_traces", failing)
    panel = LabPanel(world_size=2, micro_batch=32, steps=9, refresh_s=0.05)
    run = panel.launch()
    assert panel.dashboard.join(timeout=20)
    assert "RuntimeError: boom" in panel.dashboard.error
    assert plain(panel.message) == "⚠ live updates stopped: RuntimeError: boom; the run goes on (Stop ends it)"
    # Launch is clickable (it says the run is still going); Stop still works.
    assert (panel.launch_button.disabled, panel.stop_button.disabled) == (False, False)
    assert panel.launch() is None and "still going" in plain(panel.message)
    assert panel.stop() == "stopped" and run.status == "stopped"
    assert plain(panel.status).startswith("status: stopped")
    assert (panel.launch_button.disabled, panel.stop_button.disabled) == (False, True)


class FailingRun(Run):
    def start(self):
        raise OSError(28, "No space left on device")


def test_a_launch_error_is_shown_in_the_panel(runs_root, monkeypatch):
    monkeypatch.setattr(labkit.ui.panel, "Run", FailingRun)
    panel = LabPanel(world_size=2, micro_batch=32)
    assert panel.launch() is None and panel.run is None
    assert plain(panel.message) == "⚠ launch failed: OSError: [Errno 28] No space left on device"
    assert not panel.launch_button.disabled and dashboard_threads() == []


def test_launch_waits_for_the_last_runs_thread(runs_root, monkeypatch):
    """A thread still busy with the last run's final tick: Launch refuses instead of starting a second one."""
    monkeypatch.setattr(labkit.ui.panel, "Run", LiveRun)
    monkeypatch.setattr(labkit.ui.dashboard, "JOIN_TIMEOUT_S", 0.2)
    entered, release = threading.Event(), threading.Event()
    real = labkit.ui.panel.tail_text

    def slow_tail(path, *args, **kwargs):  # the final tick's log read hangs (a slow disk)
        if (Path(path).parent.parent / "summary.json").exists():
            entered.set()
            release.wait(20)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(labkit.ui.panel, "tail_text", slow_tail)
    panel = LabPanel(world_size=2, micro_batch=32, steps=9, refresh_s=0.05)
    first = panel.launch()
    first.finish()
    try:
        assert entered.wait(timeout=20)
        assert panel.launch() is None
        assert "have not stopped yet" in plain(panel.message)
        assert [p.name for p in runs_root.iterdir()] == [first.run_dir.name]  # nothing started
    finally:
        release.set()
    assert panel.dashboard.join(timeout=20)
    second = panel.launch()
    assert second is not None and len(dashboard_threads()) == 1
    second.finish()
    assert panel.dashboard.join(timeout=20)


def _swallowed_add_traces(figure_factory) -> list:
    """The browser sends a message (handled on the kernel's main thread) while the update thread
    adds a trace under the dashboard's lock. Returns the addTraces payloads the kernel sent."""
    lock = threading.RLock()
    fig = figure_factory(lock)
    sent: list = []
    fig._send = lambda msg, buffers=None: sent.append(msg)  # what would go to the browser
    inside, added = threading.Event(), threading.Event()
    set_trait = fig.set_trait

    def slow_set_trait(name, value):  # runs inside ipywidgets' hold_trait_notifications()
        inside.set()
        added.wait(2.0)  # without the lock, the update thread adds its trace right now
        set_trait(name, value)

    fig.set_trait = slow_set_trait

    def update_thread() -> None:
        inside.wait(5.0)
        with lock:
            fig.add_scatter(x=np.arange(3.0), y=np.arange(3.0), name="rank 0")
        added.set()

    thread = threading.Thread(target=update_thread)
    thread.start()
    fig._handle_msg({"content": {"data": {"method": "update", "state": {"_js2py_pointsCallback": None}}},
                     "buffers": []})
    added.wait(5.0)
    thread.join(5.0)
    return [m["state"]["_py2js_addTraces"] for m in sent if "_py2js_addTraces" in m.get("state", {})]


def test_a_browser_message_cannot_swallow_the_update_threads_new_trace():
    """ipywidgets compresses a trait set during its handling of a browser message; plotly sends
    addTraces as `msg` then `None`, so only None reached the browser and the chart stayed empty."""
    import plotly.graph_objects as go

    from labkit.ui.dashboard import _new_figure

    payloads = _swallowed_add_traces(lambda lock: _new_figure("loss", lock))
    assert any(p is not None for p in payloads), payloads
    # The same race on a plain FigureWidget loses the trace: the test can tell the difference.
    plain = _swallowed_add_traces(lambda lock: go.FigureWidget())
    assert plain and all(p is None for p in plain), plain


@pytest.mark.slow
def test_showing_the_panel_starts_the_zygote_and_lends_it_unless_cold_is_ticked(runs_root, monkeypatch):
    """The zygote preloads while the learner picks a configuration, and `!labkit run` cells find it
    (LABKIT_ZYGOTE); with the "cold launch" box ticked nothing is started and Launch goes through DeepSpeed's
    launcher (`Run(..., warm=False)`)."""
    from labkit.launch import zygote

    monkeypatch.delenv(zygote.SHARED_ENV, raising=False)
    monkeypatch.setenv("LABKIT_WARM", "0")
    cold = LabPanel(world_size=2, micro_batch=32)
    assert cold.cold.value
    cold._ipython_display_()
    assert zygote.SHARED_ENV not in os.environ
    monkeypatch.delenv("LABKIT_WARM")
    panel = LabPanel(world_size=2, micro_batch=32)
    assert not panel.cold.value
    panel._ipython_display_()
    lent = Path(os.environ[zygote.SHARED_ENV])
    deadline = time.monotonic() + zygote.READY_TIMEOUT_S  # started in the background: it binds once preloaded
    while True:
        try:
            attached = zygote.Zygote.attach(lent, dict(os.environ, **launcher_env()))
            break
        except zygote.ZygoteUnavailable:
            assert time.monotonic() < deadline, "the panel's zygote never answered"
            time.sleep(0.2)
    assert psutil.Process(attached.ready["pid"]).ppid() == os.getpid()  # this process's, as a kernel's
    launched: list[bool | None] = []
    monkeypatch.setattr(labkit.ui.panel, "Run", lambda config, **kw: launched.append(kw["warm"]) or
                        SyntheticRun(config, **kw))
    panel.launch()
    panel.close()
    panel = LabPanel(world_size=2, micro_batch=32)
    panel.cold.value = True
    panel.launch()
    panel.close()
    assert launched == [True, False]


def launcher_env() -> dict[str, str]:
    """What a CPU run's environment sets that the zygote's imports fix."""
    from labkit.launch.launcher import import_time_env

    return import_time_env(os.environ, "cpu")

"""Cost of the live panel: (a) one dashboard refresh at 8 ranks x 100k points, (b) Launch -> first plotted point.

    .venv/bin/python benchmarks/bench_dashboard.py [--points 100000] [--ranks 8] [--pairs 2] [--skip-launch]
                                                   [--no-kernel]

(a) Kernel-side cost of one refresh: synthetic step records of `--ranks` ranks x `--points`
    steps are accumulated in a RunSeries (as the update thread does), then each refresh
    appends one new record per rank, shapes every trace (min/max buckets, <= 2000 points) and
    pushes them through `fig.batch_update()`. Two passes: memory="host" (CPU ranks: one RSS
    trace per rank) and memory="device" (GPU ranks: allocated + peak per rank, twice the
    memory traces). Goal: <= 50 ms each. Measured in this process
    without a frontend: the widget messages are built and serialised (numpy -> binary
    buffers) but not sent over ZeroMQ, which in a kernel adds a small header encoding.
(b) Launch to first plotted point: the same RunConfig started by `LabPanel.launch()` (Run +
    supervisor + update thread) and by the bare DeepSpeed launcher
    (`python -m deepspeed.launcher.runner ...` from labkit.launch.launcher.build_command: labkit's rank
    guard and worker, no supervisor; benchmarks/launch_twins.py), each
    timed to rank 0's first step record (for the panel: to the refresh that plots it).
    Runs alternate (bare, panel, bare, panel, ...) so drift on a shared machine hits both.
    Goal: panel <= bare + 1 s. Every run is stopped right after its first step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# This checkout's labkit, also where it is not installed (`python benchmarks/bench_dashboard.py`).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from launch_twins import RunFailed, bench_config, first_point_panel, first_step_bare

from labkit.runtime.devices import detect_devices
from labkit.ui.dashboard import Dashboard, RunSeries, run_traces, step_columns

MIB = 2**20


def synthetic_records(rank: int, start: int, count: int) -> list[dict]:
    """Step records shaped like the worker's (every key the charts read)."""
    rng = np.random.default_rng(rank + start)
    noise = rng.random(count)
    return [{"rank": rank, "event": "step", "step": step, "time_s": step * 0.05, "step_time_s": 0.05 + 0.01 * n,
             "samples_per_s": 1280 / (0.05 + 0.01 * n), "loss": 2.3 / (1 + step / 1000) + 0.01 * n,
             "rss_bytes": (400 + 10 * n) * MIB, "peak_rss_bytes": 420 * MIB, "param_bytes": 2 * MIB,
             "device_allocated_bytes": (300 + 10 * n) * MIB, "device_peak_bytes": 350 * MIB,
             "grad_bytes": 2 * MIB, "optim_bytes": 4 * MIB, "master_bytes": 2 * MIB, "host_optim_bytes": 0,
             "forward_s": 0.01, "backward_s": 0.02, "optimizer_s": 0.01, "lr": 1e-3}
            for step, n in zip(range(start, start + count), noise, strict=True)]


def bench_refresh(ranks: int, points: int, repeats: int = 30) -> None:
    print(f"(a) dashboard refresh: {ranks} ranks x {points} points per trace")
    series = RunSeries(ranks)
    t0 = time.perf_counter()
    for start in range(1, points + 1, 10_000):  # in chunks: 800k dicts at once would take GBs
        series.extend([step_columns(synthetic_records(rank, start, min(10_000, points + 1 - start)))
                       for rank in range(ranks)])
    ingest = time.perf_counter() - t0
    print(f"    one-time ingestion of {ranks * points} records (records -> columns): {ingest:.2f} s "
          f"({ingest / (ranks * points) * 1e6:.2f} us/record; a live run ingests a few per poll)")
    print(f"    load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    step = points + 1
    for memory in ("host", "device"):
        step = refresh_pass(series, memory, step, repeats)


def refresh_pass(series: RunSeries, memory: str, step: int, repeats: int) -> int:
    """Times `repeats` refreshes of a dashboard showing `series` with `memory` traces; returns the next step."""
    dash = Dashboard()
    dash.show_series(series, memory=memory)
    dash.refresh()  # first call pays for plotly's validator imports
    shaping, totals, cpu = [], [], []
    for _ in range(repeats):
        series.extend([step_columns(synthetic_records(rank, step, 1)) for rank in range(len(series))])
        step += 1
        t0 = time.perf_counter()
        run_traces(series, memory=memory)
        shaping.append(time.perf_counter() - t0)
        c0 = time.thread_time()
        totals.append(dash.refresh())  # new records: shape + batch_update of all four figures
        cpu.append(time.thread_time() - c0)
    n_traces = sum(len(fig.data) for fig in dash.figures.values())
    n_memory = len(dash.figures["memory"].data)
    n_points = sum(len(t.x) for fig in dash.figures.values() for t in fig.data)
    median, worst, cpu_median = statistics.median(totals) * 1e3, max(totals) * 1e3, statistics.median(cpu) * 1e3
    # Wall time includes waiting for a core on a busy machine; CPU time is what the refresh costs.
    print(f"    memory={memory!r} ({n_traces} traces, {n_memory} of them memory; {n_points} points plotted):")
    print(f"      shaping only (run_traces): median {statistics.median(shaping) * 1e3:.1f} ms")
    print(f"      full refresh (shaping + FigureWidget batch_update): wall median {median:.1f} ms, "
          f"max {worst:.1f} ms; CPU median {cpu_median:.1f} ms over {repeats}  "
          f"(goal <= 50 ms: {'met' if median <= 50 else 'NOT met'}; ratio to goal {median / 50:.2f})")
    return step


def bench_refresh_in_kernel(ranks: int, points: int) -> None:
    """(a) again, inside a real ipykernel, so the comm messages really leave through IOPub."""
    from jupyter_client.manager import start_new_kernel

    print("(a') the same inside an ipykernel:", flush=True)
    script = str(Path(__file__).resolve())
    argv = [script, "--ranks", str(ranks), "--points", str(points), "--skip-launch", "--no-kernel"]
    km, kc = start_new_kernel(kernel_name="python3")  # the venv's python3 kernelspec: this interpreter

    def echo(msg: dict) -> None:
        if msg["msg_type"] == "stream" and "WARNING" not in msg["content"]["text"]:
            print("    " + msg["content"]["text"].rstrip().replace("\n", "\n    "), flush=True)
        elif msg["msg_type"] == "error":
            print("    kernel error: " + msg["content"]["evalue"], flush=True)

    try:
        kc.execute_interactive(f"import runpy, sys; sys.argv = {argv!r}; runpy.run_path({script!r}, "
                               f"run_name='__main__')", timeout=900, output_hook=echo)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def bench_launch(pairs: int) -> None:
    config = bench_config()
    root = Path(tempfile.mkdtemp(prefix="bench-dashboard-"))
    print(f"(b) Launch -> first plotted point vs bare launcher -> first step ({config.world_size} ranks, "
          f"{detect_devices().accelerator}); runs in {root}")
    print("    phases: launcher start -> rank 0 start record (to rank) -> its first step (to step); the panel adds "
          "Launch -> launcher started (supervisor) and first step on disk -> plotted (plot)")
    bare, panel = [], []
    for pair in range(pairs):
        try:
            b, p = first_step_bare(config, root), first_point_panel(config, root)
        except RunFailed as exc:  # a shared machine's OOM killer, say: report it, keep measuring
            print(f"    pair {pair + 1}: skipped, {exc}")
            continue
        bare.append(b)
        panel.append(p)
        print(f"    pair {pair + 1}: bare {b['total']:.2f} s = to rank {b['to_rank']:.1f} + to step {b['to_step']:.1f}")
        print(f"            panel {p['total']:.2f} s = supervisor {p['supervisor']:.2f} + to rank {p['to_rank']:.1f}"
              f" + to step {p['to_step']:.1f} + plot {p['plot']:.2f}")
        print(f"            difference {p['total'] - b['total']:+.2f} s, ratio {p['total'] / b['total']:.3f}")
    if not bare:
        raise SystemExit("no pair completed")
    totals_b = [b["total"] for b in bare]
    totals_p = [p["total"] for p in panel]
    diff = statistics.median(p - b for p, b in zip(totals_p, totals_b, strict=True))
    own = statistics.median(p["labkit"] for p in panel)
    print(f"    median: bare {statistics.median(totals_b):.2f} s, panel {statistics.median(totals_p):.2f} s, "
          f"difference {diff:+.2f} s (goal <= +1 s: {'met' if diff <= 1 else 'NOT met'}), "
          f"ratio {statistics.median(totals_p) / statistics.median(totals_b):.3f}")
    print(f"    labkit's own phases (supervisor + plot), median: {own:.2f} s (goal <= 1 s: "
          f"{'met' if own <= 1 else 'NOT met'}); spread of the bare launcher's own times: "
          f"{max(totals_b) - min(totals_b):.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--points", type=int, default=100_000)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--skip-launch", action="store_true", help="only (a), no DeepSpeed runs")
    parser.add_argument("--no-kernel", action="store_true", help="measure (a) in this process only")
    args = parser.parse_args()
    bench_refresh(args.ranks, args.points)
    if not args.no_kernel:
        bench_refresh_in_kernel(args.ranks, args.points)
    if not args.skip_launch:
        bench_launch(args.pairs)


if __name__ == "__main__":
    main()

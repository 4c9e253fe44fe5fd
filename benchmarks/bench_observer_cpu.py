"""CPU time labkit's observers spend per training step, outside what the ranks' loop times.

    .venv/bin/python benchmarks/bench_observer_cpu.py [--steps 200] [--hidden 1024]

On 2 cores with 2 ranks training, every CPU second spent by the supervisor or a rank's fsync
thread is taken from a rank, and the ranks wait for each other at every all-gather: that cost
is not in the ranks' own `telemetry_s`. CPU seconds are counted by the kernel per process and
per thread, so these figures hold on a loaded machine, where wall-clock ratios do not.
Reports, per step: the supervisor's CPU seconds (psutil cpu_times), the fsync threads' CPU
seconds and fsync calls (the `done` records), and the loop's own instrumentation (`telemetry_s`).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's labkit
from labkit import Run, RunConfig
from labkit.records import read_records
from labkit.telemetry import rank_file


def observe(config: RunConfig, root: str) -> dict[str, float]:
    run = Run(config, root=root).start()
    supervisor = psutil.Process(run._supervisor.pid)
    # From the first step seen to the last: the steady state, not the supervisor's start-up.
    first = last = None  # (step, supervisor CPU seconds)
    while not run.done:
        try:
            times = supervisor.cpu_times()
        except psutil.Error:
            break
        step = run.progress()
        if step:
            first = first or (step, times.user + times.system)
            last = (step, times.user + times.system)
        time.sleep(0.1)
    if run.wait() != "finished":
        raise SystemExit(f"benchmark run {run.run_dir} ended {run.status}: {run.cause}")
    done = [next(r for r in read_records(rank_file(run.run_dir, rank)) if r["event"] == "done")
            for rank in range(config.world_size)]
    steps = config.steps
    return {
        "step_s": max(d["timed_s"] / d["timed_steps"] for d in done),
        "supervisor_cpu_s": (last[1] - first[1]) / max(1, last[0] - first[0]),
        "fsync_thread_cpu_s": sum(d.get("telemetry_thread_cpu_s", 0.0) for d in done) / steps,
        "fsyncs": sum(d.get("fsyncs", 0) for d in done) / steps,
        "loop_telemetry_s": sum(d["telemetry_s"] / d["timed_steps"] for d in done),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--telemetry", choices=("both", "on", "off"), default="both")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="bench-observer-")
    for telemetry in {"both": (True, False), "on": (True,), "off": (False,)}[args.telemetry]:
        config = RunConfig(example="zero3", world_size=args.world_size, micro_batch=64, hidden=args.hidden, depth=2,
                           steps=args.steps, telemetry=telemetry, census_every=10)
        f = observe(config, root)
        print(f"telemetry {'on ' if telemetry else 'off'}: step {1e3 * f['step_s']:.1f} ms; per step, summed over "
              f"ranks: supervisor {1e3 * f['supervisor_cpu_s']:.2f} ms CPU, fsync threads "
              f"{1e3 * f['fsync_thread_cpu_s']:.2f} ms CPU ({f['fsyncs']:.2f} fsyncs), loop's own instrumentation "
              f"{1e3 * f['loop_telemetry_s']:.2f} ms; observers' CPU / (ranks x step time) "
              f"{100 * (f['supervisor_cpu_s'] + f['fsync_thread_cpu_s']) / (args.world_size * f['step_s']):.2f}%")


if __name__ == "__main__":
    main()

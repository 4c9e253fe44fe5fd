"""CPU time labkit's observers spend per training step, outside what the ranks' loop times.

    .venv/bin/python benchmarks/bench_observer_cpu.py [--steps 200] [--hidden 1024]

On 2 cores with 2 ranks training, every CPU second spent by the supervisor or a rank's fsync
thread is taken from a rank, and the ranks wait for each other at every all-gather: that cost
is not in the ranks' own `telemetry_s`. CPU seconds are counted by the kernel per process and
per thread, so these figures hold on a loaded machine, where wall-clock ratios do not.
Reports, per step: the supervisor's CPU seconds (psutil cpu_times), the fsync threads' CPU
seconds and fsync calls (the `done` records), the loop's own instrumentation (`telemetry_s`) and
the ranks' context switches (a woken observer thread or process preempts a rank, and the other
rank waits for it at the next collective: a cost CPU seconds do not show).
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
from labkit.core.records import RecordTail, rank_file, read_records


def observe(config: RunConfig, root: str) -> dict[str, float]:
    run = Run(config, root=root).start()
    supervisor = psutil.Process(run._supervisor.pid)
    # From the first step seen to the last: the steady state, not the supervisor's start-up.
    first = last = None  # (step, supervisor CPU seconds, ranks' voluntary and involuntary context switches)
    ranks: dict[int, psutil.Process] = {}
    tails = [RecordTail(rank_file(run.run_dir, rank)) for rank in range(config.world_size)]
    while not run.done:
        for rank, tail in enumerate(tails):
            for record in tail.poll():
                if record.get("event") == "start":
                    ranks[rank] = psutil.Process(record["pid"])
        try:
            times = supervisor.cpu_times()
            switches = [p.num_ctx_switches() for p in ranks.values()]
        except psutil.Error:
            break
        step = run.progress()
        if step and len(switches) == config.world_size:
            sample = (step, times.user + times.system, sum(s.voluntary for s in switches),
                      sum(s.involuntary for s in switches))
            first, last = first or sample, sample
        time.sleep(0.1)
    if run.wait() != "finished":
        raise SystemExit(f"benchmark run {run.run_dir} ended {run.status}: {run.cause}")
    done = [next(r for r in read_records(rank_file(run.run_dir, rank)) if r["event"] == "done")
            for rank in range(config.world_size)]
    steps = config.steps
    return {
        "step_s": max(d["timed_s"] / d["timed_steps"] for d in done),
        "supervisor_cpu_s": (last[1] - first[1]) / max(1, last[0] - first[0]),
        "voluntary_switches": (last[2] - first[2]) / max(1, last[0] - first[0]),
        "involuntary_switches": (last[3] - first[3]) / max(1, last[0] - first[0]),
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
              f"{1e3 * f['loop_telemetry_s']:.2f} ms, ranks' context switches {f['voluntary_switches']:.1f} "
              f"voluntary + {f['involuntary_switches']:.1f} involuntary; observers' CPU / (ranks x step time) "
              f"{100 * (f['supervisor_cpu_s'] + f['fsync_thread_cpu_s']) / (args.world_size * f['step_s']):.2f}%")


if __name__ == "__main__":
    main()

"""Warm launches against cold ones: Run.start() -> rank 0's first step, alternating warm, cold, warm, cold, ...

    .venv/bin/python benchmarks/bench_warm_launch.py [--pairs 3] [--json out.json]

Goal it serves (issue 25, item 3): a launch -> first step <= 0.3x the bare `deepspeed` launcher's start -> first
step of the same training. A cold labkit launch measured 1.07x the bare launcher (benchmarks/bench_launch.py), so
warm/cold here <= 0.28 meets it. The same training each time: Example 3 corrected, ZeRO-3 on 2 CPU ranks
(`RunConfig(example="zero3", world_size=2, micro_batch=64, hidden=1024, depth=2)`), stopped after its first step.
The zygote is started (and waited for) before the first pair: a kernel starts it once, before its first Launch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from labkit import Run, RunConfig
from labkit.core.records import rank_file, read_records
from labkit.launch import zygote
from labkit.launch.launcher import build_command

CONFIG = dict(example="zero3", world_size=2, micro_batch=64, hidden=1024, depth=2, steps=100_000)


def first_step_s(warm: bool, root: str) -> float:
    started = time.monotonic()
    run = Run(RunConfig(**CONFIG), root=root, warm=warm).start()
    while not any(r.get("event") == "step" for r in read_records(rank_file(run.run_dir, 0))):
        if run.done:
            raise RuntimeError(f"{run.run_dir}: {run.status} {run.cause}")
        time.sleep(0.02)
    elapsed = time.monotonic() - started
    assert run.launch_mode == ("warm" if warm else "cold"), run.launch_mode
    run.stop()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        # The zygote of this process, ready before the first timed pair (the panel starts it when it opens).
        _, env = build_command(RunConfig(**CONFIG), root, master_port=0, accelerator="cpu")
        ready = zygote.shared(env).wait_ready()
        warm, cold = [], []
        for _ in range(args.pairs):
            warm.append(first_step_s(True, root))
            cold.append(first_step_s(False, root))
    result = {"zygote_preload_s": ready["preload_s"], "warm_s": warm, "cold_s": cold,
              "warm_median_s": statistics.median(warm), "cold_median_s": statistics.median(cold),
              "warm_over_cold": statistics.median(w / c for w, c in zip(warm, cold, strict=True))}
    print(f"zygote preload {ready['preload_s']:.1f} s (once per kernel)")
    print(f"Run.start -> rank 0's first step, {args.pairs} alternating pairs:")
    print(f"  warm  median {result['warm_median_s']:.2f} s  {[round(x, 2) for x in warm]}")
    print(f"  cold  median {result['cold_median_s']:.2f} s  {[round(x, 2) for x in cold]}")
    print(f"  warm / cold (median of the pairs' ratios) {result['warm_over_cold']:.2f}x")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)


if __name__ == "__main__":
    main()

"""Runs that overlap on CPU: notebook 02's six 1-rank runs through `lessons.launch_all`, three ways.

    .venv/bin/python benchmarks/bench_overlap.py [--rounds 2] [--steps 20]

- before: two at a time with 2 OpenMP threads each on 2 cores (the admission's rule until 2026-11-29: two rank
  threads per core, no share of the cores);
- alone: one at a time (`concurrent=False`), 2 threads each: each run's unshared step time;
- now: two at a time, each with its share of the cores (`admission.share_cores`: one thread each on 2 cores).
Each round runs the three one after the other, the order rotating between rounds (pairs alternating). Goals, as
ratios measured in one run (docs/laptop.md, "Why one thread per core"): `now`'s wall <= `alone`'s (overlapping runs
still pays), and every run's median step `now` <= 2x `alone`'s (one thread instead of two, a neighbour on the other
core), where `before`'s spinning threads made them up to 18x (docs/laptop.md). It prints what the notebook prints
too, the offload ratios (stage 1 and 2, whole step, offload / not), and how far each way's are from `alone`'s. Needs
2+ cores and a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from labkit import RunConfig
from labkit.launch import admission
from labkit.study import lessons


def configs(steps: int) -> dict[str, RunConfig]:
    """Notebook 02's runs at its ci sizes (labkit.study.notebook_sizes, "02")."""
    model: dict[str, Any] = dict(hidden=1024, depth=2, micro_batch=64, steps=steps, precision="fp32", world_size=1)
    return {
        "stage 0": RunConfig(example="deepspeed", stage=0, **model),
        "stage 1": RunConfig(example="deepspeed", stage=1, **model),
        "stage 2": RunConfig(example="deepspeed", stage=2, **model),
        "stage 1 + offload": RunConfig(example="offload", stage=1, **model),
        "stage 2 + offload": RunConfig(example="offload", stage=2, **model),
        "stage 3 + offload": RunConfig(example="offload", stage=3, **model),
    }


def run_way(way: str, steps: int) -> dict[str, Any]:
    share, threads_per_core = admission.share_cores, admission.THREADS_PER_CORE
    if way == "before":  # the old rule, restored for this call only
        admission.share_cores = lambda c, cores: dict(c)  # type: ignore[assignment]
        admission.THREADS_PER_CORE = 2
    try:
        start = time.perf_counter()
        runs = lessons.launch_all(configs(steps), concurrent=way != "alone", progress=False)
        wall = time.perf_counter() - start
    finally:
        admission.share_cores, admission.THREADS_PER_CORE = share, threads_per_core
    lessons.require(runs)
    steps_s = lessons.summary_table(runs, ["median_step_time_s"])["median_step_time_s"].astype(float)
    ratios = {stage: steps_s[f"stage {stage} + offload"] / steps_s[f"stage {stage}"] for stage in (1, 2)}
    return {"wall_s": wall, "steps_s": steps_s, "ratios": ratios}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    ways = ["before", "alone", "now"]
    results: dict[str, list[dict[str, Any]]] = {way: [] for way in ways}
    for r in range(args.rounds):
        order = ways[r % 3:] + ways[:r % 3]
        for way in order:
            results[way].append(run_way(way, args.steps))
            last = results[way][-1]
            print(f"round {r + 1} {way:6s}: wall {last['wall_s']:5.1f} s, median steps "
                  f"{1000 * last['steps_s'].min():.1f}-{1000 * last['steps_s'].max():.1f} ms, offload / not, whole "
                  f"step: stage 1 {last['ratios'][1]:.2f}x, stage 2 {last['ratios'][2]:.2f}x", flush=True)

    def median(way: str, key: str, stage: Any = None) -> float:
        return statistics.median(x[key] if stage is None else x[key][stage] for x in results[way])

    wall = median("now", "wall_s") / median("alone", "wall_s")
    runs = list(results["alone"][0]["steps_s"].index)
    slowest = {way: max(median(way, "steps_s", run) / median("alone", "steps_s", run) for run in runs)
               for way in ("before", "now")}
    drift = {way: max(abs(median(way, "ratios", s) / median("alone", "ratios", s) - 1) for s in (1, 2))
             for way in ("before", "now")}
    print(f"wall, now / alone: {wall:.2f} (goal <= 1: {'met' if wall <= 1 else 'NOT met'})")
    print(f"the slowest run's median step / alone's: before {slowest['before']:.1f}x, now {slowest['now']:.2f}x "
          f"(goal <= 2: {'met' if slowest['now'] <= 2 else 'NOT met'})")
    print(f"offload ratios' largest drift from alone's: before {drift['before']:.0%}, now {drift['now']:.0%}")
    return 0 if wall <= 1 and slowest["now"] <= 2 else 1

if __name__ == "__main__":
    sys.exit(main())

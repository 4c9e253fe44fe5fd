"""This machine's link and one prediction made from it (labkit.study.comms).

    .venv/bin/python benchmarks/bench_comms.py [--pairs 3] [--steps 12]

Two figures:
- `measure_links()`: its wall time (goal: <= 30 s on a 2-core CPU with the default sizes) and the
  alpha-beta fit per operation.
- Stage 0 on 1 rank and on 2 ranks (one thread per rank, the same per-rank micro-batch, each run
  alone), in pairs whose order alternates: the 2-rank step predicted as the 1-rank step plus the
  collectives `comms.collectives` lists, timed on the fitted link (stage 0 hides nothing), against
  the 2-rank step measured. Goal: median |measured / predicted - 1| <= 15% on a quiet machine. On 2
  shared cores, other processes move step times by tens of percent: read the load average printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from labkit import Run, RunConfig
from labkit.models.builders import meta_model
from labkit.study import comms

MODEL = dict(hidden=1024, depth=2, micro_batch=32, dataset_size=2048, precision="fp32")


def median_step(run: Run) -> float:
    summary = run.summary or {}
    if summary.get("status") != "finished":
        raise SystemExit(f"benchmark run {run.run_dir} ended {summary.get('status')}: {summary.get('cause')}")
    return float(summary["median_step_time_s"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    print(f"load average at the start: {os.getloadavg()[0]:.1f}")
    started = time.perf_counter()
    link = comms.measure_links()
    print(f"measure_links: {time.perf_counter() - started:.1f} s (goal <= 30 s), {link.backend} on {link.device}")
    print(link.table().round(3).to_string(index=False))
    layout = comms.module_layout(meta_model(RunConfig(example="deepspeed", **MODEL)))
    cs = comms.collectives(0, sum(map(sum, layout)), 2, precision=MODEL["precision"], modules=layout)
    comm_s = link.step_seconds(cs, 2)["total_s"]
    root = tempfile.mkdtemp(prefix="bench-comms-")
    ratios = []
    for pair in range(args.pairs):
        steps = {}
        for world in ((1, 2) if pair % 2 == 0 else (2, 1)):
            config = RunConfig(example="deepspeed", stage=0, world_size=world, threads_per_rank=1,
                               steps=args.steps, **MODEL)
            run = Run(config, root=root).start()
            run.wait()
            steps[world] = median_step(run)
        predicted = steps[1] + comm_s
        ratios.append(steps[2] / predicted)
        print(f"pair {pair + 1}: 1 rank {steps[1] * 1e3:.1f} ms + all-reduce {comm_s * 1e3:.2f} ms = predicted "
              f"{predicted * 1e3:.1f} ms; 2 ranks measured {steps[2] * 1e3:.1f} ms: ratio {ratios[-1]:.3f}")
    print(f"measured / predicted, median over {args.pairs} pairs: {statistics.median(ratios):.3f} "
          f"(goal within 15% of 1); load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

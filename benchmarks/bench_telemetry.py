"""Cost of labkit's per-step telemetry: samples/s with it on vs the same loop with it off.

    .venv/bin/python benchmarks/bench_telemetry.py [--pairs 2] [--steps 80]

Goal: ratio >= 0.99. Runs alternate (on, off, on, off, ...) so drift on a shared machine
hits both sides; the printed ratio is the median over pairs. Throughput comes from each
rank-0 `done` record (`timed_s` over `timed_steps`, steps 1-2 excluded).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from labkit import Run, RunConfig
from labkit.telemetry import rank_file, read_records


def throughput(run: Run) -> float:
    done = next(r for r in read_records(rank_file(run.run_dir, 0)) if r["event"] == "done")
    return run.config.global_batch * done["timed_steps"] / done["timed_s"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="bench-telemetry-")
    ratios = []
    for pair in range(args.pairs):
        rates = {}
        for telemetry in (True, False):
            config = RunConfig(example="zero3", world_size=args.world_size, micro_batch=64, hidden=1024, depth=2,
                               steps=args.steps, telemetry=telemetry, census_every=10)
            run = Run(config, root=root).start()
            status = run.wait()
            if status != "finished":
                raise SystemExit(f"benchmark run {run.run_dir} ended {status}: {run.cause}")
            rates[telemetry] = throughput(run)
        ratios.append(rates[True] / rates[False])
        print(f"pair {pair + 1}: telemetry on {rates[True]:.1f} samples/s, off {rates[False]:.1f} samples/s, "
              f"ratio {ratios[-1]:.4f}")
    ratio = statistics.median(ratios)
    print(f"telemetry on/off throughput ratio (median of {len(ratios)}): {ratio:.4f}  (goal >= 0.99: "
          f"{'met' if ratio >= 0.99 else 'NOT met'})")


if __name__ == "__main__":
    main()

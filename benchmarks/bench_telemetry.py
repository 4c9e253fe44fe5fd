"""Cost of labkit's per-step telemetry: samples/s with it on vs the same loop with it off.

    .venv/bin/python benchmarks/bench_telemetry.py [--pairs 3] [--steps 200]

Goal: ratio >= 0.99. Two figures:
- A/B: runs alternate (on, off, off, on, ...) so drift on a shared machine hits both sides;
  the ratio is the median over pairs. Throughput comes from each rank-0 `done` record
  (`timed_s` over `timed_steps`, steps 1-2 excluded). On 2 shared cores two runs of the same
  config differ by several percent, more than the cost being measured.
- In-run: each rank times its own instrumentation (census and the saved-tensor hooks that count
  activations on census steps, memory readings, the record write) over the same timed steps
  (`telemetry_s` in the `done` record), so 1 - telemetry_s / timed_s is the throughput ratio with
  that work removed, free of run-to-run noise.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from labkit import Run, RunConfig
from labkit.core.records import rank_file, read_records


def done_record(run: Run, rank: int = 0) -> dict:
    return next(r for r in read_records(rank_file(run.run_dir, rank)) if r["event"] == "done")


def throughput(run: Run) -> float:
    done = done_record(run)
    return run.config.global_batch * done["timed_steps"] / done["timed_s"]


def instrumentation_share(run: Run) -> float:
    """The largest share of its timed steps any rank spent on telemetry work."""
    return max(d["telemetry_s"] / d["timed_s"] for d in (done_record(run, r) for r in range(run.config.world_size)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="bench-telemetry-")
    ratios, shares = [], []
    for pair in range(args.pairs):
        rates = {}
        # The order alternates between pairs (on-off, off-on, ...): whatever the first run of a
        # pair pays for (a previous run's teardown, caches) must not land on one side only.
        for telemetry in ((True, False) if pair % 2 == 0 else (False, True)):
            config = RunConfig(example="zero3", world_size=args.world_size, micro_batch=64, hidden=1024, depth=2,
                               steps=args.steps, telemetry=telemetry, census_every=10)
            run = Run(config, root=root).start()
            status = run.wait()
            if status != "finished":
                raise SystemExit(f"benchmark run {run.run_dir} ended {status}: {run.cause}")
            rates[telemetry] = throughput(run)
            if telemetry:
                shares.append(instrumentation_share(run))
        ratios.append(rates[True] / rates[False])
        print(f"pair {pair + 1} ({'on first' if pair % 2 == 0 else 'off first'}): telemetry on "
              f"{rates[True]:.1f} samples/s, off {rates[False]:.1f} samples/s, ratio {ratios[-1]:.4f}")
    ratio = statistics.median(ratios)
    print(f"telemetry on/off throughput ratio (median of {len(ratios)}): {ratio:.4f}  (goal >= 0.99: "
          f"{'met' if ratio >= 0.99 else 'NOT met'}; spread of the pairs {min(ratios):.3f}-{max(ratios):.3f})")
    in_run = 1 - statistics.median(shares)
    print(f"in-run: instrumentation {100 * statistics.median(shares):.3f}% of the timed steps (median over runs, "
          f"worst rank), throughput ratio {in_run:.4f}  (goal >= 0.99: {'met' if in_run >= 0.99 else 'NOT met'})")


if __name__ == "__main__":
    main()

"""Start/stop soak: N runs (default 50), each stopped at a random moment, one after another.

    python benchmarks/bench_soak.py [--cycles 50] [--max-delay 20] [--json out.json]

Each cycle starts a real 2-rank DeepSpeed CPU run (small model), waits a random time in
[0, --max-delay] s (so the stop lands while launching, during rank start-up or mid-training;
every 5th cycle waits for step 1 first, so some stops always land mid-training), then calls
`Run.stop()` and checks:

  orphans   processes of the run alive when stop() returned (the supervisor, launcher,
            launch.py, guards and workers seen just before the stop, plus anything whose
            command line names the run directory); must be 0
  shm       DeepSpeed CPU all-reduce buffers of the run left in /dev/shm; must be 0
  status    summary.json must exist and say "stopped" (or an earlier final status)

and prints the stop time (the stop() call, until every process has ended and summary.json
is written): median and max.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from labkit import Run, RunConfig
from labkit.core.records import rank_file, read_records
from labkit.launch import proctree

SMALL = dict(example="zero3", world_size=2, hidden=256, micro_batch=16, dataset_size=1024, steps=100_000)


def shm_left(run: Run) -> list[str]:
    argv = json.loads((run.run_dir / "launch.json").read_text())["argv"]
    port = argv[argv.index("--master_port") + 1]
    return sorted(p.name for p in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))


def cycle(number: int, root: Path, rng: random.Random, max_delay: float) -> dict:
    run = Run(RunConfig(**SMALL), root=root, env={"LABKIT_FAULT": ""}).start()
    wait_step = number % 5 == 4
    if wait_step:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not any(
                r.get("event") == "step" for r in read_records(rank_file(run.run_dir, 0))):
            time.sleep(0.1)
    delay = rng.uniform(0.0, max_delay if not wait_step else 2.0)
    time.sleep(delay)
    procs = proctree.tree(run.run_dir, run._supervisor_pid())
    steps = run.progress()
    started = time.monotonic()
    status = run.stop()
    stop_s = time.monotonic() - started
    after = proctree.tree(run.run_dir, run._supervisor_pid())
    orphans = [f"{p.pid} {' '.join(p.cmdline()[1:4])}" for p in proctree.union(procs, after) if proctree.alive(p)]
    return {"cycle": number, "delay_s": round(delay, 2), "steps_before_stop": steps, "status": status,
            "summary": run.summary is not None, "stop_s": round(stop_s, 3), "processes": len(procs),
            "orphans": orphans, "shm_left": shm_left(run), "run_dir": str(run.run_dir)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=50)
    parser.add_argument("--max-delay", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", default=None, help="run store for the soak (default: a temporary directory)")
    parser.add_argument("--json", default=None, help="write every cycle's figures here")
    args = parser.parse_args()
    root = Path(args.root or tempfile.mkdtemp(prefix="labkit-soak-"))
    rng = random.Random(args.seed)
    results = []
    began = time.monotonic()
    for number in range(args.cycles):
        result = cycle(number, root, rng, args.max_delay)
        results.append(result)
        print(f"cycle {number + 1:3d}/{args.cycles}: stop after {result['delay_s']:5.2f} s "
              f"(step {result['steps_before_stop']:4d}, {result['processes']} processes) -> {result['status']:8s} "
              f"stop {result['stop_s']:.2f} s, orphans {len(result['orphans'])}, shm left {len(result['shm_left'])}",
              flush=True)
    stops = [r["stop_s"] for r in results]
    orphans = sum(len(r["orphans"]) for r in results)
    shm = sum(len(r["shm_left"]) for r in results)
    no_summary = sum(not r["summary"] for r in results)
    statuses = Counter(r["status"] for r in results)
    print(f"\n{args.cycles} start/stop cycles in {time.monotonic() - began:.0f} s (run store {root})")
    print(f"orphans: {orphans}   shm buffers left: {shm}   runs without summary.json: {no_summary}")
    print(f"stop time: median {statistics.median(stops):.2f} s, max {max(stops):.2f} s "
          f"(cycles stopped mid-training: {sum(r['steps_before_stop'] > 0 for r in results)})")
    print(f"statuses: {dict(statuses)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"cycles": results, "orphans": orphans, "shm_left": shm,
                                               "stop_median_s": statistics.median(stops),
                                               "stop_max_s": max(stops), "statuses": dict(statuses)}, indent=1))
    return 0 if orphans == 0 and shm == 0 and no_summary == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

"""A GPU run's launch, spawned against cold: `Run.start` -> rank 0's first step, and -> the run's end.

    .venv/bin/python benchmarks/bench_spawned_launch.py [--pairs 2] [--json out.json]

Spawned (the default for a single-node GPU run of labkit's worker, labkit/launch/warm_launch.py): the supervisor
starts each rank's guard itself with launch.py's environment. Cold (`labkit run --cold`): DeepSpeed's runner, then
its launch.py, then the guard, two more interpreter starts that import DeepSpeed. Pairs alternate (spawned first,
then cold); the ratios are medians of the pairs' own ratios. The training is one rank of the answer's workshop model
(labkit.study.answer_profiles, bf16 on a GPU) under ZeRO-0 with FusedAdam, 5 steps: what each of the answer's points
pays before and after its steps. On a CPU machine (to try this script) the spawned mode is forced on CPU ranks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from labkit import Run, RunConfig
from labkit.core.records import rank_file, read_records
from labkit.launch import run as run_module
from labkit.runtime.devices import detect_devices
from labkit.study.answer_profiles import PROFILES

WAIT_S = 600


def config(on_gpu: bool) -> RunConfig:
    model = {k: v for k, v in PROFILES["workshop"].model.items()
             if k in ("hidden", "depth", "input_size", "dataset_size", "optimizer", "lr")}
    if not on_gpu:
        model["hidden"] = 512  # a trial of the script, in seconds
    return RunConfig(example="zero3", stage=0, world_size=1, micro_batch=512, steps=5, eval_every=0,
                     precision="bf16" if on_gpu else "fp32", **model)


def timed_run(cfg: RunConfig, root: Path, *, cold: bool) -> dict[str, Any]:
    started = time.time()
    run = Run(cfg, root=root, warm=not cold).start()
    status = run.wait(timeout=WAIT_S)
    ended = time.time()
    if status != "finished":
        raise RuntimeError(f"{run.run_dir}: {status}: {run.cause}")
    records = read_records(rank_file(run.run_dir, 0))
    start = records[0]  # the only record with a wall time; the others' time_s counts from the rank's start
    first_step = next(r for r in records if r.get("event") == "step")
    first_step_at = start["wall_time"] - start["time_s"] + first_step["time_s"]
    return {"mode": run.launch_mode, "to_first_step_s": first_step_at - started, "to_end_s": ended - started,
            "run_dir": str(run.run_dir)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    devices = detect_devices()
    if devices.is_cpu:
        real = run_module.launch_mode
        run_module.launch_mode = lambda argv, devices, world_size, *, warm: (
            ("spawned", "spawned (forced on CPU ranks)") if warm else real(argv, devices, world_size, warm=False))
    cfg = config(not devices.is_cpu)
    root = Path(tempfile.mkdtemp(prefix="bench-spawned-"))
    pairs = []
    for pair in range(args.pairs):
        spawned = timed_run(cfg, root, cold=False)
        cold = timed_run(cfg, root, cold=True)
        pairs.append({"spawned": spawned, "cold": cold})
        print(f"pair {pair + 1}: first step {spawned['to_first_step_s']:.1f} s spawned ({spawned['mode']}) vs "
              f"{cold['to_first_step_s']:.1f} s cold; end {spawned['to_end_s']:.1f} vs {cold['to_end_s']:.1f} s",
              flush=True)
    ratios = {key: statistics.median(p["spawned"][key] / p["cold"][key] for p in pairs)
              for key in ("to_first_step_s", "to_end_s")}
    print(f"spawned / cold, median of {len(pairs)} pairs: to the first step {ratios['to_first_step_s']:.2f}x, "
          f"to the end {ratios['to_end_s']:.2f}x ({devices.device_name})", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": devices.device_name, "config": cfg.to_dict(), "pairs": pairs,
                                         "ratios": ratios}, indent=1) + "\n")


if __name__ == "__main__":
    main()

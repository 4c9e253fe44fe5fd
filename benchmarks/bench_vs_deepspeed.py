"""A labkit run against the same training launched with plain `deepspeed`: does observing cost anything?

    .venv/bin/python benchmarks/bench_vs_deepspeed.py [--pairs 3] [--steps 200] [--models example3,large]

The plain side is what a user would write instead (launch_twins.PLAIN_SCRIPT, no labkit import): the
seed's Example 3 corrected (ZeRO-3, 2 CPU ranks, micro-batch 64, DistributedSampler, an MLP
100-1024-1024-10 with Adam), `deepspeed.initialize` on the very `ds_config.json` labkit wrote for
its own run, started by `deepspeed --num_gpus 2 train.py` with the environment labkit's launcher
builds (the same OMP threads per rank, accelerator and loopback sockets). Both sides time steps
3..N with perf_counter on rank 0 (exact on CPU: ops are synchronous); throughput is samples/s
over those steps (labkit's from its `done` record: `timed_steps` / `timed_s`). Runs alternate in pairs
(labkit first, then plain first, ...) so drift on the machine hits both sides; the ratio printed
is the median over pairs of labkit / plain, for telemetry on and `--no-telemetry`.
"large" is the same MLP wider (hidden 4096, ~17M parameters): steps of about 0.5 s on 2 cores.
Goal: >= 0.99 with telemetry on. Success of a plain run is judged from its result file (plain
2-rank deepspeed runs sometimes abort at exit, after training).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's labkit

from launch_twins import MODELS, plain_deepspeed_command

from labkit import Run, RunConfig
from labkit.core.records import rank_file, read_records
from labkit.launch.launcher import free_port


def labkit_rate(config: RunConfig, root: str) -> tuple[float, Path]:
    run = Run(config, root=root).start()
    if run.wait() != "finished":
        raise SystemExit(f"labkit run {run.run_dir} ended {run.status}: {run.cause}")
    done = next(r for r in read_records(rank_file(run.run_dir, 0)) if r["event"] == "done")
    return config.global_batch * done["timed_steps"] / done["timed_s"], run.run_dir


def plain_rate(config: RunConfig, workdir: Path, index: int) -> float:
    """The same training as `config`, launched with plain deepspeed and labkit's launch environment."""
    here = workdir / f"plain-{index}"
    here.mkdir(parents=True)
    argv, env = plain_deepspeed_command(config, here, free_port())
    with open(here / "launcher.log", "wb") as log:
        subprocess.run(argv, cwd=here, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=3600, check=False)
    if not (here / "result.json").exists():  # judged from the result: an abort at exit is not a failure
        raise SystemExit(f"plain deepspeed run failed: see {here / 'launcher.log'}")
    result = json.loads((here / "result.json").read_text())
    return config.global_batch * result["timed_steps"] / result["timed_s"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--models", default="example3,large", help=f"comma-separated, of {sorted(MODELS)}")
    parser.add_argument("--telemetry", choices=("both", "on", "off"), default="both")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-vs-deepspeed-"))
    index = 0
    for model in args.models.split(","):
        for telemetry in {"both": (True, False), "on": (True,), "off": (False,)}[args.telemetry]:
            config = RunConfig(example="zero3", world_size=args.world_size, micro_batch=64, steps=args.steps,
                               telemetry=telemetry, census_every=10, **MODELS[model])
            ratios = []
            for pair in range(args.pairs):
                rates = {}
                # Alternate which side goes first: what the first run of a pair pays for must not
                # land on one side only.
                for side in (("labkit", "plain") if pair % 2 == 0 else ("plain", "labkit")):
                    index += 1
                    if side == "labkit":
                        rates[side], _ = labkit_rate(config, str(workdir / "runs"))
                    else:
                        rates[side] = plain_rate(config, workdir, index)
                ratios.append(rates["labkit"] / rates["plain"])
                print(f"{model}, telemetry {'on' if telemetry else 'off'}, pair {pair + 1}: labkit "
                      f"{rates['labkit']:.1f} samples/s, plain deepspeed {rates['plain']:.1f} samples/s "
                      f"({1000 * config.global_batch / rates['plain']:.0f} ms/step), ratio {ratios[-1]:.4f}",
                      flush=True)
            ratio = statistics.median(ratios)
            print(f"{model}, telemetry {'on' if telemetry else 'off'}: labkit / plain deepspeed (median of "
                  f"{len(ratios)}) {ratio:.4f}  (goal >= 0.99: {'met' if ratio >= 0.99 else 'NOT met'}; "
                  f"spread {min(ratios):.3f}-{max(ratios):.3f})", flush=True)


if __name__ == "__main__":
    main()

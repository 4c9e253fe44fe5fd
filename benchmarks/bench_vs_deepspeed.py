"""A labkit run against the same training launched with plain `deepspeed`: does observing cost anything?

    .venv/bin/python benchmarks/bench_vs_deepspeed.py [--pairs 3] [--steps 200] [--models example3,large]

The plain side is what a user would write instead (PLAIN_SCRIPT below, no labkit import): the
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

from labkit import Run, RunConfig
from labkit.launch.launcher import build_command, free_port
from labkit.live.records import read_records
from labkit.live.telemetry import rank_file

MODELS = {"example3": {"hidden": 1024, "depth": 2}, "large": {"hidden": 4096, "depth": 2}}
TIMED_FROM_STEP = 3  # as labkit.launch.worker: steps 1-2 pay for lazy allocations

PLAIN_SCRIPT = '''\
"""The seed's Example 3, corrected: what a user runs with `deepspeed --num_gpus 2 train.py`."""
import argparse, json, os, time
import deepspeed, torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=0)
parser.add_argument("--config", required=True)
parser.add_argument("--shape", required=True)  # input,hidden,depth,output,dataset_size,steps,seed
parser.add_argument("--result", required=True)
args = parser.parse_args()
input_size, hidden, depth, output_size, size, steps, seed = map(int, args.shape.split(","))
ds_config = json.load(open(args.config))

deepspeed.init_distributed()
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.manual_seed(seed)
layers = [nn.Linear(input_size, hidden), nn.ReLU()]
for _ in range(depth - 1):
    layers += [nn.Linear(hidden, hidden), nn.ReLU()]
model = nn.Sequential(*layers, nn.Linear(hidden, output_size))
generator = torch.Generator().manual_seed(seed)
dataset = TensorDataset(torch.randn(size, input_size, generator=generator),
                        torch.randint(0, output_size, (size,), generator=generator))
sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True)
loader = DataLoader(dataset, batch_size=ds_config["train_micro_batch_size_per_gpu"], sampler=sampler,
                    drop_last=True)
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
criterion = nn.CrossEntropyLoss()


def batches():
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


data = batches()
for step in range(1, steps + 1):
    if step == TIMED_FROM_STEP:
        started = time.perf_counter()
    for _ in range(ds_config["gradient_accumulation_steps"]):
        inputs, labels = next(data)
        loss = criterion(engine(inputs.to(engine.device)).float(), labels.to(engine.device))
        engine.backward(loss)
        engine.step()
timed_s = time.perf_counter() - started
if rank == 0:
    with open(args.result, "w") as out:
        json.dump({"timed_steps": steps - TIMED_FROM_STEP + 1, "timed_s": timed_s}, out)
deepspeed.comm.destroy_process_group()
'''.replace("TIMED_FROM_STEP", str(TIMED_FROM_STEP))


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
    (here / "train.py").write_text(PLAIN_SCRIPT)
    (here / "ds_config.json").write_text(json.dumps(config.ds_config(), indent=2))
    _, env = build_command(config, here, master_port=0, accelerator="cpu")  # the env only: threads, sockets
    env.pop("PYTHONPATH", None)  # the plain script imports no labkit
    shape = ",".join(str(v) for v in (config.input_size, config.hidden, config.depth, config.output_size,
                                      config.dataset_size, config.steps, config.seed))
    argv = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(config.world_size),
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "train.py",
            "--config", "ds_config.json", "--shape", shape, "--result", "result.json"]
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

"""What the launch benchmarks share: labkit's run and its bare twins, launched and timed to rank 0's first step.

- `first_point_panel`: a RunConfig started by `LabPanel.launch()` (the Launch button), timed to the refresh
  that plots rank 0's first step.
- `first_step_bare`: the same RunConfig's labkit rank (rank guard + worker) under the bare DeepSpeed launcher,
  no supervisor (bench_dashboard.py's twin).
- PLAIN_SCRIPT / `plain_deepspeed_command`: the same training as a user writes it with no labkit import,
  started by `deepspeed --num_gpus N train.py` (bench_vs_deepspeed.py, bench_launch.py);
  PLAIN_PYTORCH_SCRIPT / `plain_pytorch_command`: Example 1 as `python train.py` (bench_launch.py).
- `launch_until`: starts a bare command in its own process group, waits for its first step, ends it.

Imported by the scripts in this folder (`python benchmarks/bench_x.py` puts the folder on sys.path).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's labkit

from labkit import RunConfig
from labkit.core.files import read_json, write_json_atomic
from labkit.core.records import RecordTail, rank_file, read_records
from labkit.launch.launcher import build_command, free_port
from labkit.runtime.devices import detect_devices

TIMED_FROM_STEP = 3  # as labkit.rank.done: steps 1-2 pay for lazy allocations
# The seed's Example 3 corrected (micro-batch 64, MLP 100-1024-1024-10), and the same MLP wider.
MODELS = {"example3": {"hidden": 1024, "depth": 2}, "large": {"hidden": 4096, "depth": 2}}

# Both plain scripts' model (the lab's SimpleModel as a Sequential) and data (seeded random tensors).
MODEL_AND_DATA = '''\
torch.manual_seed(seed)
layers = [nn.Linear(input_size, hidden), nn.ReLU()]
for _ in range(depth - 1):
    layers += [nn.Linear(hidden, hidden), nn.ReLU()]
model = nn.Sequential(*layers, nn.Linear(hidden, output_size))
generator = torch.Generator().manual_seed(seed)
dataset = TensorDataset(torch.randn(size, input_size, generator=generator),
                        torch.randint(0, output_size, (size,), generator=generator))
'''

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
MODEL_AND_DATA
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
'''.replace("TIMED_FROM_STEP", str(TIMED_FROM_STEP)).replace("MODEL_AND_DATA\n", MODEL_AND_DATA)

PLAIN_PYTORCH_SCRIPT = '''\
"""Example 1 as a user writes it: `python train.py`, one process, a plain PyTorch loop."""
import argparse
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--shape", required=True)  # input,hidden,depth,output,dataset_size,steps,seed
parser.add_argument("--micro-batch", type=int, required=True)
parser.add_argument("--lr", type=float, required=True)
args = parser.parse_args()
input_size, hidden, depth, output_size, size, steps, seed = map(int, args.shape.split(","))

MODEL_AND_DATA
loader = DataLoader(dataset, batch_size=args.micro_batch, shuffle=True, drop_last=True, generator=generator)
optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
criterion = nn.CrossEntropyLoss()
data = iter(loader)
for step in range(1, steps + 1):
    try:
        inputs, labels = next(data)
    except StopIteration:
        data = iter(loader)
        inputs, labels = next(data)
    loss = criterion(model(inputs), labels)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
'''.replace("MODEL_AND_DATA\n", MODEL_AND_DATA)


class RunFailed(RuntimeError):
    """A benchmark run ended before its first step."""


def bench_config() -> RunConfig:
    """bench_dashboard.py's run: a small 2-rank ZeRO-3 MLP, 5 steps."""
    return RunConfig(example="zero3", world_size=min(2, detect_devices().max_ranks), micro_batch=32, steps=5,
                     hidden=256, depth=1, dataset_size=2048)


def shape_arg(config: RunConfig) -> str:
    """The plain scripts' --shape: input,hidden,depth,output,dataset_size,steps,seed."""
    return ",".join(str(v) for v in (config.input_size, config.hidden, config.depth, config.output_size,
                                     config.dataset_size, config.steps, config.seed))


def plain_deepspeed_command(config: RunConfig, here: Path, master_port: int) -> tuple[list[str], dict[str, str]]:
    """(argv, env) of `config`'s training as PLAIN_SCRIPT under DeepSpeed's launcher, run in `here` (written:
    train.py, ds_config.json; the rank-0 result goes to result.json), with the environment labkit's launcher
    builds (the same OMP threads per rank, accelerator and loopback sockets) and no labkit on PYTHONPATH."""
    (here / "train.py").write_text(PLAIN_SCRIPT)
    (here / "ds_config.json").write_text(json.dumps(config.ds_config(), indent=2))
    _, env = build_command(config, here, master_port=0, accelerator="cpu")  # the env only: threads, sockets
    env.pop("PYTHONPATH", None)  # the plain script imports no labkit
    argv = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(config.world_size),
            "--master_addr", "127.0.0.1", "--master_port", str(master_port), "train.py",
            "--config", "ds_config.json", "--shape", shape_arg(config), "--result", "result.json"]
    return argv, env


def plain_pytorch_command(config: RunConfig, here: Path) -> tuple[list[str], dict[str, str]]:
    """(argv, env) of a one-rank `pytorch` config's training as PLAIN_PYTORCH_SCRIPT, `python train.py` in `here`,
    with labkit's launch environment (threads) and no labkit on PYTHONPATH."""
    (here / "train.py").write_text(PLAIN_PYTORCH_SCRIPT)
    _, env = build_command(config, here, master_port=0, accelerator="cpu")
    env.pop("PYTHONPATH", None)
    argv = [sys.executable, "train.py", "--shape", shape_arg(config), "--micro-batch", str(config.micro_batch),
            "--lr", str(config.lr_at(1))]
    return argv, env


def launch_until(argv: list[str], env: dict[str, str], *, cwd: Path | None, log_path: Path,
                 first_step: Callable[[], bool], at_first_step: Callable[[int], Any] | None = None,
                 master_port: int | None = None) -> tuple[float, float]:
    """Starts `argv` in a new process group, polls `first_step()` every 10 ms, calls `at_first_step(pid)` (the
    processes are still alive then), then SIGKILLs the group. Returns (wall time just before the start,
    seconds from there to the poll that saw the first step). Raises RunFailed if it exits before."""
    wall0, t0 = time.time(), time.monotonic()
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while not first_step():
            if proc.poll() is not None and not first_step():
                raise RunFailed(f"{argv[1:4]} exited {proc.returncode} before a step; see {log_path}")
            time.sleep(0.01)
        total = time.monotonic() - t0
        if at_first_step is not None:
            at_first_step(proc.pid)
    finally:
        # The launcher's process group holds every rank (nobody starts a new session); the
        # benchmark needs no graceful end, and SIGKILL leaves nothing lingering.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        if master_port is not None:
            # DeepSpeed's CPU all-reduce leaves a ~66 MB /dev/shm buffer per rank (the supervisor
            # removes them for labkit runs); this run's carry its own port in their names.
            for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{master_port}_*"):
                path.unlink(missing_ok=True)
    return wall0, total


def rank0_times(run_dir: Path) -> tuple[float, float]:
    """Wall-clock times of rank 0's start record and of its first step record."""
    records = read_records(rank_file(run_dir, 0))
    start = next(r for r in records if r.get("event") == "start")
    step = next(r for r in records if r.get("event") == "step")
    return start["wall_time"], start["wall_time"] + step["time_s"] - start["time_s"]


def first_step_bare(config: RunConfig, root: Path) -> dict[str, float]:
    """Seconds from starting DeepSpeed's launcher (labkit's rank guard + worker on each rank, no supervisor) to
    rank 0's first step record, with phases."""
    run_dir = Path(tempfile.mkdtemp(prefix="bare-", dir=root))
    write_json_atomic(run_dir / "config.json", config.to_dict())
    port = free_port()
    argv, env = build_command(config, run_dir, master_port=port, accelerator=detect_devices().accelerator)
    tail = RecordTail(rank_file(run_dir, 0))
    stepped: list[bool] = []

    def first_step() -> bool:
        stepped.extend(True for r in tail.poll() if r.get("event") == "step")
        return bool(stepped)

    wall0, total = launch_until(argv, env, cwd=None, log_path=run_dir / "launcher.log", first_step=first_step,
                                master_port=port)
    rank_start, first = rank0_times(run_dir)
    return {"total": total, "labkit": 0.0, "to_rank": rank_start - wall0, "to_step": first - rank_start}


def first_point_panel(config: RunConfig, root: Path,
                      at_first_point: Callable[[Any], Any] | None = None, *, cold: bool = True) -> dict[str, Any]:
    """Seconds from LabPanel.launch() to the dashboard refresh that plots the first step, with phases.
    `at_first_point(run)` is called once it is plotted, before the run is stopped. `cold`: the panel's "cold
    launch" box (DeepSpeed's launcher, the phases these benchmarks split); unticked, a warm launch."""
    from labkit.ui.panel import LabPanel

    fields = ("example", "world_size", "micro_batch", "steps", "hidden", "depth", "dataset_size")
    panel = LabPanel(root=root, **{name: getattr(config, name) for name in fields})
    assert panel.config() == config
    panel.cold.value = cold
    t0, wall0 = time.monotonic(), time.time()
    run = panel.launch()
    try:
        while panel.dashboard.first_point_at is None:
            if run.done:
                raise RunFailed(f"panel run ended {run.status} before a step: {run.cause}")
            time.sleep(0.01)
        total = panel.dashboard.first_point_at - t0
        # The supervisor's status.json says when it started DeepSpeed's launcher (until the run ends).
        launched = read_json(run.run_dir / "status.json")["started_at"]
        if at_first_point is not None:
            at_first_point(run)
    finally:
        panel.stop()
        panel.close()
    rank_start, first_step = rank0_times(run.run_dir)
    plotted = wall0 + total
    # labkit's own share: Launch -> launcher running (config, run dir, supervisor start) and
    # first step on disk -> plotted (poll interval + refresh).
    return {"total": total, "labkit": (launched - wall0) + (plotted - first_step),
            "to_rank": rank_start - launched, "to_step": first_step - rank_start,
            "supervisor": launched - wall0, "plot": plotted - first_step,
            "wall0": wall0, "run_dir": str(run.run_dir)}

"""`labkit export`: a job directory that runs on a cluster unchanged, under labkit's supervisor.

    python -m labkit export --example zero3 --world-size 16 --hostfile hosts --launcher pdsh --out job/
    job/launch.sh          # on a node (or login node) that reaches every node

The directory holds everything the job needs besides Python and DeepSpeed: a copy of labkit,
`config.json`, `launch.json` (what the supervisor starts), the hostfile, `.deepspeed_env` (the
environment DeepSpeed's runner forwards to every node), `ds_config.json` (DeepSpeed's own
config, with its own LR `scheduler`, for a plain `deepspeed train.py --deepspeed_config`) and
`launch.sh`. It must lie on a filesystem every node shares, at the same path on each: the
ranks read it and write their records into it. Built without looking at this machine's devices.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

from labkit.launch.config import RunConfig
from labkit.launch.launcher import build_command
from labkit.launch.multinode import deepspeed_env_text
from labkit.launch.store import write_json_atomic, write_text_atomic

LAUNCHERS = ("pdsh", "openmpi", "slurm")
PACKAGE_DIR = Path(__file__).resolve().parents[1]  # labkit/, copied whole


def export_ds_config(config: RunConfig) -> dict[str, Any]:
    """The run's DeepSpeed config with its LR rule as DeepSpeed's own `scheduler` and a
    `steps_per_print` that prints. labkit's ranks write the LR into the optimizer themselves
    (`RunConfig.lr_at`), so this is for the config used on its own: without the block, DeepSpeed
    trains at the peak LR from step 1 and, with labkit's 1e9, prints nothing."""
    ds_config = config.ds_config()
    if not ds_config:  # the plain PyTorch example has no DeepSpeed config
        return ds_config
    # labkit's rule (`RunConfig.lr_at`): linear warmup to the (scaled) peak LR, then constant.
    # That is WarmupLR; a rule that decays after the warmup would be WarmupDecayLR.
    warmup = config.warmup_steps_effective  # warmup_samples too, as the ranks count it
    ds_config["scheduler"] = {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.0 if warmup else config.peak_lr, "warmup_max_lr": config.peak_lr,
        "warmup_num_steps": max(1, warmup), "warmup_type": "linear"}}
    ds_config["steps_per_print"] = max(1, min(100, config.steps // 10))
    return ds_config


def launch_script(python: str, launcher: str) -> str:
    """launch.sh: the user's PATH kept, labkit's Python first; runs the supervisor, reports the outcome."""
    bin_dir = str(Path(python).parent)
    report = ('import json, sys; s = json.load(open("status.json")); '
              'print(s["status"] + (": " + s["cause"] if s.get("cause") else "")); sys.exit(s["status"] != "finished")')
    return f"""#!/usr/bin/env bash
# Written by `labkit export --launcher {launcher}`: DeepSpeed's {launcher} launcher under labkit's supervisor.
# Run it where {'pdsh and ssh reach every node' if launcher == 'pdsh' else 'mpirun reaches every node'
                if launcher == 'openmpi' else 'srun can start the job (inside an allocation)'}. This directory
# must be on a filesystem every node shares, at this path; {python} must exist on every node.
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")"
if [ -e rank0.jsonl ]; then
    echo "$PWD already holds a run's records; export a new job directory" >&2
    exit 2
fi
# Prepended, not replaced: DeepSpeed's runner needs the user's {launcher} and ssh from PATH.
export PATH={shlex.quote(bin_dir)}:"$PATH"
export PYTHONPATH="$PWD${{PYTHONPATH:+:$PYTHONPATH}}"
echo "job $PWD: supervisor.log, launcher.log, logs/, rank<N>.jsonl; Ctrl-C stops every rank" >&2
{shlex.quote(python)} -m labkit.launch.supervisor "$PWD" --parent-pid $$ >>supervisor.log 2>&1 || true
exec {shlex.quote(python)} -c {shlex.quote(report)}
"""


def write_job(config: RunConfig, out: str | os.PathLike, *, launcher: str = "pdsh",
              master_port: int = 29500, master_addr: str | None = None) -> list[str]:
    """Write the job directory; returns the names written. `config` must name a hostfile."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}")
    if not config.hostfile:
        raise ValueError("export needs --hostfile: a job for DeepSpeed's multi-node launcher")
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if (out / "rank0.jsonl").exists():
        raise FileExistsError(f"{out} already holds a run's records; export into a new directory")
    hostfile = out / "hostfile"
    if not (hostfile.exists() and hostfile.samefile(config.hostfile)):
        shutil.copyfile(config.hostfile, hostfile)
    config = RunConfig.from_saved({**config.to_dict(), "hostfile": str(hostfile)})
    # A copy of labkit: the nodes import the job's own code, not whatever a checkout holds later.
    shutil.rmtree(out / "labkit", ignore_errors=True)
    shutil.copytree(PACKAGE_DIR, out / "labkit", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    base_env = dict(os.environ)
    argv, env = build_command(config, out, master_port=master_port, base_env=base_env, master_addr=master_addr)
    argv[4:4] = ["--launcher", launcher]  # after `python -u -m deepspeed.launcher.runner`
    env["PYTHONPATH"] = str(out)
    # What labkit sets, over the environment of whoever runs launch.sh (which prepends PATH itself).
    overlay = {k: v for k, v in env.items() if base_env.get(k) != v and k != "PATH"}
    write_json_atomic(out / "config.json", config.to_dict())
    write_json_atomic(out / "ds_config.json", export_ds_config(config))
    write_text_atomic(out / ".deepspeed_env", deepspeed_env_text(env))
    write_json_atomic(out / "launch.json", {
        "argv": argv, "env": overlay, "inherit_env": True, "world_size": config.world_size,
        "heartbeat_s": config.heartbeat_s, "startup_timeout_s": config.startup_timeout_s})
    script = out / "launch.sh"
    write_text_atomic(script, launch_script(sys.executable, launcher))
    script.chmod(0o755)
    write_text_atomic(out / "command.txt", f"{script}\n")
    return ["config.json", "ds_config.json", "launch.json", "hostfile", ".deepspeed_env", "launch.sh",
            "command.txt", "labkit/"]

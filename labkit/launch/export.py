"""`labkit export`: a job directory that runs on a cluster unchanged, under labkit's supervisor.

    python -m labkit export --example zero3 --world-size 16 --hostfile hosts --launcher pdsh --out job/
    job/launch.sh          # on a node (or login node) that reaches every node
    python -m labkit export --example zero3 --world-size 16 --nodes 2 --launcher slurm --out job/
    sbatch job/launch.sh   # on the cluster's login node

The directory holds everything the job needs besides Python and DeepSpeed: a copy of labkit,
`config.json`, `launch.json` (what the supervisor starts), the hostfile, `.deepspeed_env` (the
environment DeepSpeed's runner forwards to every node), `ds_config.json` (DeepSpeed's own
config, with its own LR `scheduler`, for a plain `deepspeed train.py --deepspeed_config`) and
`launch.sh`. It must lie on a filesystem every node shares, at the same path on each: the
ranks read it and write their records into it. Built without looking at this machine's devices.
A Slurm job's nodes are the allocation's: its hostfile and master address are written when the
job starts (`labkit.launch.job_start`), and `launch.sh` carries the `#SBATCH` lines.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labkit.core.config import ConfigError, RunConfig
from labkit.core.files import write_json_atomic, write_text_atomic
from labkit.launch.job_start import ANY_PORT
from labkit.launch.launch_spec import LaunchSpec
from labkit.launch.launcher import build_command
from labkit.launch.multinode import LAUNCHERS, OMPI_AS_ROOT, deepspeed_env_for, launcher_command

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # labkit/, copied whole
DEFAULT_MASTER_PORT = 29500  # pdsh and openmpi; a Slurm job takes a free port on its first node when it starts
# launch.sh's exit codes, as `labkit run`'s: what a scheduler's accounting (sacct's ExitCode) then shows.
STATUS_EXIT_CODES = {"finished": 0, "failed": 1, "oom": 3, "hung": 4, "stopped": 130}
REFUSED_EXIT_CODE = 2  # bad input, refused before anything started
# Slurm's --time formats: minutes, minutes:seconds, hours:minutes:seconds, days-hours[:minutes[:seconds]].
_SLURM_TIME = re.compile(r"(\d+-\d+(:\d+){0,2}|\d+(:\d+){0,2}|UNLIMITED|INFINITE)")
_SLURM_NAME = re.compile(r"[A-Za-z0-9_.+-]+(,[A-Za-z0-9_.+-]+)*")  # a partition list or an account


@dataclass(kw_only=True)
class SlurmOptions:
    """What `launch.sh`'s `#SBATCH` lines ask Slurm for (`labkit export --launcher slurm`)."""
    nodes: int = 1                    # the ranks are split evenly between the nodes
    partition: str | None = None      # None: the cluster's default partition (no line)
    time: str = "01:00:00"            # time limit, Slurm's formats (minutes, [D-]HH:MM:SS)
    gpus_per_node: int | None = None  # `--gres=gpu:N`; None: one per rank on the node; 0: no line (CPU ranks)
    account: str | None = None        # None: the user's default account (no line)

    def __post_init__(self) -> None:
        if not (isinstance(self.nodes, int) and self.nodes >= 1):
            raise ConfigError("nodes", f"must be a positive integer, got {self.nodes!r}")
        if not _SLURM_TIME.fullmatch(str(self.time)):
            raise ConfigError("time", f"{self.time!r} is not a Slurm time limit (minutes, HH:MM:SS or D-HH:MM:SS)")
        if self.gpus_per_node is not None and not (isinstance(self.gpus_per_node, int) and self.gpus_per_node >= 0):
            raise ConfigError("gpus_per_node", f"must be 0 or more, got {self.gpus_per_node!r}")
        for name in ("partition", "account"):
            value = getattr(self, name)
            if value is not None and not _SLURM_NAME.fullmatch(value):
                raise ConfigError(name, f"{value!r} is not a Slurm {name} name (letters, digits, _ . + -)")

    def ranks_per_node(self, world_size: int) -> int:
        if world_size % self.nodes:
            raise ConfigError("nodes", f"{world_size} ranks do not split evenly over {self.nodes} nodes (srun places "
                              "the same number on each: DeepSpeed's slurm launcher needs that)")
        return world_size // self.nodes

    def sbatch_lines(self, world_size: int, job_dir: Path, job_name: str) -> list[str]:
        per_node = self.ranks_per_node(world_size)
        gpus = per_node if self.gpus_per_node is None else self.gpus_per_node
        if 0 < gpus < per_node:
            raise ConfigError("gpus_per_node", f"{gpus} GPUs per node for {per_node} ranks per node: each rank "
                              "needs its own GPU (or 0 for CPU ranks)")
        lines = [f"--job-name={job_name}", f"--nodes={self.nodes}", f"--ntasks-per-node={per_node}",
                 f"--time={self.time}"]
        lines += [f"--partition={self.partition}"] if self.partition else []
        lines += [f"--gres=gpu:{gpus}"] if gpus else []
        lines += [f"--account={self.account}"] if self.account else []
        # Absolute: the job's output beside its records, whatever directory sbatch was called from.
        lines += [f"--output={job_dir / 'slurm-%j.out'}", f"--chdir={job_dir}"]
        return [f"#SBATCH {line}" for line in lines]


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


def launch_script(python: str, launcher: str, job_dir: Path, sbatch_lines: list[str] | None = None) -> str:
    """launch.sh: checks (job_start), then the supervisor, then the outcome as its exit code. The
    user's PATH is kept, labkit's Python first. `sbatch_lines`: a Slurm job's `#SBATCH` lines."""
    bin_dir = str(Path(python).parent)
    job = shlex.quote(str(job_dir))
    report = ('import json, sys; s = json.load(open("status.json")); '
              'print(s["status"] + (": " + s["cause"] if s.get("cause") else "")); '
              f'sys.exit({json.dumps(STATUS_EXIT_CODES)}.get(s["status"], 1))')
    codes = ", ".join(f"{code} {status}" for status, code in STATUS_EXIT_CODES.items())
    where = {"pdsh": f"Run it where pdsh and ssh reach every node: {job_dir}/launch.sh",
             "openmpi": f"Run it where mpirun reaches every node: {job_dir}/launch.sh",
             "slurm": f"Submit it: sbatch {job_dir}/launch.sh   (or run it inside salloc)"}[launcher]
    logs = "supervisor.log, launcher.log, logs/, rank<N>.jsonl (live), summary.json"
    stop_how = "Ctrl-C, kill of this script"
    if launcher == "slurm":
        logs = "slurm-${SLURM_JOB_ID}.out (this output), " + logs
        stop = "scancel ${SLURM_JOB_ID} stops every rank"
        stop_how = "scancel, the time limit, " + stop_how
        allocation = f"""if [ -z "${{SLURM_JOB_ID:-}}" ]; then
    echo "error: not inside a Slurm allocation; submit it: sbatch $job/launch.sh" >&2
    exit {REFUSED_EXIT_CODE}
fi
"""
    else:
        stop, allocation = "Ctrl-C stops every rank", ""
    as_root = f"""# Open MPI's mpirun refuses to run as root unless told to; only for root.
if [ "$EUID" -eq 0 ]; then export {" ".join(f"{k}={v}" for k, v in OMPI_AS_ROOT.items())}; fi
""" if launcher == "openmpi" else ""
    tools = {"pdsh": "pdsh and ssh", "openmpi": "mpirun", "slurm": "srun and scontrol"}[launcher]
    return f"""#!/usr/bin/env bash
# Written by `labkit export --launcher {launcher}`: DeepSpeed's {launcher} launcher under labkit's supervisor.
# {where}
# This directory must be on a filesystem every node shares, at this path; {python} must exist on every node.
# Exit codes: {codes}, {REFUSED_EXIT_CODE} refused before anything started.
{chr(10).join(sbatch_lines or [])}{chr(10) if sbatch_lines else ""}set -euo pipefail
job={job}
cd "$job" 2>/dev/null || {{
    echo "error: $job is not on this host ($HOSTNAME): the job directory must be on a filesystem every node shares" >&2
    exit {REFUSED_EXIT_CODE}
}}
if [ -e rank0.jsonl ]; then
    echo "error: $job already holds a run's records; export a new job directory" >&2
    exit {REFUSED_EXIT_CODE}
fi
{allocation}{as_root}# Prepended, not replaced: DeepSpeed's runner needs the user's {tools} from PATH.
export PATH={shlex.quote(bin_dir)}:"$PATH"
export PYTHONPATH="$job${{PYTHONPATH:+:$PYTHONPATH}}"
echo "job $job: {logs}; {stop}" >&2
# What DeepSpeed's launcher needs, checked before anything starts (exit {REFUSED_EXIT_CODE} with the reason).
{shlex.quote(python)} -m labkit.launch.job_start "$job" >&2  # stdout: only the outcome, last
{shlex.quote(python)} -m labkit.launch.supervisor "$job" --parent-pid $$ >>supervisor.log 2>&1 &
supervisor=$!
# A stop ({stop_how}) goes to the supervisor, which ends every rank and writes summary.json.
trap 'echo "stopping every rank ..." >&2; kill -TERM "$supervisor" 2>/dev/null || true' TERM INT HUP
while ! wait "$supervisor"; do kill -0 "$supervisor" 2>/dev/null || break; done
exec {shlex.quote(python)} -c {shlex.quote(report)}
"""


def slurm_placeholder_hostfile(nodes: int, ranks_per_node: int) -> str:
    """A Slurm job's hostfile until it starts: the allocation's nodes are not known before."""
    return ("# Placeholder: labkit.launch.job_start writes the Slurm allocation's nodes here when the job starts\n"
            + "".join(f"allocation-node-{i} slots={ranks_per_node}\n" for i in range(nodes)))


def check_master_port(master_port: int | None) -> None:
    """Refuse a rendezvous port that is no TCP port (None: the default, chosen by write_job)."""
    if master_port is not None and not 1 <= master_port <= 65535:
        raise ConfigError("master_port", f"--master-port must be a TCP port, 1-65535, got {master_port}")


def write_job(config: RunConfig, out: str | os.PathLike, *, launcher: str = "pdsh",
              master_port: int | None = None, master_addr: str | None = None,
              slurm: SlurmOptions | None = None) -> list[str]:
    """Write the job directory; returns the names written. `config` must name a hostfile, except
    for Slurm (`slurm`: its #SBATCH options), whose nodes are the allocation's."""
    if launcher not in LAUNCHERS:
        raise ConfigError("launcher", f"must be one of {LAUNCHERS}, got {launcher!r}")
    check_master_port(master_port)
    if launcher == "slurm" and config.hostfile:
        raise ConfigError("hostfile", "Slurm chooses the nodes: drop --hostfile and give --nodes (the ranks are "
                          "split evenly between them)")
    if launcher != "slurm" and not config.hostfile:
        raise ConfigError("hostfile", f"a job for DeepSpeed's {launcher} launcher needs --hostfile "
                          "(\"host slots=N\" lines)")
    if launcher != "slurm" and slurm is not None:
        raise ConfigError("launcher", "--nodes, --partition, --time, --gpus-per-node and --account are Slurm's: "
                          "give them with --launcher slurm")
    out = Path(out).resolve()
    sbatch = None
    if launcher == "slurm":
        slurm = slurm or SlurmOptions()
        sbatch = slurm.sbatch_lines(config.world_size, out, f"labkit-{config.example}")  # refuses before writing
        # The job directory holds absolute paths: it is exported where it is submitted, which needs sbatch.
        if shutil.which("sbatch") is None:
            raise ConfigError("launcher", "sbatch is not on the PATH: export a Slurm job on the cluster's login node, "
                              "where it is submitted (after `module load slurm` where the site uses modules)")
    out.mkdir(parents=True, exist_ok=True)
    if (out / "rank0.jsonl").exists():
        raise FileExistsError(f"{out} already holds a run's records; export into a new directory")
    hostfile = out / "hostfile"
    if slurm is not None:
        write_text_atomic(hostfile, slurm_placeholder_hostfile(slurm.nodes, slurm.ranks_per_node(config.world_size)))
        master_addr = "allocation-node-0"
    elif not (hostfile.exists() and hostfile.samefile(str(config.hostfile))):
        shutil.copyfile(str(config.hostfile), hostfile)
    config = RunConfig.from_saved({**config.to_dict(), "hostfile": str(hostfile)})
    # A copy of labkit: the nodes import the job's own code, not whatever a checkout holds later.
    shutil.rmtree(out / "labkit", ignore_errors=True)
    shutil.copytree(PACKAGE_DIR, out / "labkit", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    base_env = dict(os.environ)
    if master_port is None:
        master_port = ANY_PORT if launcher == "slurm" else DEFAULT_MASTER_PORT
    argv, env = build_command(config, out, master_port=master_port, base_env=base_env, master_addr=master_addr)
    argv = launcher_command(argv, launcher, out / "labkit")
    env["PYTHONPATH"] = str(out)
    # What labkit sets, over the environment of whoever runs launch.sh (which prepends PATH itself).
    overlay = {k: v for k, v in env.items() if base_env.get(k) != v and k != "PATH"}
    write_json_atomic(out / "config.json", config.to_dict())
    write_json_atomic(out / "ds_config.json", export_ds_config(config))
    write_text_atomic(out / ".deepspeed_env", deepspeed_env_for(argv, env, launcher))
    LaunchSpec.from_command(argv, overlay, world_size=config.world_size, heartbeat_s=config.heartbeat_s,
                            startup_timeout_s=config.startup_timeout_s).write(out, private=False)
    script = out / "launch.sh"
    write_text_atomic(script, launch_script(sys.executable, launcher, out, sbatch))
    script.chmod(0o755)
    write_text_atomic(out / "command.txt", ("sbatch " if launcher == "slurm" else "") + f"{script}\n")
    return ["config.json", "ds_config.json", "launch.json", "hostfile", ".deepspeed_env", "launch.sh",
            "command.txt", "labkit/"]

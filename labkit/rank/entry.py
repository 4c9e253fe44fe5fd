"""The program srun or mpirun starts on every rank (DeepSpeed's `slurm` and `openmpi` launchers).

Those two launchers start the user's program directly on every rank, without DeepSpeed's
`launch.py`, which is what sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE, MASTER_ADDR and
MASTER_PORT for the pdsh and local paths (deepspeed/launcher/launch.py:177-215 in 0.19.8).
srun and mpirun give SLURM_PROCID / OMPI_COMM_WORLD_RANK ... instead. DeepSpeed's own answer,
`deepspeed.init_distributed`'s MPI discovery (deepspeed/comm/comm.py:889-898 and 913-950), needs
mpi4py and an MPI-aware launch (not a plain srun), and takes port 29500 and `hostname -I`'s first
address. So this sets the torch variables from the launcher's (MASTER_ADDR / MASTER_PORT come
through `.deepspeed_env`), sends the rank's output to `logs/<launcher>_rank<N>.log` as launch.py's
`--enable_each_rank_log` does, and replaces itself (exec, same pid: srun's and mpirun's signals
reach it) with `python -m labkit.rank.guard`, the same guard as on every other path.

Run by path under Slurm (DeepSpeed's SlurmRunner starts `python -u <script>` even with
`--module`: deepspeed/launcher/multinode_runner.py:419-420), so sys.path[0] is this directory: it
imports nothing beyond `os` and `sys`, which the interpreter has loaded before sys.path is read.
"""

from __future__ import annotations

import os
import sys

GUARD_MODULE = "labkit.rank.guard"


class LauncherEnvError(RuntimeError):
    pass


def tasks_per_node(text: str) -> list[int]:
    """Slurm's compressed tasks-per-node list, "2(x3),1" -> [2, 2, 2, 1]."""
    counts = []
    for part in filter(None, text.split(",")):
        count, _, repeat = part.partition("(x")
        counts += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
    return counts


def rank_env(environ: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE (and CROSS_RANK / CROSS_SIZE under Slurm), from the
    variables srun or mpirun set. Raises LauncherEnvError when neither started this process, or when
    MASTER_ADDR / MASTER_PORT did not come through."""
    if "OMPI_COMM_WORLD_RANK" in environ:
        env = {"RANK": environ["OMPI_COMM_WORLD_RANK"], "LOCAL_RANK": environ["OMPI_COMM_WORLD_LOCAL_RANK"],
               "WORLD_SIZE": environ["OMPI_COMM_WORLD_SIZE"], "LOCAL_SIZE": environ["OMPI_COMM_WORLD_LOCAL_SIZE"]}
    elif "SLURM_PROCID" in environ and "SLURM_STEP_ID" in environ:  # a task of a job step (srun), not a batch script
        node = int(environ["SLURM_NODEID"])
        env = {"RANK": environ["SLURM_PROCID"], "LOCAL_RANK": environ["SLURM_LOCALID"],
               "WORLD_SIZE": environ["SLURM_STEP_NUM_TASKS"],
               "LOCAL_SIZE": str(tasks_per_node(environ["SLURM_STEP_TASKS_PER_NODE"])[node]),
               "CROSS_RANK": str(node), "CROSS_SIZE": environ["SLURM_STEP_NUM_NODES"]}
    else:
        raise LauncherEnvError("started neither by srun (no SLURM_PROCID / SLURM_STEP_ID) nor by mpirun "
                               "(no OMPI_COMM_WORLD_RANK): this is the rank program of DeepSpeed's slurm "
                               "and openmpi launchers")
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not environ.get(name)]
    if missing:
        raise LauncherEnvError(f"{' and '.join(missing)} not set: DeepSpeed's runner forwards them from the "
                               "run directory's .deepspeed_env, which labkit writes")
    return env


def main() -> int:
    argv = sys.argv[1:]
    launcher = "openmpi" if "OMPI_COMM_WORLD_RANK" in os.environ else "slurm"
    try:
        env = rank_env(os.environ)
    except (LauncherEnvError, KeyError, ValueError) as exc:
        print(f"labkit.rank.entry: {exc}", file=sys.stderr)
        return 2
    os.environ.update(env)
    run_dir = argv[argv.index("--run-dir") + 1]
    logs = os.path.join(run_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    log = os.open(os.path.join(logs, f"{launcher}_rank{env['RANK']}.log"),
                  os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    # launch.py passes --local_rank first to the rank's program (the worker reads it); srun and mpirun do not.
    os.execv(sys.executable, [sys.executable, "-u", "-m", GUARD_MODULE, f"--local_rank={env['LOCAL_RANK']}", *argv])
    return 1  # not reached: execv replaced this process


if __name__ == "__main__":
    sys.exit(main())

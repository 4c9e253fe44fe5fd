"""The start of an exported job (`labkit export`'s launch.sh), before its supervisor starts anything.

    python -m labkit.launch.job_start JOB_DIR     # exit 0: go on; 2: refused, the reason on stderr

It checks what DeepSpeed's launcher needs on this host, where the job runs: the launcher's programs
on the PATH (`labkit.launch.multinode.check_tools`), a world size the hostfile's slots or the Slurm
allocation hold, and a job directory every node sees (over ssh for pdsh and for mpirun's other
hosts; with one srun task per node under Slurm). Under Slurm the nodes are known only now: it writes
the allocation's nodes into the job's `hostfile`, and the first node's name and a port into
`launch.json` and `.deepspeed_env` (MASTER_ADDR / MASTER_PORT for the ranks, `labkit.rank.entry`).
"""

from __future__ import annotations

import os
import secrets
import shlex
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from labkit.core.config import ConfigError, hostfile_slots
from labkit.core.files import write_text_atomic
from labkit.launch.launch_spec import LaunchSpec
from labkit.launch.launcher import free_port
from labkit.launch.multinode import (
    check_shared_run_dir,
    check_slots,
    check_tools,
    deepspeed_env_text,
    master_of,
    ssh_hosts,
)
from labkit.rank.entry import tasks_per_node

SRUN_CHECK_TIMEOUT_S = 120.0  # one task per node; a busy controller can take a while to start a step
ANY_PORT = 0  # launch.json's master port when export left the port to the job's start


def slurm_allocation(environ: Mapping[str, str]) -> dict[str, int]:
    """Node -> tasks of the Slurm allocation this runs in (`scontrol show hostnames` expands the
    node list, "gpu[01-04]" -> gpu01 ... gpu04)."""
    if not environ.get("SLURM_JOB_ID"):
        raise ConfigError("launcher", "not inside a Slurm allocation (no SLURM_JOB_ID): submit the job with "
                          "sbatch, or run it inside salloc")
    if not environ.get("SLURM_TASKS_PER_NODE"):
        raise ConfigError("launcher", f"Slurm job {environ['SLURM_JOB_ID']} has no task count (SLURM_TASKS_PER_NODE): "
                          "submit it with --ntasks-per-node (launch.sh's #SBATCH lines have it)")
    nodes = subprocess.run(["scontrol", "show", "hostnames", environ["SLURM_JOB_NODELIST"]], capture_output=True,
                           text=True, check=True, timeout=60).stdout.split()
    counts = tasks_per_node(environ["SLURM_TASKS_PER_NODE"])
    if len(counts) != len(nodes):
        raise ConfigError("launcher", f"Slurm gives {len(nodes)} nodes ({environ['SLURM_JOB_NODELIST']}) but "
                          f"{len(counts)} task counts ({environ['SLURM_TASKS_PER_NODE']})")
    return dict(zip(nodes, counts, strict=True))


def nodes_not_seeing(srun_output: str, nodes: list[str]) -> list[str]:
    """The nodes that did not answer `seen` to the shared-directory check (one srun task per node
    prints `<node> seen` when it finds the file)."""
    seen = {line.split()[0] for line in srun_output.splitlines() if line.endswith(" seen")}
    return [node for node in nodes if node not in seen]


def check_shared_under_slurm(job_dir: Path, nodes: list[str]) -> None:
    """Refuse (ConfigError) unless every node of the allocation sees `job_dir`: one srun task per
    node looks for a file written here (no ssh, which Slurm nodes often refuse)."""
    nonce = job_dir / f".labkit-shared-check-{secrets.token_hex(8)}"
    nonce.write_text("labkit: every node of the allocation must see this file\n")
    script = f'test -f {shlex.quote(str(nonce))} && echo "$SLURMD_NODENAME seen"; true'
    try:
        result = subprocess.run(["srun", f"--nodes={len(nodes)}", f"--ntasks={len(nodes)}", "--ntasks-per-node=1",
                                 "sh", "-c", script], capture_output=True, text=True, timeout=SRUN_CHECK_TIMEOUT_S,
                                stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise ConfigError("launcher", f"srun did not run the shared-directory check within "
                          f"{SRUN_CHECK_TIMEOUT_S:g} s") from None
    finally:
        nonce.unlink(missing_ok=True)
    if result.returncode != 0:
        raise ConfigError("launcher", f"srun could not run a task on every node (exit {result.returncode}): "
                          f"{result.stderr.strip()}")
    missing = nodes_not_seeing(result.stdout, nodes)
    if missing:
        raise ConfigError("launcher", f"the job directory {job_dir} is not visible on node(s) {', '.join(missing)}; "
                          "it must be on a filesystem every node shares, at the same path")


def resolve_slurm(job_dir: Path, spec: LaunchSpec, allocation: dict[str, int]) -> list[str]:
    """Write the allocation into the job: `hostfile`, and the first node and a port as the master's
    address in launch.json (its argv too) and `.deepspeed_env`. Returns lines that say what was chosen."""
    argv = list(spec.argv)
    first = next(iter(allocation))
    port = spec.master_port
    if port == ANY_PORT:
        # The batch script runs on the allocation's first node, where rank 0 will listen.
        port = free_port("0.0.0.0")
    argv[argv.index("--master_addr") + 1] = first
    argv[argv.index("--master_port") + 1] = str(port)
    assert spec.hostfile is not None  # export writes a placeholder hostfile for Slurm jobs
    write_text_atomic(Path(spec.hostfile),
                      "# The Slurm allocation, written at the job's start by labkit.launch.job_start\n"
                      + "".join(f"{node} slots={count}\n" for node, count in allocation.items()))
    env_file = job_dir / ".deepspeed_env"
    kept = {k: v for k, _, v in (line.partition("=") for line in env_file.read_text().splitlines() if "=" in line)}
    write_text_atomic(env_file, deepspeed_env_text({**kept, **master_of(argv)}, "slurm"))
    spec.replace(argv=argv, master_addr=first, master_port=port).write(job_dir, private=False)
    return [f"Slurm job {os.environ.get('SLURM_JOB_ID')}: {', '.join(f'{n} x{c}' for n, c in allocation.items())}; "
            f"master {first}:{port}"]


def prepare(job_dir: str | os.PathLike, environ: Mapping[str, str] = os.environ) -> list[str]:
    """Check (ConfigError) and, under Slurm, resolve the job in `job_dir`; returns what to print."""
    job_dir = Path(job_dir).resolve()
    spec = LaunchSpec.read(job_dir)
    if spec is None:
        raise ConfigError("launcher", f"{job_dir} holds no launch.json: not a job directory of `labkit export`")
    check_tools(spec.launcher, environ.get("PATH", ""))
    if spec.launcher == "slurm":
        allocation = slurm_allocation(environ)
        check_slots(spec.world_size, allocation, f"Slurm job {environ['SLURM_JOB_ID']}'s allocation", uniform=True)
        check_shared_under_slurm(job_dir, list(allocation))
        return resolve_slurm(job_dir, spec, allocation)
    assert spec.hostfile is not None  # export refuses a job without one
    slots = hostfile_slots(spec.hostfile)
    check_slots(spec.world_size, slots, "the hostfile")
    remote = ssh_hosts(spec.launcher, list(slots))
    if remote:
        check_shared_run_dir(job_dir, remote)
    return []


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: python -m labkit.launch.job_start JOB_DIR", file=sys.stderr)
        return 2
    try:
        lines = prepare(sys.argv[1])
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for line in lines:
        print(line, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

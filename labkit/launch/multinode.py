"""What multi-node runs need beyond DeepSpeed's launcher: environment, master address, checks, stop.

DeepSpeed's runner reaches the other hosts with pdsh over ssh, mpirun (Open MPI) or srun (Slurm).
Measured with 0.19.8, on its own it:

- forwards only PYTHON*, MLFLOW*, MV2*, UCX* (and NCCL* when the launching host has CUDA), so
  remote ranks miss the venv's PATH (DeepSpeed runs `ninja` at every op load),
  TORCH_EXTENSIONS_DIR, DS_ACCELERATOR and labkit's own variables. It also reads a
  `.deepspeed_env` file from its working directory: `deepspeed_env_text` writes one;
- stops remote ranks with `pdsh ... pkill -f "<python> -u -m deepspeed.launcher.launch"`,
  which ends every DeepSpeed launch of the user on those hosts. `stop_remote` ends only the
  processes of one run directory, waits for them, and reports what is left;
- notices a run directory that is not shared only when node 0 times out at the rendezvous.
  `check_shared_run_dir` refuses it before launch.

Every host is reached with plain `ssh <host>`, as DeepSpeed's own pre-flight check does, so
the user's ssh configuration (ports, keys, aliases) applies.

With `--launcher openmpi` or `slurm` the runner starts no `launch.py`: mpirun and srun start the
rank's program themselves, and `labkit.rank.entry` turns their variables into torch's.
`launcher_command` builds those commands (what DeepSpeed gets wrong there is said beside it),
`check_tools` refuses a launch whose launcher is not on the PATH, and `check_slots` a world size
the hostfile or the Slurm allocation does not hold.
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import shutil
import socket
import subprocess
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from labkit.core.config import ConfigError, hostfile_slots
from labkit.launch.proctree import HOST_MODULES

LAUNCHERS = ("pdsh", "openmpi", "slurm")
# Variables the remote ranks need, by name and by prefix (PYTHON* DeepSpeed forwards itself).
# MASTER_ADDR / MASTER_PORT: for mpirun and srun, which start no launch.py to set them.
FORWARDED_VARS = ("PATH", "LD_LIBRARY_PATH", "TORCH_EXTENSIONS_DIR", "DS_ACCELERATOR", "OMP_NUM_THREADS",
                  "CUDA_HOME", "TRITON_CACHE_DIR", "MASTER_ADDR", "MASTER_PORT")
FORWARDED_PREFIXES = ("LABKIT_", "NCCL_", "GLOO_", "TORCH_")
_QUOTED_BY_DEEPSPEED = re.compile(r"[^\w@%+=:,./-]")  # MultiNodeRunner.add_export's test, 0.19.8
SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", "ConnectTimeout=10")
REMOTE_STOP_GRACE_S = 3.0   # SIGTERM -> SIGKILL on each host
REMOTE_STOP_TIMEOUT_S = 25.0  # the whole remote stop, ssh connection included


def deepspeed_env_text(env: Mapping[str, str], launcher: str = "pdsh") -> str:
    """The `.deepspeed_env` lines (KEY=VALUE) that carry `env`'s relevant variables to remote ranks.

    Values are literal: DeepSpeed puts them into `export K="V"` (pdsh), `-x K=V` (OpenMPI) or
    `--export=K=V` (Slurm), and only the first would expand a `$PATH`. PATH is the launching
    environment's, labkit's entries first: the same paths on every node is a multi-node
    requirement anyway. A value with a newline or a double quote cannot be carried, so is left out.
    So is, for mpirun and srun, a value DeepSpeed would wrap in double quotes (any character beyond
    `[\\w@%+=:,./-]`, multinode_runner.py:37-41): quotes meant for pdsh's shell, which mpirun and srun
    take literally. srun's ranks get the runner's whole environment (`--export=ALL`), so under Slurm
    only what must differ from it travels here, and never a value with a comma (srun splits its
    `--export=ALL,K=V,...` at commas: multinode_runner.py:415-417); PATH stays the job's own.
    """
    lines = []
    for key in sorted(env):
        if key not in FORWARDED_VARS and not key.startswith(FORWARDED_PREFIXES):
            continue
        value = env[key]
        unsafe = "\n" in value or '"' in value
        quoted = launcher != "pdsh" and _QUOTED_BY_DEEPSPEED.search(value) is not None
        srun_all = launcher == "slurm" and ("," in value or key == "PATH")
        if not (unsafe or quoted or srun_all):
            lines.append(f"{key}={value}")
    return "\n".join(lines) + "\n"


def launcher_command(argv: list[str], launcher: str, package_dir: str | os.PathLike) -> list[str]:
    """`build_command`'s multi-node argv for DeepSpeed's `launcher`, whose ranks import labkit from
    `package_dir` (the job's copy, or this checkout). pdsh: unchanged but for `--launcher pdsh`.

    openmpi and slurm start the rank's program through `labkit.rank.entry` (their ranks get no
    RANK etc. from DeepSpeed), with two of the runner's options:
    - `--force_multi`: with one host in the hostfile (one node, or a one-node Slurm allocation) the
      runner takes its local path, launch.py without mpirun or srun (runner.py:537 in 0.19.8);
    - `--no_ssh_check`: the runner's `ssh <first host> hostname` (runner.py:483-493) fails where no
      sshd runs (a Slurm node, this host as `localhost`); labkit checks the hosts it must reach itself.
    DeepSpeed's SlurmRunner runs `python -u <script>` whether or not `--module` is given
    (multinode_runner.py:419-420), so under Slurm the program is labkit/rank/entry.py; `--module`
    stays, ignored by that runner, because labkit's supervisor inserts its options before it.
    """
    if launcher not in LAUNCHERS:
        raise ConfigError("launcher", f"must be one of {LAUNCHERS}, got {launcher!r}")
    argv = list(argv)
    at = argv.index("deepspeed.launcher.runner") + 1
    if launcher == "pdsh":
        return [*argv[:at], "--launcher", "pdsh", *argv[at:]]
    program = argv.index("--module") + 1
    argv[program] = (str(Path(package_dir).resolve() / "rank" / "entry.py") if launcher == "slurm"
                     else "labkit.rank.entry")
    return [*argv[:at], "--launcher", launcher, "--force_multi", "--no_ssh_check", *argv[at:]]


def deepspeed_env_for(argv: list[str], env: Mapping[str, str], launcher: str) -> str:
    """The `.deepspeed_env` of a launch command: `env`'s variables, and for mpirun and srun, which
    start no launch.py, the master's address and port (labkit.rank.entry reads them)."""
    return deepspeed_env_text(env if launcher == "pdsh" else {**env, **master_of(argv)}, launcher)


def ssh_hosts(launcher: str, hosts: list[str]) -> list[str]:
    """The hosts labkit reaches over ssh to check the run directory and to stop ranks: every host
    for pdsh; for mpirun only the others (it forks its own host's ranks, no sshd needed there);
    none under Slurm (srun reaches the nodes)."""
    if launcher == "slurm":
        return []
    return list(hosts) if launcher == "pdsh" else [host for host in hosts if not is_this_host(host)]


# mpirun refuses to run as root unless both are set (Open MPI 4.x); labkit sets them only for root.
OMPI_AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def master_of(argv: list[str]) -> dict[str, str]:
    """MASTER_ADDR and MASTER_PORT of a launch command, as the ranks of mpirun and srun need them."""
    return {"MASTER_ADDR": argv[argv.index("--master_addr") + 1], "MASTER_PORT": argv[argv.index("--master_port") + 1]}


# What each launcher needs on the PATH of the host that runs DeepSpeed's runner, and the Debian
# package that has it. The runner itself checks one (`pdsh`, `ompi_info`, `sinfo`:
# multinode_runner.py:70-71, 139-141, 357-358) and only once it runs, as a RuntimeError in launcher.log.
LAUNCHER_TOOLS = {"pdsh": (("pdsh", "ssh"), "pdsh and openssh-client"),
                  "openmpi": (("mpirun", "ompi_info"), "openmpi-bin"),
                  "slurm": (("srun", "sinfo", "scontrol"), "slurm-client")}


def check_tools(launcher: str, path: str | None = None) -> None:
    """Refuse (ConfigError) a launch whose launcher's programs are not on `path` (default: PATH)."""
    tools, package = LAUNCHER_TOOLS[launcher]
    path = os.environ.get("PATH", "") if path is None else path
    missing = [tool for tool in tools if shutil.which(tool, path=path) is None]
    if missing:
        raise ConfigError("launcher", f"DeepSpeed's {launcher} launcher needs {' and '.join(missing)} on the PATH "
                          f"of this host, and it is not there (PATH={path}); install {package} or load its module")


def check_run_launcher(launcher: str, hostfile: str | None, path: str) -> None:
    """Refuse (ConfigError) a launcher `labkit run` cannot use with this config, or whose programs
    are not on `path`."""
    if launcher == "slurm":
        raise ConfigError("launcher", "a Slurm job is submitted, not run from here: `labkit export --launcher slurm "
                          "--out job/`, then `sbatch job/launch.sh`")
    if launcher not in LAUNCHERS:
        raise ConfigError("launcher", f"must be one of pdsh, openmpi, got {launcher!r}")
    if not hostfile:
        raise ConfigError("launcher", f"--launcher {launcher} is DeepSpeed's multi-node launcher: it needs --hostfile")
    check_tools(launcher, path)


def check_slots(world_size: int, slots: Mapping[str, int], where: str, *, uniform: bool = False) -> None:
    """Refuse (ConfigError) a world size that `slots` (host -> ranks, from a hostfile or an allocation)
    does not hold, and, with `uniform` (Slurm: srun places tasks by count, so DeepSpeed's SlurmRunner
    wants the same count on every host, multinode_runner.py:365-381), uneven counts."""
    total = sum(slots.values())
    if total != world_size:
        raise ConfigError("world_size", f"the job was built for {world_size} ranks but {where} holds {total} "
                          f"({', '.join(f'{host}: {n}' for host, n in slots.items())}); one rank per slot")
    if uniform and len(set(slots.values())) > 1:
        raise ConfigError("world_size", f"{where} has uneven ranks per node ({dict(slots)}); DeepSpeed's Slurm "
                          "launcher needs the same number on every node")


def is_this_host(host: str) -> bool:
    """Whether a hostfile's host is the machine this runs on (mpirun starts its ranks without ssh)."""
    names = {"localhost", "127.0.0.1", "::1", socket.gethostname(), socket.gethostname().split(".")[0]}
    return host in names or host == socket.getfqdn()


def rank_hosts(hostfile: str | os.PathLike) -> list[str]:
    """The host of each global rank: DeepSpeed numbers ranks host by host, in hostfile order."""
    return [host for host, slots in hostfile_slots(hostfile).items() for _ in range(slots)]


def hostname_from_ssh_config(text: str) -> str | None:
    """The `hostname` that `ssh -G <host>` resolved (an alias's real name), or None."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key.lower() == "hostname" and value.strip():
            return value.strip()
    return None


def master_addr(first_host: str) -> str:
    """The address the other nodes reach node 0 at: the hostfile names ssh hosts, which may be
    aliases (`Host gpu1` with `HostName 10.0.0.5` in ~/.ssh/config) that only ssh understands.
    `ssh -G` prints the resolved configuration without connecting."""
    try:
        result = subprocess.run(["ssh", "-G", first_host], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return first_host
    return hostname_from_ssh_config(result.stdout) or first_host


def _ere_literal(text: str) -> str:
    """`text` as a POSIX extended regex matching itself. Specials go in brackets, so the pattern
    does not match its own text either (a shell running `pkill -f PATTERN` must not match)."""
    out = []
    for char in text:
        if char in "\\^]":
            out.append("\\" + char)
        elif char in ".[$()|*+?{}":
            out.append(f"[{char}]")
        else:
            out.append(char)
    return "".join(out)


def run_process_pattern(run_dir: str | os.PathLike) -> str:
    """`pkill -f` pattern for the processes one run starts on a host (launch.py, guards, workers).

    Each names the run directory (`--run-dir`, `--enable_each_rank_log`). The runner
    (`--module labkit.rank.guard`, no `-m `), the supervisor and an unrelated DeepSpeed launch
    do not match; neither does the pattern's own text in the shell that runs pkill.
    """
    modules = "|".join(_ere_literal(m) for m in HOST_MODULES)
    return f"-m ({modules}) .*{_ere_literal(str(Path(run_dir).resolve()))}"


def remote_stop_script(run_dir: str | os.PathLike, grace_s: float = REMOTE_STOP_GRACE_S) -> str:
    """Shell for one host: SIGTERM the run's processes, wait up to `grace_s`, SIGKILL what is
    left, then list survivors (`pgrep -a`: no output means nothing of the run is left)."""
    pattern = shlex.quote(run_process_pattern(run_dir))
    polls = max(1, int(grace_s / 0.2))
    return (f"pkill -TERM -f -- {pattern}; i=0; while pgrep -f -- {pattern} >/dev/null && [ $i -lt {polls} ]; "
            f"do sleep 0.2; i=$((i+1)); done; pkill -KILL -f -- {pattern}; sleep 0.3; pgrep -a -f -- {pattern}; true")


def ssh_command(host: str, script: str) -> list[str]:
    return ["ssh", *SSH_OPTIONS, host, script]


def _on_hosts(hosts: list[str], script_for: Callable[[str], str],
              timeout: float) -> dict[str, subprocess.CompletedProcess | str]:
    """Run a script on every host at once over ssh: host -> result, or the error text."""
    def one(host: str) -> subprocess.CompletedProcess | str:
        try:
            return subprocess.run(ssh_command(host, script_for(host)), capture_output=True, text=True,
                                  timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return f"ssh {host} did not answer within {timeout:g} s"
        except OSError as exc:
            return f"cannot run ssh: {exc}"
    with ThreadPoolExecutor(max_workers=min(32, max(1, len(hosts)))) as pool:
        return dict(zip(hosts, pool.map(one, hosts), strict=True))


def check_shared_run_dir(run_dir: str | os.PathLike, hosts: list[str], timeout: float = 30.0) -> None:
    """Refuse (ConfigError) unless every host sees `run_dir`: remote ranks read config.json from
    it and write their records into it. Writes a nonce file here and asks each host for it."""
    run_dir = Path(run_dir).resolve()
    nonce = run_dir / f".labkit-shared-check-{secrets.token_hex(8)}"
    nonce.write_text("labkit multi-node check: every node must see this file\n")
    try:
        results = _on_hosts(hosts, lambda _host: f"test -f {shlex.quote(str(nonce))}", timeout)
    finally:
        nonce.unlink(missing_ok=True)
    problems = []
    for host, result in results.items():
        if isinstance(result, str):
            problems.append(f"{host}: {result}")
        elif result.returncode == 255:
            problems.append(f"{host}: ssh failed: {result.stderr.strip() or 'exit 255'}")
        elif result.returncode != 0:
            problems.append(f"{host}: does not see {nonce.name} written there (not a shared filesystem)")
    if problems:
        raise ConfigError("hostfile", f"the run directory {run_dir} is not visible on every node; multi-node "
                          f"runs need it on a filesystem all nodes share, at the same path (pass --out / "
                          f"LABKIT_RUNS_DIR on a shared mount): " + "; ".join(problems))


def stop_remote(run_dir: str | os.PathLike, hosts: list[str], grace_s: float = REMOTE_STOP_GRACE_S,
                timeout: float = REMOTE_STOP_TIMEOUT_S) -> dict[str, str]:
    """End this run's processes on every host; host -> what is still running or why it could not
    be checked (empty: verified gone)."""
    results = _on_hosts(hosts, lambda _host: remote_stop_script(run_dir, grace_s), timeout)
    left = {}
    for host, result in results.items():
        if isinstance(result, str):
            left[host] = result
        elif result.returncode == 255:
            left[host] = f"ssh failed: {result.stderr.strip() or 'exit 255'}"
        elif result.stdout.strip():
            left[host] = "still running: " + "; ".join(result.stdout.strip().splitlines())
    return left


_PDSH_EXIT = re.compile(r"^pdsh@\S+: (\S+): ssh exited with exit code (\d+)", re.MULTILINE)


def pdsh_failed_hosts(launcher_log: str) -> dict[str, int]:
    """Host -> exit code of each node whose remote command pdsh saw fail (`pdsh@me: node2: ssh
    exited with exit code 255`): 255 is ssh itself (connection lost, node down)."""
    return {host: int(code) for host, code in _PDSH_EXIT.findall(launcher_log)}

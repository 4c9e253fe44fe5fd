"""Build the launch command of a run: a pure function, so it can be tested and exported.

The command is DeepSpeed's own launcher (`python -m deepspeed.launcher.runner`, what the
`deepspeed` script runs), one rank per GPU or CPU rank, each rank being
`labkit.rank.guard` -> `labkit.rank.worker`. Single-node runs bind to 127.0.0.1 only.
"""

from __future__ import annotations

import os
import random
import shlex
import socket
import sys
from collections.abc import Mapping
from pathlib import Path

from labkit.core.config import RunConfig, hostfile_slots
from labkit.runtime.ops import DEFAULT_EXTENSIONS_DIR, interpreter_path

# Where DeepSpeed's JIT-built ops (cpu_adam, fused_adam, shm_comm) are cached; CI builds
# them once, early, and every later run reuses them.


SINGLE_NODE_HOSTFILE = os.devnull


def is_multi_node(argv: list[str]) -> bool:
    """Whether a launch command (build_command's argv) reaches other hosts through a hostfile."""
    return "--hostfile" in argv and argv[argv.index("--hostfile") + 1] != SINGLE_NODE_HOSTFILE


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now, outside the kernel's ephemeral range.

    Rank 0 binds it seconds (or, with JIT op builds, minutes) later. A port the kernel hands
    out for outgoing connections (gloo's, NCCL's, another run's) could be taken by then, so
    pick from below that range, where only explicit binds land. `device_lease.take_port`
    also keeps other labkit runs off it for the run's lifetime.
    """
    low, high = _ephemeral_range()
    candidates = range(20000, low) if low - 20000 >= 1000 else range(high + 1, 65536)
    for _ in range(200):
        port = random.choice(candidates) if len(candidates) >= 1000 else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise RuntimeError(f"no free port on {host}")


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def build_command(config: RunConfig, run_dir: str | os.PathLike, *, master_port: int,
                  base_env: Mapping[str, str] | None = None, cpu_count: int | None = None,
                  accelerator: str | None = None, device_ids: list[str] | None = None,
                  visible_devices_env: str = "CUDA_VISIBLE_DEVICES",
                  master_addr: str | None = None) -> tuple[list[str], dict[str, str]]:
    """(argv, env) that launch `config` writing into `run_dir`. Pure: no process, no I/O, except
    that a multi-node run without `master_addr` asks `ssh -G` what its first host's name resolves to.

    `accelerator` ("cpu", "cuda", ...) pins DeepSpeed's choice in the ranks; None lets
    DeepSpeed detect it. `cpu_count` splits cores between CPU ranks. `device_ids` (GPU runs on
    one node) are the devices the run leased: the ranks get exactly those.
    """
    run_dir = Path(run_dir).resolve()
    env = dict(os.environ if base_env is None else base_env)
    argv = [sys.executable, "-u", "-m", "deepspeed.launcher.runner"]
    if config.hostfile:
        # Multi-node: DeepSpeed's launcher reaches the other hosts (pdsh by default) and
        # starts one rank per slot; node 0 is the rendezvous point.
        # The hostfile names ssh hosts; the ranks need an address (labkit.launch.multinode.master_addr).
        if master_addr is None:
            from labkit.launch.multinode import master_addr as resolve

            master_addr = resolve(next(iter(hostfile_slots(config.hostfile))))
        argv += ["--hostfile", str(Path(config.hostfile).resolve()), "--master_addr", master_addr]
    elif device_ids is not None:
        # Not --num_gpus: with it DeepSpeed's runner drops CUDA_VISIBLE_DEVICES and takes devices
        # 0..N-1, not the ones leased. Given the visible devices and no count, it includes
        # exactly those (runner.py, 0.19.8) and hands rank i the i-th.
        if len(device_ids) != config.world_size:
            raise ValueError(f"{len(device_ids)} device ids for {config.world_size} ranks")
        env[visible_devices_env] = ",".join(device_ids)
        argv += ["--master_addr", "127.0.0.1"]
    else:
        argv += ["--num_gpus", str(config.world_size), "--master_addr", "127.0.0.1"]
    if not config.hostfile:
        # An explicit "no hostfile": without --hostfile DeepSpeed reads /job/hostfile, and on clusters
        # where that exists a single-node run became a pdsh multi-node launch past the device lease.
        # os.devnull is not a regular file, so the runner takes its local-resources path.
        argv += ["--hostfile", SINGLE_NODE_HOSTFILE]
    argv += ["--master_port", str(master_port), "--module", "labkit.rank.guard", "--run-dir", str(run_dir)]
    if config.script:  # script mode (labkit.rank.script): the guard runs the learner's script
        argv += ["--script", str(Path(config.script).resolve()), *config.script_args]

    env["PYTHONUNBUFFERED"] = "1"
    env["PATH"] = interpreter_path(env.get("PATH"))  # the ninja that built the op cache
    if not config.hostfile:
        # Single node: gloo's and NCCL's sockets on loopback only, nothing listens beyond this
        # machine (NCCL's bootstrap skips `lo` unless told). Set, not defaulted: an inherited
        # eth0 would open the run to the network.
        env["GLOO_SOCKET_IFNAME"] = "lo"
        env["NCCL_SOCKET_IFNAME"] = "lo"
    env.update(import_time_env(env, accelerator))
    # Every rank its share of the node's cores, GPU ranks too: unset, each of 8 GPU ranks runs torch's
    # intra-op pool and, under ZeRO-Offload, DeepSpeed's OpenMP CPU Adam on every core (8x oversubscribed).
    # The same figure DeepSpeed's own --bind_cores_to_rank sets (launcher/launch.py:219-221, 0.19.8) without
    # its numactl binding, which needs the numactl package (utils/numa.py:43-106) that containers often lack.
    env["OMP_NUM_THREADS"] = str(threads_per_rank(config, cpu_count))
    if accelerator == "cuda":
        # The list `make ops` built with (labkit.runtime.ops): the ranks' JIT loads then find that build.
        from labkit.runtime.ops import deepspeed_arch_list

        arch_list, note = deepspeed_arch_list(env.get("TORCH_CUDA_ARCH_LIST"))
        if note:
            env["TORCH_CUDA_ARCH_LIST"] = arch_list or ""
    return argv, env


def import_time_env(base_env: Mapping[str, str], accelerator: str | None) -> dict[str, str]:
    """What a run's environment sets that its ranks' imports fix (labkit.launch.zygote.IMPORT_TIME_KEYS): the
    op cache, DeepSpeed's accelerator, and this checkout first on the path (ranks must import this checkout of
    labkit even when it is not installed)."""
    package_root = str(Path(__file__).resolve().parents[2])
    env = {"TORCH_EXTENSIONS_DIR": base_env.get("TORCH_EXTENSIONS_DIR") or str(DEFAULT_EXTENSIONS_DIR),
           "PYTHONPATH": os.pathsep.join(p for p in (package_root, base_env.get("PYTHONPATH", "")) if p)}
    if accelerator:
        env["DS_ACCELERATOR"] = accelerator
    return env


def threads_per_rank(config: RunConfig, cpu_count: int | None = None) -> int:
    """OpenMP threads of each rank: the config's `threads_per_rank`, else the cores this process may use split
    evenly between the ranks of a node (at least 1). Multi-node: the busiest node's ranks share its cores."""
    if config.threads_per_rank is not None:
        return config.threads_per_rank
    ranks_here = max(hostfile_slots(config.hostfile).values()) if config.hostfile else config.world_size
    return max(1, (cpu_count or usable_cores()) // ranks_here)


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask: a container's or a job's share), else the machine's."""
    try:
        return len(os.sched_getaffinity(0)) or os.cpu_count() or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def command_text(argv: list[str], env: Mapping[str, str], base_env: Mapping[str, str] | None = None) -> str:
    """A copy-pasteable shell line: the variables labkit set, then the command."""
    base = os.environ if base_env is None else base_env
    changed = {k: v for k, v in env.items() if base.get(k) != v}
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(changed.items()))
    return (prefix + " " if prefix else "") + shlex.join(argv)

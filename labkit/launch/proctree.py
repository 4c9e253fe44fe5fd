"""A run's processes on this host: which they are, whether one is alive, and ending them.

One run is a supervisor (`labkit.launch.supervisor`), a launcher (DeepSpeed's runner and launch.py, or the warm and
spawned launches' forked launcher) in a process group of its own, and one guard and worker per rank (or one forked
worker).
They are found three ways, each for a reason:

- the supervisor's descendants (`descendants`): it is the subreaper of its tree, so orphaned ranks stay in it;
- the launcher's process group (`group`): a rank whose parent died and was reparented elsewhere is still in it;
- the command line (`launched_for`, `naming`): every launcher and rank process names the run directory
  (`--run-dir`, `--enable_each_rank_log`), and a warm rank takes a cold one's command line as its title, so a
  run whose supervisor died before it wrote status.json (which names the group) is still found.

`terminate` ends a set found so: SIGTERM, a grace for the ranks to exit (their guards record how), then SIGKILL,
finding again after each signal (a process forked meanwhile escapes the first look).
"""

from __future__ import annotations

import itertools
import os
import select
import signal
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import psutil

from labkit.launch.warm_launch import WARM_LAUNCH_TITLE

RANK_MODULES = ("labkit.rank.guard", "labkit.rank.worker")
# What a run starts on every host it runs on (labkit.launch.multinode ends these over ssh on the others).
HOST_MODULES = ("deepspeed.launcher.launch", *RANK_MODULES)
# Every launcher and rank process of a run on the launching host (not the supervisor, not a CLI waiting on it).
RUN_MODULES = (WARM_LAUNCH_TITLE, "deepspeed.launcher.runner", *HOST_MODULES)
POLL_S = 0.05
KILL_ROUNDS = 5  # SIGKILL, look again: a process forked while the last look ran is found by the next


def alive(proc: psutil.Process) -> bool:
    """Running and not a zombie (a zombie has ended; only its exit status waits to be collected)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def arguments(cmdline: Iterable[str]) -> list[str]:
    """A process's arguments from psutil's `cmdline()`. A title set by setproctitle (a forked launcher or rank) over a
    longer command line reads back as that title, spaces and all, in one argument followed by empty ones: split."""
    args = [a for a in cmdline if a]
    return args[0].split(" ") if len(args) == 1 else args


def is_rank(proc: psutil.Process) -> bool:
    """A rank's guard or worker: the module run (`-m labkit.rank.worker`), not an argument (the launchers
    carry `--module labkit.rank.guard`)."""
    try:
        cmdline = arguments(proc.cmdline())
    except psutil.Error:
        return False
    return any(a == "-m" and b in RANK_MODULES for a, b in itertools.pairwise(cmdline))


def launched_for(cmdline: list[str], run_dir: str | os.PathLike) -> bool:
    """A launcher or rank process of the run in `run_dir` by its command line (not, say, a CLI that waits on
    it with --out): one of RUN_MODULES, with an argument that is the run directory or a path inside it."""
    cmdline = arguments(cmdline)
    if not any(module in cmdline for module in RUN_MODULES):
        return False
    roots = {str(run_dir), str(Path(run_dir).resolve())}
    for arg in cmdline:
        value = arg.split("=", 1)[-1]
        if any(value == root or value.startswith(root + os.sep) for root in roots):
            return True
    return False


def run_processes(run_dir: str | os.PathLike) -> list[psutil.Process]:
    """The launcher and rank processes of the run in `run_dir` alive now, by their command lines."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if launched_for(proc.info["cmdline"] or [], run_dir) and alive(proc):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def naming(run_dir: str | os.PathLike) -> list[psutil.Process]:
    """Every live process whose command line names `run_dir` anywhere (the supervisor included): the wide
    net the tests and benchmarks use to prove nothing of a run is left."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and str(run_dir) in " ".join(proc.info["cmdline"] or []):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def supervisor_alive(pid: int, run_dir: str | os.PathLike) -> bool:
    """Whether `pid` is a live supervisor of the run in `run_dir` (a reused PID is not: it must supervise
    that directory), or a process this user may not inspect, which is not ours to declare dead."""
    try:  # hidepid hides other users' /proc entries, not their PIDs from kill(0)
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        proc = psutil.Process(pid)
        cmdline = proc.cmdline()
        return (proc.status() != psutil.STATUS_ZOMBIE and "labkit.launch.supervisor" in cmdline
                and any(Path(proc.cwd(), arg).resolve() == Path(run_dir).resolve() for arg in cmdline[1:]))
    except psutil.AccessDenied:
        return True
    except (psutil.Error, OSError):
        return False


def descendants(pid: int, *, itself: bool = True) -> list[psutil.Process]:
    """`pid` (with `itself`) and every process below it; empty when it is gone."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)] if itself else root.children(recursive=True)
    except psutil.Error:
        return []


def group(pgid: int) -> list[psutil.Process]:
    """The processes of process group `pgid`."""
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                found.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return found


def is_run_group(pgid: int, run_dir: str | os.PathLike) -> bool:
    """Whether process group `pgid` holds a launcher or rank process of the run in `run_dir`: a group id read
    from a file that may be days old may belong to someone else's processes by now."""
    for proc in group(pgid):
        try:
            if launched_for(proc.cmdline(), run_dir):
                return True
        except psutil.Error:
            continue
    return False


def tree(run_dir: str | os.PathLike, supervisor_pid: int | None) -> list[psutil.Process]:
    """The supervisor, everything below it, and every other process naming the run directory."""
    found = {proc.pid: proc for proc in descendants(supervisor_pid)} if supervisor_pid else {}
    for proc in naming(run_dir):
        found.setdefault(proc.pid, proc)
    return list(found.values())


def union(*sets: Iterable[psutil.Process]) -> list[psutil.Process]:
    """The processes of `sets`, each once."""
    found: dict[int, psutil.Process] = {}
    for procs in sets:
        for proc in procs:
            found.setdefault(proc.pid, proc)
    return list(found.values())


def terminate(find: Callable[[], list[psutil.Process]], *, grace_s: float, kill_wait_s: float,
              groups: Iterable[int] = (), wait_for: Callable[[psutil.Process], bool] = alive) -> list[psutil.Process]:
    """End what `find()` returns and the process groups `groups`: SIGTERM, up to `grace_s` for the processes
    `wait_for` picks (say, the ranks: DeepSpeed's launch.py lingers on SIGTERM until SIGKILL, 0.19.8) to exit,
    then SIGKILL to whatever is left or found since, up to `kill_wait_s` for it to go, and again while new
    ones turn up. `grace_s=0`: SIGKILL at once. Returns the processes still alive (empty: all gone)."""
    groups = list(groups)
    procs = find()
    if grace_s > 0:
        waited = {proc.pid for proc in procs if wait_for(proc)}
        _send(procs, groups, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(proc.pid in waited and alive(proc) for proc in procs):
            time.sleep(POLL_S)
    for _ in range(KILL_ROUNDS):
        procs = [proc for proc in union(procs, find()) if alive(proc)]
        if not procs:
            break
        _send(procs, groups, signal.SIGKILL)
        _, procs = psutil.wait_procs(procs, timeout=kill_wait_s)
    return [proc for proc in union(procs, find()) if alive(proc)]


def _send(procs: list[psutil.Process], groups: list[int], sig: signal.Signals) -> None:
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.Error:
            pass


class ProcessWatch:
    """Whether the process that started a run still runs. It is not always this supervisor's parent: a warm
    launch's supervisor is the zygote's child, and a zygote may serve several processes. A pidfd where Linux has
    one (exited means exited, a zombie too, and a PID reused since cannot fool it), else PID and start time."""

    def __init__(self, pid: int):
        self.pid = pid
        self._fd: int | None = None
        self._process: psutil.Process | None = None
        self._gone = False
        try:
            self._fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._gone = True
        except (AttributeError, OSError):  # not Linux 5.3+: psutil compares the start time
            try:
                self._process = psutil.Process(pid)
            except psutil.Error:
                self._gone = True

    def alive(self) -> bool:
        if self._gone:
            return False
        if self._fd is not None:
            self._gone = bool(select.select([self._fd], [], [], 0)[0])  # readable once the process exited
        elif self._process is not None:
            self._gone = not alive(self._process)
        return not self._gone

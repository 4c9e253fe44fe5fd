"""A warm launch: the ranks of a run forked from a process that has already imported torch, DeepSpeed and
the worker's modules (the zygote, `labkit.launch.zygote`), instead of DeepSpeed's runner -> launch.py ->
rank guard -> worker, four interpreters each importing torch and DeepSpeed again.

The supervisor (itself forked from the zygote) calls `ForkedLauncher`: a child in a session of its own that
plays DeepSpeed's `launch.py` (one rank per local rank, the same environment, the same per-rank log file)
and the rank guard's part (each rank's exit status in `rank<N>.exit`). Each rank is a fresh process running
`labkit.rank.worker` as `python -m` would: its own process group member, its own `init_process_group`
and `deepspeed.initialize`, its own memory from the fork on.

Only single-node CPU runs of labkit's worker go warm: forking after CUDA initialised breaks the child, and
no GPU has proven the zygote keeps none. Single-node GPU runs of labkit's worker launch "spawned": the same
launcher, forked from the supervisor (a fresh process that never touches CUDA), starts each rank as launch.py
does, a fresh interpreter running the rank guard (`spawn=True`), and so skips the runner's and launch.py's two
interpreter starts (~8 s a launch on an H100, data/reference-h100-80gb/README.md; 16.6 s against 26.3 s for a
whole 5-step run on an H200, data/reference-h200/). Script mode and multi-node keep DeepSpeed's own launcher (cold).
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

WORKER_MODULE = "labkit.rank.worker"
GUARD_MODULE = "labkit.rank.guard"  # what launch.py starts on every rank (labkit.launch.launcher.build_command)
VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"  # a spawned (GPU) run's leased devices, as build_command sets them
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}
WARM_ENV = "LABKIT_WARM"  # "0" (false, no, off): every run launches cold, through DeepSpeed's launcher (`labkit run
# --cold`); labkit.launch.run.warm_setting reads it
WARM_LAUNCH_TITLE = "labkit.launch.warm_launch"  # the forked launcher's process title, where launch.py's would be
POLL_S = 0.05


@dataclass(frozen=True, kw_only=True)
class WarmSpec:
    """What DeepSpeed's runner would hand launch.py for a single-node run (read from build_command's argv)."""
    world_size: int
    master_addr: str
    master_port: int
    worker_args: list[str]  # the rank module's arguments: --run-dir RUN_DIR

    @property
    def run_dir(self) -> Path:
        return Path(self.worker_args[self.worker_args.index("--run-dir") + 1])


def warm_spec(argv: list[str]) -> WarmSpec | None:
    """The warm launch of a launch command, None where the command must stay cold: a hostfile with hosts
    (multi-node), a script (script mode: the learner's own interpreter start is part of what it measures),
    leased devices (GPU runs: `spawn_spec`) or another launcher."""
    if "--num_gpus" not in argv:
        return None
    return _single_node_spec(argv, int(argv[argv.index("--num_gpus") + 1]))


def spawn_spec(argv: list[str], world_size: int) -> WarmSpec | None:
    """The spawned launch of a GPU run's command (its leased devices in CUDA_VISIBLE_DEVICES, no --num_gpus):
    None where it must stay cold, as `warm_spec`."""
    if "--num_gpus" in argv:
        return None
    return _single_node_spec(argv, world_size)


def _single_node_spec(argv: list[str], world_size: int) -> WarmSpec | None:
    if "--module" not in argv or "--script" in argv:
        return None
    module_at = argv.index("--module")
    if argv[module_at + 1] != GUARD_MODULE:
        return None
    from labkit.launch.launcher import is_multi_node

    if is_multi_node(argv):
        return None
    return WarmSpec(world_size=world_size, master_addr=argv[argv.index("--master_addr") + 1],
                    master_port=int(argv[argv.index("--master_port") + 1]), worker_args=argv[module_at + 2:])


def rank_env(env: dict[str, str], spec: WarmSpec, rank: int) -> dict[str, str]:
    """The environment DeepSpeed's launch.py gives local rank `rank` of a single-node run
    (deepspeed/launcher/launch.py:177-182 and 214-215, 0.19.8)."""
    return {**env, "MASTER_ADDR": spec.master_addr, "MASTER_PORT": str(spec.master_port),
            "WORLD_SIZE": str(spec.world_size), "CROSS_RANK": "0", "CROSS_SIZE": "1",
            "LOCAL_SIZE": str(spec.world_size), "RANK": str(rank), "LOCAL_RANK": str(rank)}


def rank_argv(spec: WarmSpec, rank: int, module: str = WORKER_MODULE) -> list[str]:
    """The command line a cold rank's `module` has (launch.py puts --local_rank before the script's arguments):
    the forked rank takes the worker's as its process title, so whatever finds a run's ranks by their command line
    (the supervisor, `Run`, the tests) finds warm ones alike; a spawned rank runs the guard's."""
    return [sys.executable, "-u", "-m", module, f"--local_rank={rank}", *spec.worker_args]


def spawned_env(env: dict[str, str], spec: WarmSpec, rank: int) -> dict[str, str]:
    """A spawned rank's environment: launch.py's (`rank_env`), its devices in the order DeepSpeed's runner hands
    them on (the leased ids sorted and unique: deepspeed/launcher/runner.py:289, 0.19.8), so that rank i gets the
    same GPU as on a cold launch. (The runner's PYTHONPATH prefix, runner.py:585-589, is for multi-node only.)"""
    out = rank_env(env, spec, rank)
    ids = out.get(VISIBLE_DEVICES, "").split(",")
    if all(i.strip().isdigit() for i in ids):
        out[VISIBLE_DEVICES] = ",".join(str(i) for i in sorted({int(i) for i in ids}))
    return out


def set_title(argv: list[str]) -> None:
    """Show `argv` as this process's command line (/proc/PID/cmdline), what a forked process cannot get
    otherwise: it keeps the zygote's."""
    import setproctitle

    setproctitle.setproctitle(" ".join(argv))


class ForkedLauncher:
    """The warm or spawned launch's launcher process, with the part of `subprocess.Popen` the supervisor uses.
    `spawn`: each rank a fresh interpreter running the guard (GPU runs), not a fork running the worker."""

    def __init__(self, spec: WarmSpec, env: dict[str, str], log_dir: Path, launcher_log: Path, *,
                 spawn: bool = False):
        self.args = [sys.executable, "-m", WARM_LAUNCH_TITLE, *spec.worker_args]
        self.returncode: int | None = None
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _redirect(launcher_log, append=True)
                code = _launch(spec, env, log_dir, self.args, spawn)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        self.pid = pid

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere (the supervisor's orphan reaping)
                self.returncode = -1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(POLL_S)
        assert self.returncode is not None
        return self.returncode


def _launch(spec: WarmSpec, env: dict[str, str], log_dir: Path, title: list[str], spawn: bool) -> int:
    """launch.py's part: a session of its own (the supervisor signals the group), one rank per local rank
    (forked, or `spawn`ed through the guard), each rank's exit recorded as the guard records it (a spawned
    rank's guard records its own); a failed rank ends the others, as launch.py's sigkill_handler does
    (launch.py:251-282, 0.19.8), and this exits with its code."""
    from labkit.core.files import write_json_atomic

    os.setsid()
    set_title(title)
    ranks: dict[int, int] = {}  # pid -> rank

    def forward(signum: int, _frame: object) -> None:
        for pid in ranks:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    for stop_signal in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop_signal, forward)
    log_dir.mkdir(parents=True, exist_ok=True)
    prefix = time.strftime("%Y%m%d%H%M%S", time.localtime())  # launch.py's rank log names: <prefix>_rank<N>.log
    for rank in range(spec.world_size):
        # A stop arriving between the fork and `ranks[pid]` would miss the new rank, and in the child, before its
        # handlers are reset, would be forwarded to its siblings only: held until both sides are ready.
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        pid = os.fork()
        if pid == 0:  # neither returns; each unblocks the stop signals once its own handlers are set
            log_file = log_dir / f"{prefix}_rank{rank}.log"
            if spawn:
                _spawn_rank(spec, spawned_env(env, spec, rank), rank, log_file)
            _rank(spec, rank_env(env, spec, rank), rank, log_file)
        ranks[pid] = rank
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    print(f"{'spawned' if spawn else 'forked'} ranks {sorted(ranks.values())} as pids {sorted(ranks)}", flush=True)
    code = 0
    while ranks:
        pid, status = os.wait()
        if pid not in ranks:
            continue
        rank = ranks.pop(pid)
        returncode = os.waitstatus_to_exitcode(status)
        exit_file = spec.run_dir / f"rank{rank}.exit"
        # A spawned rank's guard records its worker's exit; a guard that could not (killed, or its exec failed)
        # is recorded here, so that the supervisor names the rank.
        if not spawn or (returncode != 0 and not exit_file.exists()):
            write_json_atomic(exit_file, {"rank": rank, "pid": pid, "returncode": returncode,
                                          **({"recorded_by": "launcher"} if spawn else {})})
        if returncode != 0 and code == 0:
            code = returncode if returncode > 0 else 128 - returncode
            print(f"rank {rank} exited with {returncode}: ending the others", flush=True)
            forward(signal.SIGTERM, None)
    return code


def _rank(spec: WarmSpec, env: dict[str, str], rank: int, log_file: Path) -> None:
    """One rank: the environment and log launch.py would give it, then the worker as `python -u -m` runs it."""
    code = 1
    try:
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked by _launch around the fork
        os.environ.clear()
        os.environ.update(env)
        _redirect(log_file, append=False)
        argv = rank_argv(spec, rank)
        set_title(argv)
        import torch

        # libgomp read OMP_NUM_THREADS when the zygote loaded it: the rank's share is set here instead.
        torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or torch.get_num_threads()))
        sys.argv = [WORKER_MODULE, *argv[4:]]
        sys.path[0] = os.getcwd()  # what `python -m` puts first: the learner's modules beside the asker's notebook
        code = _run_worker(argv[4:])
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _spawn_rank(spec: WarmSpec, env: dict[str, str], rank: int, log_file: Path) -> None:
    """One rank as launch.py starts it (launch.py:223-245, 0.19.8): this forked child becomes a fresh interpreter
    running the guard, with launch.py's environment and log. The guard starts the worker and records its exit."""
    try:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked by _launch around the fork; kept by exec
        _redirect(log_file, append=False)
        argv = rank_argv(spec, rank, GUARD_MODULE)
        os.execve(argv[0], argv, env)
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(127)


def _run_worker(args: list[str]) -> int:
    """Run the worker's main and return the exit code the interpreter would have."""
    from labkit.rank.worker import main

    try:
        code = main(args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    # What interpreter exit runs: atexit handlers (DeepSpeed's and torch's), here before _exit.
    atexit._run_exitfuncs()
    return code


def _redirect(path: Path, *, append: bool) -> None:
    """stdout and stderr to `path` (line by line, as `python -u` writes), stdin from /dev/null."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    fd = os.open(path, flags, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.close(null)
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True, write_through=True)

"""The zygote: one process per Jupyter kernel, CLI command or test session that has imported torch, DeepSpeed,
the worker's modules and the supervisor, and loaded the built CPU ops, so that a run starts without paying for them.

    python -m labkit.launch.zygote --socket PATH --parent-pid PID     (started by `Zygote.start`)

`Run.start` asks it (a Unix socket, the run's lease descriptors passed along) to fork the run's supervisor;
the supervisor forks the ranks (`labkit.launch.warm_launch`). Every run still gets fresh rank processes, a
fresh process group and a fresh `deepspeed.initialize`: only the imports are shared, copy-on-write. The zygote
touches no device (CPU runs only) and starts no thread, so forking it is safe. It ends when the process that
started it does (checked every second), and its supervisors, whose parent it is, then end their runs.

A process that started one can lend it to its children (`share`: its socket in LABKIT_ZYGOTE): a notebook's
`!labkit run`, the test session's CLI and kernel runs then start warm too, without a preload of their own. Each
run's supervisor watches the process that asked for it, so a run still ends when that process dies.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from labkit.launch.warm_launch import set_title

# What a forked process cannot change once the zygote imported torch and DeepSpeed: a run whose environment
# differs in one of these launches cold (DeepSpeed picked its accelerator and op cache at import).
IMPORT_TIME_KEYS = ("DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR", "PYTHONPATH")
READY_TIMEOUT_S = 120.0  # a first import of torch and DeepSpeed on a loaded laptop; CPU ops are built by `make ops`
ACCEPT_S = 1.0  # how often the zygote checks that the process that started it is alive
# The CPU ops CPU runs load (Adam on CPU ranks is DeepSpeed's CPU FusedAdam; ZeRO-Offload's is CPU Adam), when built.
PRELOADED_OPS = ("FusedAdamBuilder", "CPUAdamBuilder", "ShareMemCommBuilder")
MESSAGE_MAX = 1 << 20
SHARED_ENV = "LABKIT_ZYGOTE"  # the socket of a zygote this process's parent lends it (`share`)


def import_env(env: dict[str, str]) -> dict[str, str | None]:
    """The part of `env` fixed at the zygote's import, PYTHONPATH without repeats (a child's launch prepends the
    checkout again to a PYTHONPATH that already starts with it: the same modules are found)."""
    out: dict[str, str | None] = {key: env.get(key) for key in IMPORT_TIME_KEYS}
    if out["PYTHONPATH"] is not None:
        out["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in out["PYTHONPATH"].split(os.pathsep) if p))
    return out


class ZygoteUnavailable(RuntimeError):
    """The zygote could not fork this run: it launches cold, and says why."""


# -- the zygote process -----------------------------------------------------------------------------------
def preload() -> list[str]:
    """Import what every rank and supervisor imports, and load the CPU ops already built; returns the ops."""
    import deepspeed
    import setproctitle

    # Its first call finds the memory of argv and environ; the forked processes replace their environment
    # before they take their titles, and a later first call would then find nothing to write into.
    setproctitle.setproctitle(setproctitle.getproctitle())
    # Two imports every rank would otherwise make lazily, 0.6-1.1 s each here (neither starts a thread):
    # - DeepSpeed's Muon, imported by every ZeRO engine's optimizer check, compiles its kernels at import
    #   (deepspeed/runtime/zero/utils.py:69-72, 0.19.8);
    # - torch._dynamo, imported by the first optimizer's __init__, which torch._compile._disable_dynamo wraps
    #   (torch/_compile.py:45-50, torch 2.13).
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    import torch
    import torch._dynamo  # noqa: F401
    from deepspeed.accelerator import get_accelerator

    import labkit.launch.summary
    import labkit.launch.supervisor
    import labkit.rank.worker  # noqa: F401

    loaded = []
    extensions = Path(os.environ.get("TORCH_EXTENSIONS_DIR", ""))
    for name in PRELOADED_OPS:
        builder = get_accelerator().create_op_builder(name)
        built = builder is not None and (extensions / builder.name / f"{builder.name}.so").exists()
        # Never a build, never a wait here: only what `make ops` (or an earlier run) built and nobody is building
        # (a lock, even a stale one, is the run's supervisor's to clear: labkit.runtime.build_locks).
        if built and not (extensions / builder.name / "lock").exists():
            builder.load(verbose=False)
            loaded.append(builder.name)
    return loaded


def serve(socket_path: Path, parent_pid: int) -> int:
    started = time.monotonic()
    ops = preload()
    # What the preload made lives as long as the zygote: out of the collector's reach, so that a fork's
    # gc.collect (deepspeed/runtime/zero/utils.py:233, in `defragment`: every ZeRO-3 engine whose parameters stay on
    # the device, stage3.py:967-972) neither walks it (0.17 s per rank here) nor writes its pages, which stay shared
    # with every rank.
    gc.collect()
    gc.freeze()
    from labkit.launch.supervisor import reap_children

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(socket_path))
    listener.listen(16)
    listener.settimeout(ACCEPT_S)
    print(json.dumps({"ready": True, "pid": os.getpid(), "preload_s": round(time.monotonic() - started, 3),
                      "ops": ops}), flush=True)
    # Nobody reads the pipe once ready: what the zygote says later goes to a file beside its socket.
    from labkit.launch.warm_launch import _redirect

    _redirect(socket_path.with_name("zygote.log"), append=True)
    while os.getppid() == parent_pid:
        reap_children()
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        with conn:
            conn.settimeout(None)
            try:
                message, fds, _, _ = socket.recv_fds(conn, MESSAGE_MAX, 16)
            except OSError:
                continue
            try:
                reply = _answer(json.loads(message), fds, listener, conn)
            except Exception as exc:  # a bad request must not end the zygote
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            finally:
                for fd in fds:
                    os.close(fd)
            try:
                conn.send(json.dumps(reply).encode())
            except OSError:
                pass
    return 0


def _answer(request: dict, fds: list[int], listener: socket.socket, conn: socket.socket) -> dict:
    if request.get("op") == "ping":
        return {"pid": os.getpid(), "env": import_env(dict(os.environ))}
    if request.get("op") != "supervise":
        raise ValueError(f"unknown request {request.get('op')!r}")
    env = request["env"]
    mine, theirs = import_env(dict(os.environ)), import_env(env)
    differs = [key for key in IMPORT_TIME_KEYS if mine[key] != theirs[key]]
    if differs:
        return {"error": f"the run's {', '.join(differs)} differ from the zygote's (fixed at its import)"}
    pid = os.fork()
    if pid == 0:
        listener.close()
        conn.close()
        _supervise(Path(request["run_dir"]), env, fds, request["parent_pid"], request["cwd"])  # never returns
    return {"pid": pid}


def _supervise(run_dir: Path, env: dict[str, str], lease_fds: list[int], parent_pid: int, cwd: str) -> None:
    """The forked supervisor: as `python -m labkit.launch.supervisor RUN_DIR --parent-pid PARENT` started by the
    process that asked for the run (`parent_pid`, in its working directory `cwd`) would run."""
    code = 1
    try:
        for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.setsid()
        from labkit.launch.warm_launch import _redirect

        _redirect(run_dir / "supervisor.log", append=True)
        os.chdir(cwd)  # a lent zygote runs in its starter's directory, not in the asker's
        os.environ.clear()
        os.environ.update(env)
        argv = [str(run_dir), "--parent-pid", str(parent_pid), "--lease-fds", ",".join(map(str, lease_fds))]
        set_title([sys.executable, "-m", "labkit.launch.supervisor", *argv])
        from labkit.launch.supervisor import main

        code = main(argv)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


# -- the client (the kernel's, the CLI's side) --------------------------------------------------------------
class ForkedSupervisor:
    """A supervisor the zygote forked, with the part of `subprocess.Popen` that `Run` uses: it is the
    zygote's child, not ours, so it is watched by its PID and command line."""

    def __init__(self, pid: int, run_dir: Path, zygote_pid: int):
        self.pid = pid
        self.run_dir = run_dir
        self.zygote_pid = zygote_pid

    def poll(self) -> int | None:
        import psutil

        try:
            # Ours while the zygote is its parent (it takes its title a moment after the fork), or, orphaned, while
            # its title names the run.
            proc = psutil.Process(self.pid)
            alive = proc.status() != psutil.STATUS_ZOMBIE and (
                proc.ppid() == self.zygote_pid or str(self.run_dir) in " ".join(proc.cmdline()))
        except psutil.Error:
            alive = False
        return None if alive else 0  # its exit code is the zygote's to reap; summary.json says how it ended

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired([f"supervisor {self.pid}"], timeout or 0.0)
            time.sleep(0.05)
        return 0


class Zygote:
    """The client: starts the zygote (or attaches to one lent by the parent process, `attach`), asks it to fork a
    run's supervisor, ends the one it started."""

    def __init__(self, env: dict[str, str], lent_socket: Path | None = None):
        self.env = env
        self.lent = lent_socket is not None  # attached to another process's zygote: never ours to end
        self._dir = lent_socket.parent if lent_socket else Path(tempfile.mkdtemp(prefix="labkit-zygote-"))
        self.socket_path = lent_socket or self._dir / "socket"
        self.process: subprocess.Popen | None = None
        self.ready: dict | None = None
        self._lock = threading.Lock()  # a sweep's or the fault suite's threads start runs side by side

    @classmethod
    def attach(cls, socket_path: Path, env: dict[str, str]) -> Zygote:
        """The zygote listening on `socket_path`, if it answers and its import-time environment is `env`'s."""
        zygote = cls(env, lent_socket=socket_path)
        reply = zygote._ask({"op": "ping"}, [])
        if reply.get("env") != import_env(env):
            raise ZygoteUnavailable(f"the zygote at {socket_path} was started for another environment")
        zygote.ready = reply
        return zygote

    def start(self) -> Zygote:
        if self.process is None and not self.lent:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "labkit.launch.zygote", "--socket", str(self.socket_path),
                 "--parent-pid", str(os.getpid())],
                env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=True)
        return self

    def alive(self) -> bool:
        if self.lent:
            try:
                return self._ask({"op": "ping"}, []).get("pid") == (self.ready or {}).get("pid")
            except ZygoteUnavailable:
                return False
        return self.process is None or self.process.poll() is None

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> dict:
        """Block until the zygote has preloaded (its first line), or raise ZygoteUnavailable with its output."""
        with self._lock:
            if self.ready is not None:
                return self.ready
            self.start()
            assert self.process is not None and self.process.stdout is not None
            import selectors

            selector = selectors.DefaultSelector()
            selector.register(self.process.stdout, selectors.EVENT_READ)
            deadline = time.monotonic() + timeout
            output = b""
            while time.monotonic() < deadline:
                if selector.select(timeout=max(0.0, deadline - time.monotonic())):
                    line = self.process.stdout.readline()
                    output += line
                    if not line:
                        break
                    if line.startswith(b"{"):
                        self.ready = json.loads(line)
                        return self.ready
        self.close()
        tail = output.decode(errors="replace").strip().splitlines()[-3:]
        raise ZygoteUnavailable(f"the zygote did not start within {timeout:g} s: {' | '.join(tail) or 'no output'}")

    def supervise(self, run_dir: Path, env: dict[str, str], lease_fds: list[int]) -> ForkedSupervisor:
        """Fork the supervisor of the run in `run_dir` (its launch.json written) with `env` as its environment;
        it watches this process and runs in its working directory."""
        zygote_pid = self.wait_ready()["pid"]
        reply = self._ask({"op": "supervise", "run_dir": str(run_dir), "env": env, "parent_pid": os.getpid(),
                           "cwd": os.getcwd()}, lease_fds)
        if "pid" not in reply:
            raise ZygoteUnavailable(reply.get("error") or "the zygote gave no answer")
        return ForkedSupervisor(reply["pid"], run_dir, zygote_pid)

    def _ask(self, request: dict, fds: list[int]) -> dict:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
            try:
                conn.connect(str(self.socket_path))
                socket.send_fds(conn, [json.dumps(request).encode()], fds)
                return json.loads(conn.recv(MESSAGE_MAX) or b"{}")
            except (OSError, ValueError) as exc:
                raise ZygoteUnavailable(f"the zygote did not answer: {exc}") from exc

    def close(self) -> None:
        if self.lent:
            return
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
        if self.process is not None and self.process.stdout is not None:
            self.process.stdout.close()
        self.socket_path.unlink(missing_ok=True)
        self.socket_path.with_name("zygote.log").unlink(missing_ok=True)
        try:
            self._dir.rmdir()
        except OSError:
            pass


_zygotes: dict[tuple, Zygote] = {}  # by import-time environment: a test with its own op cache keeps the others
_zygotes_lock = threading.Lock()


def shared(env: dict[str, str]) -> Zygote:
    """This process's zygote for runs whose import-time environment is `env`'s: the one its parent lent
    (LABKIT_ZYGOTE) where that fits, else one started here once (ended at exit)."""
    key = tuple(import_env(env).items())
    with _zygotes_lock:
        zygote = _zygotes.get(key)
        if zygote is not None and zygote.alive():
            return zygote
        if zygote is not None:
            zygote.close()
        zygote = None
        lent = os.environ.get(SHARED_ENV)
        if lent:
            try:
                zygote = Zygote.attach(Path(lent), env)
            except ZygoteUnavailable:
                pass  # gone, or for another environment: this process starts its own
        if zygote is None:
            zygote = Zygote({k: v for k, v in env.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")})
            atexit.register(zygote.close)
        _zygotes[key] = zygote
        return zygote.start()


def share(env: dict[str, str]) -> Zygote:
    """Start (in the background) this process's zygote for `env` and lend it to the processes this one starts
    from now on (LABKIT_ZYGOTE in its environment): the panel's kernel, the CLI, the test session."""
    zygote = shared(env)
    os.environ[SHARED_ENV] = str(zygote.socket_path)
    return zygote


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="labkit's zygote: forks warm runs (see the module's docstring)")
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    return serve(args.socket, args.parent_pid)


if __name__ == "__main__":
    sys.exit(main())

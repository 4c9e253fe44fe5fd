"""Shared fixtures: real runs write into a per-test directory, and no process may outlive a test.

Markers say what a test costs: `slow` on every test that starts a process (a DeepSpeed run, a Python or
tool subprocess, a kernel, a browser), so `make test-fast` (`-m "not slow"`) starts none. The rule is
enforced: a test not marked `slow` that starts a process from the test's own thread fails. One probe is not
counted: DeepSpeed's CPU accelerator runs `numactl --hardware` on every `device_count()` where LOCAL_SIZE is unset or 0
(deepspeed/accelerator/cpu_accelerator.py:71-79 and utils/numa.py:27 in 0.19.8), a few milliseconds that any
config check pays.
"""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

# Every live process whose command line names a run directory: what a test checks is gone.
from labkit.launch.proctree import naming as run_processes  # noqa: F401

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))


NOT_COUNTED = ("numactl --hardware",)  # DeepSpeed's probe (module docstring)


@pytest.fixture(scope="session", autouse=True)
def _one_zygote_for_the_session(request: pytest.FixtureRequest):
    """Where the session starts real runs: one zygote (labkit.launch.zygote), started now in the background and
    lent to every process the tests start (the CLI's runs, the notebooks' kernels), so each warm run forks from
    it instead of each process preloading torch and DeepSpeed for itself. LABKIT_WARM=0 runs the suite cold."""
    if any(item.get_closest_marker("slow") for item in request.session.items):
        from labkit.launch.run import warm_up

        warm_up()
    yield


@pytest.fixture(autouse=True)
def _slow_if_it_starts_a_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Fails a test not marked `slow` that starts a process (subprocess, fork, posix_spawn) from its own
    thread; threads of a module's shared runs (the fault suite's fleet) are theirs to account for."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    started: list[str] = []

    def watched(real, describe):
        def call(*args, **kwargs):
            what = describe(args)
            if threading.current_thread() is threading.main_thread() and not what.startswith(NOT_COUNTED):
                started.append(what)
            return real(*args, **kwargs)
        return call

    execute_child = subprocess.Popen._execute_child  # type: ignore[attr-defined]
    monkeypatch.setattr(subprocess.Popen, "_execute_child",
                        watched(execute_child, lambda args: " ".join(map(str, args[1] if isinstance(
                            args[1], (list, tuple)) else [args[1]]))[:200]))
    monkeypatch.setattr(os, "fork", watched(os.fork, lambda args: "os.fork()"))
    monkeypatch.setattr(os, "posix_spawn", watched(os.posix_spawn, lambda args: f"os.posix_spawn({args[0]})"))
    yield
    if started:
        pytest.fail(f"starts a process but is not marked slow: {started[0]!r}"
                    + (f" and {len(started) - 1} more" if len(started) > 1 else ""), pytrace=False)


def run_together(commands: dict[str, dict[str, Any]], timeout: float) -> dict[str, subprocess.CompletedProcess]:
    """Starts every command at once ({name: Popen keyword arguments: args, cwd, env}), then awaits each:
    runs that several tests read cost the slowest of them, not their sum."""
    started = {name: subprocess.Popen(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
               for name, kwargs in commands.items()}
    done = {}
    try:
        for name, process in started.items():
            stdout, stderr = process.communicate(timeout=timeout)
            done[name] = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    finally:  # one that timed out ends them all
        for process in started.values():
            process.kill()
    return done


@pytest.fixture
def runs_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "runs"
    monkeypatch.setenv("LABKIT_RUNS_DIR", str(root))
    return root


class RankFileReads:
    """Bytes read from rank files (`rank<N>.jsonl`), one entry per read() call, through `open`,
    `io.open` or `Path.read_bytes/read_text` (which call io.open); none while `paused`."""

    def __init__(self) -> None:
        self.reads: list[int] = []
        self.paused = False


@pytest.fixture
def rank_file_reads(monkeypatch: pytest.MonkeyPatch) -> RankFileReads:
    import builtins
    import io
    import re

    counter = RankFileReads()
    real_open = io.open

    class CountingFile:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def __getattr__(self, name):
            return getattr(self.handle, name)

        def read(self, *args):
            data = self.handle.read(*args)
            if not counter.paused:
                counter.reads.append(len(data))
            return data

    def counting_open(file, mode="r", *args, **kwargs):
        handle = real_open(file, mode, *args, **kwargs)
        is_rank_file = isinstance(file, (str, os.PathLike)) and re.fullmatch(r"rank\d+\.jsonl", Path(file).name)
        return CountingFile(handle) if is_rank_file and "r" in mode else handle

    monkeypatch.setattr(builtins, "open", counting_open)
    monkeypatch.setattr(io, "open", counting_open)
    return counter


@pytest.fixture
def one_gloo_rank(monkeypatch: pytest.MonkeyPatch):
    """A one-rank process group in this process, joined as the worker joins it (labkit.rank.rendezvous)."""
    from datetime import timedelta

    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from labkit.launch.launcher import free_port
    from labkit.rank.rendezvous import init_distributed
    from labkit.runtime.ops import interpreter_path

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "LOCAL_SIZE": "1", "GLOO_SOCKET_IFNAME": "lo"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # This interpreter's ninja first, as the launcher does: DeepSpeed loads its ops (shm comm, Adam) with a JIT build.
    monkeypatch.setenv("PATH", interpreter_path(os.environ.get("PATH")))
    init_distributed(get_accelerator().communication_backend_name(), timedelta(seconds=60))
    yield
    deepspeed.comm.destroy_process_group()

"""labkit.launch.proctree: a run's processes found by command line, group and tree, and ended."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from labkit.launch import proctree

RUN = "/runs/zero3-z3-w2-b64"


@pytest.mark.parametrize(("cmdline", "ours"), [
    (["python", "-u", "-m", "deepspeed.launcher.launch", "--enable_each_rank_log=" + RUN + "/logs"], True),
    (["python", "-u", "-m", "labkit.rank.worker", "--local_rank=0", "--run-dir", RUN], True),
    (["python", "-m", "labkit.launch.warm_launch", "--run-dir", RUN], True),  # a warm launch's launcher
    (["python", "-m", "labkit", "run", "--out", RUN], False),  # a CLI waiting on it: not the run's
    (["python", "-u", "-m", "labkit.rank.worker", "--run-dir", RUN + "-other"], False),  # a sibling run
    (["python", "-m", "labkit.launch.supervisor", RUN], False),  # the supervisor is found by its PID
])
def test_a_run_process_is_a_launcher_or_rank_naming_the_run_directory(cmdline, ours):
    assert proctree.launched_for(cmdline, RUN) is ours


# A parent ignoring SIGTERM (as DeepSpeed's launch.py does) with a child that exits on it (a rank).
_STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "--run-dir", sys.argv[1]],
                         preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))  # not inherited ignored
print(child.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_terminate_gives_the_grace_then_kills_and_finds_what_appeared(tmp_path: Path):
    run_dir = tmp_path / "run"
    parent = subprocess.Popen([sys.executable, "-c", _STUBBORN, str(run_dir)], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        child_pid = int(parent.stdout.readline())
        found = {p.pid for p in proctree.naming(run_dir)}
        assert found == {parent.pid, child_pid}  # both name the run directory
        assert {p.pid for p in proctree.group(parent.pid)} == {parent.pid, child_pid}
        assert {p.pid for p in proctree.descendants(parent.pid)} == {parent.pid, child_pid}
        left = proctree.terminate(lambda: proctree.descendants(parent.pid), grace_s=30.0, kill_wait_s=5.0,
                                  groups=[parent.pid], wait_for=lambda p: p.pid == child_pid)
        # The child exits on SIGTERM; the parent, which ignores it, is SIGKILLed.
        assert left == []
        assert proctree.naming(run_dir) == [] and proctree.descendants(parent.pid) == []
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()

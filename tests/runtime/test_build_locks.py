"""A build lock left by an interrupted op build is found and named, cleared when no build
holds it; a run waiting on a build says so. Real lock files, a real holder process (torch's FileBaton)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from labkit.runtime.build_locks import find_build_locks, report_stale_locks


@pytest.mark.slow
def test_stale_lock_is_named_and_cleared_but_a_held_one_is_left(tmp_path, capsys):
    (tmp_path / "deepspeed_shm_comm").mkdir()
    stale = tmp_path / "deepspeed_shm_comm" / "lock"
    stale.touch()  # what a build killed by Ctrl-C leaves
    (tmp_path / "fused_adam").mkdir()
    held = tmp_path / "fused_adam" / "lock"
    # A build in progress: torch's own baton, held by another process.
    builder = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                                "from torch.utils.file_baton import FileBaton\n"
                                f"assert FileBaton({str(held)!r}).try_acquire()\n"
                                "print('held', flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        assert builder.stdout.readline().strip() == "held"
        locks = {lock.op: lock for lock in find_build_locks(tmp_path)}
        assert locks["deepspeed_shm_comm"].stale and "stale build lock" in locks["deepspeed_shm_comm"].describe()
        assert locks["fused_adam"].holder_pids == (builder.pid,) and not locks["fused_adam"].stale
        assert "building op fused_adam" in locks["fused_adam"].describe()
        report_stale_locks(tmp_path, clear=True)
        assert not stale.exists() and held.exists()  # a live build's lock is never removed
        assert "removed a stale build lock" in capsys.readouterr().out
    finally:
        builder.kill()
        builder.wait()


def test_the_sweeper_removes_a_lock_only_once_it_stayed_stale(tmp_path):
    """torch's FileBaton.release closes the lock, then removes it: one look can catch a finished build in
    between. A lock is removed only when it looked stale on two polls STALE_CONFIRM_S apart."""
    from labkit.runtime.build_locks import StaleLockSweeper

    (tmp_path / "cpu_adam").mkdir()
    lock = tmp_path / "cpu_adam" / "lock"
    lock.touch()
    sweeper = StaleLockSweeper(tmp_path, confirm_s=2.0)
    assert sweeper.poll(now=100.0) == [] and lock.exists()  # seen stale once: left
    assert sweeper.poll(now=101.0) == [] and lock.exists()
    (removed,) = sweeper.poll(now=102.5)
    assert removed.op == "cpu_adam" and not lock.exists()
    lock.touch()  # a new lock: its own confirmation
    assert sweeper.poll(now=103.0) == [] and lock.exists()


@pytest.mark.slow
def test_a_run_behind_a_stale_build_lock_removes_it_and_says_so(tmp_path, runs_root, monkeypatch):
    """A run named the stale lock in its progress line and then waited for ever. Its
    supervisor now removes a lock no process holds, with a line in supervisor.log, and the run trains."""
    from labkit import Run, RunConfig

    lock = _shm_comm_lock_in_a_copy_of_the_op_cache(tmp_path, monkeypatch)
    lock.touch()
    run = Run(RunConfig(example="zero3", world_size=2, micro_batch=8, hidden=32, steps=2, dataset_size=256,
                        startup_timeout_s=240)).start()
    try:
        assert run.wait(timeout=300) == "finished", run.cause
        log = (run.run_dir / "supervisor.log").read_text()
        assert f"removed a stale build lock {lock}" in log and "deepspeed_shm_comm" in log
        assert not lock.exists()
    finally:
        run.stop()


@pytest.mark.slow
def test_a_run_waiting_on_a_live_build_is_not_hung(tmp_path, runs_root, monkeypatch):
    """CI's offline-install proof was reported hung at its 900 s startup allowance while its ranks waited on a
    niced op build on a busy machine (and the kill left the lock stale). Time in which a live process holds the
    lock is a build in progress: the run waits it out. Here the build (torch's FileBaton in another process)
    holds the lock 1.5x the allowance, so a supervisor that counted it would report the run hung."""
    from labkit import Run, RunConfig

    lock = _shm_comm_lock_in_a_copy_of_the_op_cache(tmp_path, monkeypatch)
    allowance_s, build_s = 20.0, 30.0
    builder = subprocess.Popen([sys.executable, "-c", "import time\n"
                                "from torch.utils.file_baton import FileBaton\n"
                                f"baton = FileBaton({str(lock)!r})\n"
                                "assert baton.try_acquire()\n"
                                f"print('held', flush=True); time.sleep({build_s}); baton.release()"],
                               stdout=subprocess.PIPE, text=True)
    assert builder.stdout.readline().strip() == "held"
    run = Run(RunConfig(example="zero3", world_size=2, micro_batch=8, hidden=32, steps=2, dataset_size=256,
                        startup_timeout_s=allowance_s)).start()
    try:
        assert run.wait(timeout=300) == "finished", run.cause
        assert builder.wait(timeout=10) == 0  # the build ended on its own, holding the lock all along
        log = (run.run_dir / "supervisor.log").read_text()
        assert f"waiting on a build: DeepSpeed is building op deepspeed_shm_comm (process {builder.pid}" in log
        assert "removed a stale build lock" not in log
    finally:
        run.stop()
        builder.kill()
        builder.wait()


def _shm_comm_lock_in_a_copy_of_the_op_cache(tmp_path, monkeypatch):
    """The path of deepspeed_shm_comm's build lock in a copy of the built op cache, which this test's runs use: the
    ops already built, only a lock there stands in the way (and no other test's runs wait on it)."""
    import os
    import shutil

    from tests.conftest import REPO

    source = os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    extensions = tmp_path / "torch_extensions"
    shutil.copytree(source, extensions)
    (extensions / "deepspeed_shm_comm").mkdir(exist_ok=True)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))
    return extensions / "deepspeed_shm_comm" / "lock"

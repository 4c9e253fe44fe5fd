"""Issue 11 item 14: a build lock left by an interrupted op build is found and named, cleared when no build
holds it; a run waiting on a build says so. Real lock files, a real holder process (torch's FileBaton)."""

from __future__ import annotations

import subprocess
import sys

from labkit.runtime.build_locks import find_build_locks, report_stale_locks


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


def test_a_run_stuck_behind_a_stale_build_lock_says_so(tmp_path, runs_root, monkeypatch):
    import os
    import shutil
    import time

    from labkit import Run, RunConfig
    from tests.conftest import REPO

    source = os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    extensions = tmp_path / "torch_extensions"
    shutil.copytree(source, extensions)  # the ops already built: only the lock stands in the way
    (extensions / "deepspeed_shm_comm").mkdir(exist_ok=True)
    (extensions / "deepspeed_shm_comm" / "lock").touch()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))
    run = Run(RunConfig(example="zero3", world_size=2, micro_batch=8, hidden=32, steps=2, dataset_size=256)).start()
    try:
        deadline = time.monotonic() + 120
        while run.waiting_on is None and time.monotonic() < deadline and not run.done:
            time.sleep(0.5)
        assert run.waiting_on and "stale build lock" in run.waiting_on and "deepspeed_shm_comm" in run.waiting_on
        # What the CLI's progress bar and the panel's status line show for it.
        from labkit.launch.phase import run_phase
        from labkit.live.panel import status_line

        assert run_phase({"start"}, 0, 2, "", run.waiting_on).startswith("waiting: stale build lock")
        assert "waiting: stale build lock" in status_line("running", step=0, steps=2, waiting_on=run.waiting_on)
    finally:
        run.stop()

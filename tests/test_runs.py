"""Real DeepSpeed runs on 2 CPU ranks: the three examples, ZeRO's memory effect, failures, Stop."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from labkit import Run, RunConfig, load_run, runs
from labkit.core.records import rank_file, read_records
from tests.conftest import REPO, run_processes

SMALL = dict(hidden=512, depth=2, micro_batch=32, dataset_size=2048)


@pytest.mark.parametrize("example,extra", [
    ("pytorch", []),
    ("offload", ["--world-size", "2"]),
    ("deepspeed", ["--world-size", "2", "--stage", "1"]),
    ("zero3", ["--world-size", "2", "--grad-accum", "2"]),
])
def test_cli_runs_each_example(example, extra, tmp_path):
    out = tmp_path / example
    result = subprocess.run(
        [sys.executable, "-m", "labkit", "run", "--example", example, "--micro-batch", "32", "--steps", "6",
         "--out", str(out), *extra], cwd=REPO, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps_completed"] == 6
    for name in ("config.json", "ds_config.json", "command.txt", "launcher.log"):
        assert (out / name).is_file(), name
    world_size = summary["world_size"]
    for rank in range(world_size):
        records = read_records(rank_file(out, rank))
        steps = [r for r in records if r["event"] == "step"]
        assert [r["step"] for r in steps] == list(range(1, 7))
        assert records[-1]["event"] == "done"
        for key in ("time_s", "step_time_s", "samples_per_s", "loss", "lr", "rss_bytes", "param_bytes",
                    "grad_bytes", "optim_bytes", "forward_s", "backward_s", "optimizer_s"):
            assert key in steps[-1], key
    assert summary["samples_per_s"] > 0 and summary["achieved_flops"] > 0


@pytest.fixture(scope="session")
def stage_runs(tmp_path_factory) -> dict[int, dict]:
    """ZeRO stages 0-3 on 2 ranks, launched together (each on its own port) and awaited."""
    root = tmp_path_factory.mktemp("stages")
    # ZeRO-3 keeps parameters below stage3_param_persistence_threshold (1e5 elements by
    # default) whole on every rank; 0 partitions all of them, so the halving is exact.
    whole = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    handles = {stage: Run(RunConfig(example="zero3", stage=stage, world_size=2, steps=4, **SMALL,
                                    ds_overrides=whole if stage == 3 else {}),
                          root=root).start() for stage in range(4)}
    for run in handles.values():
        run.wait(timeout=600)
    return {stage: run.summary for stage, run in handles.items()}


def test_stages_finish_concurrently(stage_runs):
    assert {s: r["status"] for s, r in stage_runs.items()} == {0: "finished", 1: "finished", 2: "finished",
                                                                3: "finished"}


def test_zero1_halves_optimizer_state_per_rank(stage_runs):
    for rank in ("0", "1"):
        stage0 = stage_runs[0]["per_rank"][rank]["optim_bytes"]
        stage1 = stage_runs[1]["per_rank"][rank]["optim_bytes"]
        assert stage0 > 0 and stage1 == pytest.approx(stage0 / 2, rel=0.02)


def test_zero3_halves_parameters_per_rank(stage_runs):
    for rank in ("0", "1"):
        stage0 = stage_runs[0]["per_rank"][rank]["param_bytes"]
        stage3 = stage_runs[3]["per_rank"][rank]["param_bytes"]
        assert stage0 > 0 and stage3 == pytest.approx(stage0 / 2, rel=0.02)


def test_failing_rank_is_named(runs_root):
    run = Run(RunConfig(example="zero3", world_size=2, steps=50, **SMALL),
              env={"LABKIT_FAULT": "raise@rank1:step3"}).start()
    assert run.wait(timeout=300) == "failed"
    summary = run.summary
    assert summary["failed_rank"] == 1
    assert summary["cause"].startswith("rank 1: RuntimeError: injected fault")
    assert not run_processes(run.run_dir)
    # What rank 0 recorded before the failure is kept.
    assert summary["per_rank"]["0"]["steps"] >= 2


def test_stop_ends_every_process_and_keeps_metrics(runs_root):
    run = Run(RunConfig(example="zero3", world_size=2, steps=100_000, **SMALL)).start()
    deadline = time.monotonic() + 300
    while run.progress() < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert run.progress() >= 3, (run.run_dir / "supervisor.log").read_text()
    assert len(run_processes(run.run_dir)) >= 5  # supervisor, launcher, launch.py, 2 guards, 2 workers
    started = time.monotonic()
    assert run.stop() == "stopped"
    assert time.monotonic() - started < 6
    assert not run_processes(run.run_dir)
    steps = [r for r in read_records(rank_file(run.run_dir, 0)) if r["event"] == "step"]
    assert len(steps) >= 3 and run.summary["steps_completed"] >= 3
    # The run store lists it and reloads it.
    table = runs()
    row = table[table.run_id == run.run_dir.name].iloc[0]
    assert row.status == "stopped"
    assert load_run(run.run_dir.name).status == "stopped"


def test_killed_rank_keeps_records_up_to_its_last_step(runs_root):
    run = Run(RunConfig(example="zero3", world_size=2, steps=50, **SMALL),
              env={"LABKIT_FAULT": "kill@rank0:step5"}).start()
    assert run.wait(timeout=300) in ("failed", "oom")
    records = read_records(rank_file(run.run_dir, 0))
    assert [r["step"] for r in records if r["event"] == "step"] == [1, 2, 3, 4]
    assert run.summary["failed_rank"] == 0 and "SIGKILL" in run.summary["cause"]


def test_run_without_per_step_records_still_shows_a_hang(runs_root):
    """telemetry=False (the benchmark's baseline) writes no step records, only a heartbeat about
    once a second: without it a stuck rank would go unnoticed for the whole startup allowance."""
    run = Run(RunConfig(example="zero3", world_size=2, steps=100_000, telemetry=False, heartbeat_s=5, **SMALL),
              env={"LABKIT_FAULT": "hang@rank1:step40"}).start()
    assert run.wait(timeout=300) == "hung", run.cause
    assert "heartbeat" in run.cause
    beats = [r for r in read_records(rank_file(run.run_dir, 0)) if r["event"] == "beat"]
    assert beats and not any(r["event"] == "step" for r in read_records(rank_file(run.run_dir, 0)))
    assert beats[-1]["step"] < 40  # rank 0 waits for rank 1 inside step 40's collective
    assert 0 < run.summary["steps_completed"] < 40  # counted from the heartbeats
    assert not run_processes(run.run_dir)


def test_run_store_does_not_list_a_run_with_a_dead_supervisor_as_running(runs_root):
    run = Run(RunConfig(example="zero3", world_size=2, steps=100_000, **SMALL)).start()
    deadline = time.monotonic() + 300
    while run.progress() < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    status = json.loads((run.run_dir / "status.json").read_text())
    import os
    import signal

    os.kill(status["supervisor_pid"], signal.SIGKILL)  # no summary.json: nobody ends the ranks
    run._supervisor.wait()
    table = runs()  # a fresh look, as after a kernel restart
    row = table[table.run_id == run.run_dir.name].iloc[0]
    assert row.status == "failed" and "supervisor died" in row.cause
    assert not run_processes(run.run_dir)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_run_whose_supervisor_may_live_on_another_host_is_not_recovered(tmp_path):
    """Issue 11 item 8: on a shared run store (another host, a container, hidepid) a PID this process cannot
    see says nothing; "recovering" such a run wrote "failed" into a live run's summary."""
    from labkit.core.files import write_json_atomic
    from labkit.launch.supervisor import host_identity

    here = host_identity()
    for name, host in (("elsewhere", {**here, "boot_id": "another-machine"}), ("legacy", None), ("here", here)):
        run_dir = tmp_path / name
        run_dir.mkdir()
        write_json_atomic(run_dir / "config.json", RunConfig(example="zero3", world_size=2, **SMALL).to_dict())
        status = {"status": "running", "supervisor_pid": _dead_pid(), "started_at": time.time()}
        write_json_atomic(run_dir / "status.json", {**status, **({"host": host} if host else {})})
        run = load_run(run_dir)
        if name == "here":  # provably this host and the PID is gone: the run is recovered
            assert run.status == "failed" and "supervisor died" in run.cause
        else:
            assert run.status not in ("failed", "finished") and not (run_dir / "summary.json").exists()


def test_launch_record_keeps_only_what_labkit_set_and_is_private(runs_root, monkeypatch):
    """Issue 11 item 9: launch.json stored the whole environment (cloud keys, tokens), world-readable."""
    import os
    import stat

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-for-the-run-store")
    run = Run(RunConfig(example="pytorch", steps=2, **SMALL)).start()
    assert run.wait(timeout=600) == "finished", run.cause
    launch = json.loads((run.run_dir / "launch.json").read_text())
    assert "AWS_SECRET_ACCESS_KEY" not in launch["env"] and "DS_ACCELERATOR" in launch["env"]
    for name in ("launch.json", "command.txt"):
        assert stat.S_IMODE(os.stat(run.run_dir / name).st_mode) == 0o600
        assert "not-for-the-run-store" not in (run.run_dir / name).read_text()


_INTERRUPTED_KERNEL = """
import signal, sys, time
# Ctrl-C raises KeyboardInterrupt, as ipykernel makes it do, even when this test runs in a background
# shell job (which starts every child with SIGINT ignored, and then Python installs no handler).
signal.signal(signal.SIGINT, signal.default_int_handler)
from labkit import Run, RunConfig
from labkit.study.lessons import launch_all
config = RunConfig(example="zero3", world_size=2, steps=100_000, hidden=64, micro_batch=8, dataset_size=256)
try:
    if sys.argv[1] == "wait":
        run = Run(config).start()
        print("waiting", run.run_dir, flush=True)
        run.wait()
    else:
        print("waiting", flush=True)
        launch_all({"a": config, "b": config})
except KeyboardInterrupt:
    from labkit import runs
    print("interrupted", ",".join(runs()["status"]), flush=True)
time.sleep(120)  # the kernel lives on after Ctrl-C
"""


def _line(process: subprocess.Popen, prefix: str) -> str:
    """The next line of `process` that starts with `prefix` (DeepSpeed logs to stdout too)."""
    for line in process.stdout:
        if line.startswith(prefix):
            return line
    return ""


@pytest.mark.parametrize("entry", ["wait", "launch_all"])
def test_ctrl_c_while_waiting_stops_the_runs_it_started(runs_root, entry):
    """Issue 11 item 12: Ctrl-C in the kernel during Run.wait() or launch_all left the runs going, unattended."""
    import os
    import signal

    kernel = subprocess.Popen([sys.executable, "-c", _INTERRUPTED_KERNEL, entry], stdout=subprocess.PIPE, text=True,
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    watchdog = threading.Timer(400, kernel.kill)  # a kernel that never answers fails the test instead of hanging it
    watchdog.start()
    try:
        assert _line(kernel, "waiting")
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not any(
                any(r.get("event") == "step" for r in read_records(path)) for path in runs_root.glob("*/rank0.jsonl")):
            time.sleep(0.5)
        time.sleep(1)  # every run of launch_all started
        kernel.send_signal(signal.SIGINT)
        line = _line(kernel, "interrupted").split()
        assert line[0] == "interrupted" and set(line[1].split(",")) == {"stopped"}, line
        for run_dir in runs_root.iterdir():
            assert not run_processes(run_dir)
    finally:
        watchdog.cancel()
        kernel.kill()
        kernel.wait()

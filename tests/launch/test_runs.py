"""Runs from the outside: the CLI runs each example (all four at once), what the run store keeps private, a
run whose supervisor may live on another host, Ctrl-C in a kernel (both kernels at once).

ZeRO's memory effect per stage is tests/study/test_sweep.py's (its 4-point sweep); failures, hangs, Stop and a dead
supervisor are the fault suite's (tests/launch/test_faults.py)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from labkit import RunConfig, load_run
from labkit.core.records import rank_file, read_records
from labkit.launch.run import warm_setting
from tests.conftest import REPO, run_processes, run_together

SMALL = dict(hidden=512, depth=2, micro_batch=32, dataset_size=2048)


EXAMPLES = {
    "pytorch": [],
    "offload": ["--world-size", "2"],
    "deepspeed": ["--world-size", "2", "--stage", "1", "--cold"],  # through DeepSpeed's launcher, as `deepspeed`
    "zero3": ["--world-size", "2", "--grad-accum", "2"],
}
SECRET = "not-for-the-run-store"


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """`labkit run --example X` for each example, started together and awaited. The environment holds a cloud
    secret, which launch.json and command.txt must leave out."""
    root = tmp_path_factory.mktemp("cli")
    env = {**os.environ, "AWS_SECRET_ACCESS_KEY": SECRET}
    commands = {example: dict(args=[sys.executable, "-m", "labkit", "run", "--example", example, "--micro-batch", "32",
                                    "--steps", "6", "--out", str(root / example), *extra], cwd=REPO, env=env)
                for example, extra in EXAMPLES.items()}
    return {example: (result, root / example) for example, result in run_together(commands, timeout=600).items()}


@pytest.mark.slow
@pytest.mark.parametrize("example", list(EXAMPLES))
def test_cli_runs_each_example(example, cli_runs):
    result, out = cli_runs[example]
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
    assert not run_processes(out)


@pytest.mark.slow
@pytest.mark.parametrize("example", list(EXAMPLES))
def test_cli_runs_launch_warm_unless_told_cold(example, cli_runs):
    out = cli_runs[example][1]
    launch = json.loads((out / "launch.json").read_text())["launch"]
    cold = "--cold" in EXAMPLES[example] or not warm_setting()
    assert launch == ("cold" if cold else "warm")
    # A cold run's tree is DeepSpeed's launcher's; a warm one's has none of it (labkit.launch.warm_launch).
    assert ("deepspeed.launcher.runner" in (out / "supervisor.log").read_text()) == cold


@pytest.mark.slow
@pytest.mark.parametrize("example", list(EXAMPLES))
def test_launch_record_keeps_only_what_labkit_set_and_is_private(example, cli_runs):
    """launch.json once stored the whole environment (cloud keys, tokens), world-readable."""
    out = cli_runs[example][1]
    launch = json.loads((out / "launch.json").read_text())
    assert "AWS_SECRET_ACCESS_KEY" not in launch["env"] and "DS_ACCELERATOR" in launch["env"]
    for name in ("launch.json", "command.txt"):
        assert stat.S_IMODE(os.stat(out / name).st_mode) == 0o600
        assert SECRET not in (out / name).read_text()


def _dead_pid() -> int:
    """A PID no process has now (found without starting one)."""
    pid = max(psutil.pids()) + 1
    while psutil.pid_exists(pid):
        pid += 1
    return pid


def test_a_run_whose_supervisor_may_live_on_another_host_is_not_recovered(tmp_path):
    """On a shared run store (another host, a container, hidepid) a PID this process cannot
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
        if name == "here":  # provably this host and the PID is gone: the run is lost, and recovered on request
            assert run.lost and run.status == "failed" and "supervisor died" in run.cause
            assert not (run_dir / "summary.json").exists()  # reading wrote nothing
            assert run.recover() and run.summary["status"] == "failed" and "supervisor died" in run.cause
        else:
            assert not run.lost and not run.recover()
            assert run.status not in ("failed", "finished") and not (run_dir / "summary.json").exists()


# A rank of a run whose supervisor died: it names the run directory as labkit's worker does.
_ORPHAN_RANK = "import time; time.sleep(600)"


@pytest.mark.slow
def test_status_and_the_run_list_only_read_and_recovery_is_an_explicit_call(tmp_path):
    """Reading `Run.status` (the dashboard's thread, every tick) or `labkit.runs()` killed a lost run's
    processes and wrote its summary.json; now only `Run.recover` / `recover_stale` (the CLI's `runs`, the
    panel's history) do."""
    from labkit import runs
    from labkit.core.files import write_json_atomic
    from labkit.launch import proctree
    from labkit.launch.history import recover_stale
    from labkit.launch.supervisor import host_identity

    run_dir = tmp_path / "lost"
    run_dir.mkdir()
    write_json_atomic(run_dir / "config.json", RunConfig(example="zero3", world_size=2, **SMALL).to_dict())
    rank = subprocess.Popen([sys.executable, "-c", _ORPHAN_RANK, "-m", "labkit.rank.worker", "--run-dir",
                             str(run_dir)], start_new_session=True)
    try:
        write_json_atomic(run_dir / "status.json", {"status": "running", "supervisor_pid": _dead_pid(),
                                                    "pgid": rank.pid, "started_at": time.time(),
                                                    "host": host_identity()})
        run = load_run(run_dir)
        for _ in range(3):
            assert (run.status, run.done, run.lost) == ("failed", True, True)
            row = runs(tmp_path).set_index("run_id").loc["lost"]
            assert row.status == "failed" and "supervisor died" in row.cause
        assert not (run_dir / "summary.json").exists() and rank.poll() is None  # nothing written, nothing signalled
        assert [p.pid for p in proctree.run_processes(run_dir)] == [rank.pid]
        assert recover_stale(tmp_path) == [run_dir]
        assert rank.wait(timeout=30) is not None and not proctree.run_processes(run_dir)  # reaped by psutil: no code
        assert run.summary["status"] == "failed" and "supervisor died" in run.summary["cause"]
        assert not run.lost and recover_stale(tmp_path) == []  # recovered once
    finally:
        rank.kill()
        rank.wait()


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


def _interrupt(entry: str, runs_root: Path) -> list[str]:
    """A kernel starts runs into `runs_root` (Run.wait or launch_all), gets Ctrl-C once a run steps, and prints
    the statuses its run store then holds: the "interrupted" line, split."""
    kernel = subprocess.Popen([sys.executable, "-c", _INTERRUPTED_KERNEL, entry], stdout=subprocess.PIPE, text=True,
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "LABKIT_RUNS_DIR": str(runs_root)})
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
        return _line(kernel, "interrupted").split()
    finally:
        watchdog.cancel()
        kernel.kill()
        kernel.wait()


ENTRIES = ("wait", "launch_all")


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> dict[str, tuple[list[str], Path]]:
    """Both kernels at once, each with its own run store."""
    roots = {entry: tmp_path_factory.mktemp(f"ctrl-c-{entry}") for entry in ENTRIES}
    with ThreadPoolExecutor(max_workers=len(ENTRIES)) as pool:
        lines = {entry: pool.submit(_interrupt, entry, roots[entry]) for entry in ENTRIES}
        return {entry: (lines[entry].result(), roots[entry]) for entry in ENTRIES}


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES)
def test_ctrl_c_while_waiting_stops_the_runs_it_started(interrupted, entry):
    """Ctrl-C in the kernel during Run.wait() or launch_all once left the runs going, unattended."""
    line, runs_root = interrupted[entry]
    assert line and line[0] == "interrupted" and set(line[1].split(",")) == {"stopped"}, line
    assert list(runs_root.iterdir())
    for run_dir in runs_root.iterdir():
        assert not run_processes(run_dir)


def test_the_run_list_keeps_counts_integers_where_a_row_has_none(tmp_path):
    """`labkit runs`: a plain-PyTorch run has no ZeRO stage; the stage column still reads 3, not 3.0, and the
    missing one is empty (null in JSON), not NaN."""
    from labkit.launch.history import INTEGER_COLUMNS, runs

    for name, stage in (("a-torch", None), ("b-zero3", 3)):
        run = tmp_path / name
        run.mkdir()
        config = {"example": "pytorch" if stage is None else "zero3", "stage": stage, "world_size": 1,
                  "micro_batch": 32, "grad_accum": 1}
        (run / "config.json").write_text(json.dumps(config))
        (run / "summary.json").write_text(json.dumps({**config, "status": "finished", "global_batch": 32,
                                                      "steps_completed": 5, "median_step_time_s": 0.01}))
    table = runs(tmp_path)
    assert all(str(table[c].dtype) == "Int64" for c in INTEGER_COLUMNS)
    assert table["stage"].isna().tolist() == [True, False] and table["stage"].iloc[1] == 3
    rows = json.loads(table.to_json(orient="records"))
    assert rows[0]["stage"] is None and rows[1]["stage"] == 3 and rows[1]["global_batch"] == 32
    assert " 3 " in table.to_string(index=False) and "3.0" not in table.to_string(index=False)

"""Warm launches (labkit.launch.zygote, labkit.launch.warm_launch): ranks forked from a process that imported torch
and DeepSpeed once; and spawned ones (GPU runs): ranks the supervisor starts as launch.py would. The command they
stand in for is built by the same pure function as a cold launch's; the runs are real: a finished run's records, a
SIGKILLed rank named, Stop and the parent's death ending every process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from labkit import Run, RunConfig
from labkit.core.records import rank_file, read_records
from labkit.launch import run as run_module
from labkit.launch import zygote
from labkit.launch.admission import run_tree
from labkit.launch.launcher import build_command, import_time_env
from labkit.launch.proctree import run_processes as proctree_run_processes
from labkit.launch.run import launch_mode
from labkit.launch.warm_launch import rank_argv, rank_env, spawn_spec, spawned_env, warm_spec
from labkit.launch.zygote import SHARED_ENV, import_env
from labkit.runtime.devices import Devices
from tests.conftest import REPO, run_processes

SMALL = dict(example="zero3", world_size=2, hidden=256, micro_batch=16, dataset_size=1024)
WAIT_S = 300  # a loaded 2-core machine, the zygote's first import included


def argv_of(**overrides) -> list[str]:
    config = RunConfig(**{**SMALL, "steps": 5, **overrides})
    argv, _ = build_command(config, "/tmp/some-run", master_port=29600, base_env={})
    return argv


def test_a_single_node_run_of_labkits_worker_goes_warm_with_launch_pys_environment():
    spec = warm_spec(argv_of())
    assert spec is not None
    assert (spec.world_size, spec.master_addr, spec.master_port) == (2, "127.0.0.1", 29600)
    assert spec.run_dir == Path("/tmp/some-run")
    env = rank_env({"KEEP": "1"}, spec, 1)
    # deepspeed/launcher/launch.py:177-182, 214-215 (0.19.8) sets exactly these for local rank 1 of 2 on one node.
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE",
                                "MASTER_ADDR", "MASTER_PORT", "KEEP")} == {
        "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_SIZE": "2", "CROSS_RANK": "0", "CROSS_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29600", "KEEP": "1"}
    # The title a forked rank takes is the command line launch.py would have given it.
    assert rank_argv(spec, 1)[1:] == ["-u", "-m", "labkit.rank.worker", "--local_rank=1", "--run-dir", "/tmp/some-run"]


GPU = Devices("cuda", 2, 2, "nccl", True, True, "NVIDIA H100 80GB HBM3", 80 * 2**30)
CPU = Devices("cpu", 1, 2, "gloo", True, False, "CPU", 2**30)


def gpu_argv(**overrides) -> list[str]:
    """A GPU run's command: its leased devices in CUDA_VISIBLE_DEVICES, no --num_gpus."""
    config = RunConfig(**{**SMALL, "steps": 5, **overrides})
    argv, _ = build_command(config, "/tmp/some-run", master_port=29600, base_env={}, accelerator="cuda",
                            device_ids=["3", "5"])
    return argv


def test_gpu_runs_of_labkits_worker_launch_spawned_cpu_runs_warm_and_cold_means_deepspeeds_launcher(tmp_path):
    assert launch_mode(gpu_argv(), GPU, 2, warm=True) == ("spawned", "spawned")
    assert launch_mode(argv_of(), CPU, 2, warm=True) == ("warm", "warm")
    assert launch_mode(gpu_argv(), GPU, 2, warm=False)[0] == launch_mode(argv_of(), CPU, 2, warm=False)[0] == "cold"
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    assert launch_mode(gpu_argv(script=str(script)), GPU, 2, warm=True)[0] == "cold"
    assert spawn_spec(argv_of(), 2) is None  # a CPU command (--num_gpus) is never spawned
    spec = spawn_spec(gpu_argv(), 2)
    assert spec is not None and (spec.world_size, spec.master_port, spec.run_dir) == (2, 29600, Path("/tmp/some-run"))
    # launch.py's command and environment for local rank 1, the leased devices in the order DeepSpeed's runner hands
    # them on (sorted: rank i gets the GPU it gets on a cold launch), nothing else changed.
    env = spawned_env({"PYTHONPATH": "/repo", "CUDA_VISIBLE_DEVICES": "5,3"}, spec, 1)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["CUDA_VISIBLE_DEVICES"]) == ("1", "1", "2", "3,5")
    assert env["PYTHONPATH"] == "/repo"
    assert rank_argv(spec, 1, "labkit.rank.guard")[1:] == ["-u", "-m", "labkit.rank.guard", "--local_rank=1",
                                                           "--run-dir", "/tmp/some-run"]



def test_labkit_warm_false_off_and_no_mean_cold_and_a_value_it_does_not_understand_is_refused(monkeypatch):
    """Only "0" meant cold: LABKIT_WARM=false launched warm, silently. The usual spellings now read as they say,
    and anything else is refused naming the variable before a Run exists."""
    from labkit.core.config import ConfigError

    for value in ("0", "false", "False", "no", "OFF", " off "):
        monkeypatch.setenv("LABKIT_WARM", value)
        assert not Run(RunConfig(**SMALL)).warm, value
    for value in ("1", "true", "yes", "on", ""):
        monkeypatch.setenv("LABKIT_WARM", value)
        assert Run(RunConfig(**SMALL)).warm, value
    monkeypatch.setenv("LABKIT_WARM", "cold")
    with pytest.raises(ConfigError, match=r"LABKIT_WARM: must be 0 .* got 'cold'"):
        Run(RunConfig(**SMALL))
    assert run_module.warm_setting({"LABKIT_WARM": "off"}) is False  # warm_up reads a run's environment

def test_script_and_multi_node_runs_stay_cold(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    assert warm_spec(argv_of(script=str(script))) is None
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    config = RunConfig(**{**SMALL, "steps": 5, "hostfile": str(hostfile)})
    argv, _ = build_command(config, tmp_path / "run", master_port=29600, base_env={}, master_addr="127.0.0.1")
    assert warm_spec(argv) is None


def _wait_steps(run: Run, n: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and not run.done:
        if min(len([r for r in read_records(rank_file(run.run_dir, k)) if r.get("event") == "step"])
               for k in range(2)) >= n:
            return
        time.sleep(0.1)
    raise AssertionError(f"{run.run_dir} did not reach step {n}: {run.status} {run.cause}")


@pytest.mark.slow
def test_warm_runs_finish_name_a_killed_rank_and_stop_with_no_process_left(tmp_path):
    finished = Run(RunConfig(**{**SMALL, "steps": 5}), root=tmp_path, warm=True).start()
    assert finished.wait(timeout=WAIT_S) == "finished", finished.cause
    assert finished.launch_mode == "warm"
    assert json.loads((finished.run_dir / "launch.json").read_text())["launch"] == "warm"
    for rank in range(2):
        events = [r["event"] for r in read_records(rank_file(finished.run_dir, rank))]
        assert events[0] == "start" and events[-1] == "done" and events.count("step") == 5
        assert json.loads((finished.run_dir / f"rank{rank}.exit").read_text())["returncode"] == 0
    assert "warm launch" in (finished.run_dir / "supervisor.log").read_text()

    # Started together, now that the zygote is up: one rank SIGKILLs itself, one run is stopped.
    killed = Run(RunConfig(**{**SMALL, "steps": 100_000}), root=tmp_path, warm=True,
                 env={"LABKIT_FAULT": "kill@rank1:step3"}).start()
    stopped = Run(RunConfig(**{**SMALL, "steps": 100_000}), root=tmp_path, warm=True).start()
    _wait_steps(stopped, 2)
    ranks = [p for p in run_processes(stopped.run_dir) if "labkit.rank.worker" in p.cmdline()]
    assert len(ranks) == 2, [p.cmdline() for p in run_processes(stopped.run_dir)]  # found by their command line
    # The admission counts their memory as the ranks', the supervisor's and the warm launcher's as the launcher's.
    tree = run_tree(stopped._supervisor_pid())
    assert tree.launcher_bytes > 0 and tree.rank_bytes >= sum(p.memory_info().rss for p in ranks) * 0.9, tree
    assert stopped.stop() == "stopped"
    assert run_processes(stopped.run_dir) == []
    assert killed.wait(timeout=WAIT_S) == "failed"
    assert killed.summary["failed_rank"] == 1 and "SIGKILL" in killed.cause, killed.cause
    assert json.loads((killed.run_dir / "rank1.exit").read_text())["returncode"] == -signal.SIGKILL
    assert run_processes(killed.run_dir) == []


@pytest.mark.slow
def test_spawned_ranks_run_the_guard_finish_and_a_killed_one_is_named(tmp_path, monkeypatch):
    """The spawned launch on CPU ranks (the mode a GPU run takes; only the choice of mode is forced here)."""
    monkeypatch.setattr(run_module, "launch_mode", lambda *_a, **_k: ("spawned", "spawned"))
    finished = Run(RunConfig(**{**SMALL, "steps": 5}), root=tmp_path).start()
    killed = Run(RunConfig(**{**SMALL, "steps": 100_000}), root=tmp_path,
                 env={"LABKIT_FAULT": "kill@rank1:step3"}).start()
    assert finished.wait(timeout=WAIT_S) == "finished", finished.cause
    assert json.loads((finished.run_dir / "launch.json").read_text())["launch"] == "spawned"
    assert "spawned launch" in (finished.run_dir / "supervisor.log").read_text()
    assert "spawned ranks [0, 1]" in (finished.run_dir / "launcher.log").read_text()
    for rank in range(2):
        events = [r["event"] for r in read_records(rank_file(finished.run_dir, rank))]
        assert events[0] == "start" and events[-1] == "done" and events.count("step") == 5
        exit_info = json.loads((finished.run_dir / f"rank{rank}.exit").read_text())
        # Written by the guard (the worker's pid, the one in its records), as on a cold launch: 0, or SIGTERM where
        # the worker's teardown outlasted the supervisor's grace after every rank's `done` (a loaded machine).
        assert exit_info["returncode"] in (0, -signal.SIGTERM) and "recorded_by" not in exit_info
        assert exit_info["pid"] == read_records(rank_file(finished.run_dir, rank))[0]["pid"]
    assert killed.wait(timeout=WAIT_S) == "failed"
    assert killed.summary["failed_rank"] == 1 and "SIGKILL" in killed.cause, killed.cause
    assert run_processes(killed.run_dir) == [] and run_processes(finished.run_dir) == []


@pytest.mark.slow
def test_a_spawned_runs_processes_are_found_by_command_line_a_killed_guard_is_named_and_stop_ends_all(
        tmp_path, monkeypatch):
    from labkit.launch.proctree import arguments, launched_for

    monkeypatch.setattr(run_module, "launch_mode", lambda *_a, **_k: ("spawned", "spawned"))
    guard_killed = Run(RunConfig(**{**SMALL, "steps": 100_000}), root=tmp_path).start()
    stopped = Run(RunConfig(**{**SMALL, "steps": 100_000}), root=tmp_path).start()
    _wait_steps(guard_killed, 2)
    # The forked launcher's title (over the supervisor's longer command line) and the spawned guards and workers:
    # all found by their command lines, the launcher by its title.
    found = [arguments(p.cmdline()) for p in proctree_run_processes(guard_killed.run_dir)]
    assert sum("labkit.launch.warm_launch" in c for c in found) == 1, found
    assert sum("labkit.rank.guard" in c for c in found) == 2 and sum("labkit.rank.worker" in c for c in found) == 2
    assert launched_for(["python -m labkit.launch.warm_launch --run-dir " + str(guard_killed.run_dir), "", ""],
                        guard_killed.run_dir)
    guard = next(p for p in psutil.Process(guard_killed._supervisor_pid()).children(recursive=True)
                 if "labkit.rank.guard" in p.cmdline() and "--local_rank=1" in p.cmdline())
    guard.kill()  # no guard left to record its rank's exit: the launcher does
    assert guard_killed.wait(timeout=WAIT_S) == "failed"
    assert guard_killed.summary["failed_rank"] == 1 and "rank guard" in guard_killed.cause, guard_killed.cause
    exit_info = json.loads((guard_killed.run_dir / "rank1.exit").read_text())
    assert exit_info["returncode"] == -signal.SIGKILL and exit_info["recorded_by"] == "launcher"
    _wait_steps(stopped, 2)
    assert stopped.stop() == "stopped"
    assert run_processes(stopped.run_dir) == [] and run_processes(guard_killed.run_dir) == []


PARENT = """
import sys, time
from labkit import Run, RunConfig
run = Run(RunConfig(example="zero3", world_size=2, hidden=256, micro_batch=16, dataset_size=1024, steps=100000),
          root=sys.argv[1], warm=True).start()
print("RUN_DIR=" + str(run.run_dir), flush=True)
time.sleep(3600)
"""


@pytest.mark.slow
def test_the_parents_death_ends_a_warm_runs_zygote_supervisor_and_ranks(tmp_path):
    own = {k: v for k, v in os.environ.items() if k != SHARED_ENV}  # its own zygote, not the session's
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                              text=True, env=own)
    try:
        assert parent.stdout is not None
        line = ""
        while not line.startswith("RUN_DIR="):  # DeepSpeed's import may print first
            line = parent.stdout.readline()
            assert line, "the parent exited before it started its run"
        run_dir = Path(line.strip().removeprefix("RUN_DIR="))
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and not any(
                r.get("event") == "step" for r in read_records(rank_file(run_dir, 0))):
            time.sleep(0.1)
        zygotes = [p for p in psutil.Process(parent.pid).children() if "labkit.launch.zygote" in p.cmdline()]
        assert len(zygotes) == 1
        parent.kill()
        parent.wait()
        _, alive = psutil.wait_procs(zygotes, timeout=30)
        assert not alive
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and run_processes(run_dir):
            time.sleep(0.2)
        assert run_processes(run_dir) == []
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "stopped" and "parent process" in summary["cause"], summary
    finally:
        parent.kill()


def test_import_env_finds_the_same_modules_through_a_repeated_path():
    # A child's launch puts the checkout first again on a PYTHONPATH that already starts with it.
    env = import_time_env({"PYTHONPATH": "/a"}, "cpu")
    again = import_time_env(env, "cpu")
    assert again["PYTHONPATH"] != env["PYTHONPATH"] and import_env(again) == import_env(env)
    assert import_env({**env, "DS_ACCELERATOR": "cuda"}) != import_env(env)


CHILD = """
import os, sys, time
from labkit import Run, RunConfig
run = Run(RunConfig(example="zero3", world_size=2, micro_batch=16, dataset_size=1024, steps=100000,
                    model="beside_me:build_model", data="beside_me:build_dataset", loss="beside_me:loss_fn"),
          root=sys.argv[1], warm=True).start()
print("RUN_DIR=" + str(run.run_dir), run.launch_mode, flush=True)
time.sleep(3600)
"""


@pytest.mark.slow
def test_a_child_process_runs_warm_on_the_lent_zygote_in_its_directory_and_its_death_ends_its_run(tmp_path):
    lender = zygote.share({**os.environ, **import_time_env(os.environ, "cpu")})
    zygote_pid = lender.wait_ready()["pid"]
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    # The learner's module, beside the notebook that asks for the run: the ranks import it as `python -m` would.
    (workdir / "beside_me.py").write_text("from tests.own_model import build_dataset, build_model, loss_fn  # noqa\n")
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], cwd=workdir, stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert child.stdout is not None
        line = ""
        while not line.startswith("RUN_DIR="):
            line = child.stdout.readline()
            assert line, "the child exited before it started its run"
        run_dir_text, mode = line.strip().removeprefix("RUN_DIR=").split(" ", 1)
        run_dir = Path(run_dir_text)
        assert mode == "warm"
        # No zygote of its own: the supervisor is the lent zygote's child, watching the child that asked.
        assert not [p for p in psutil.Process(child.pid).children() if "labkit.launch.zygote" in p.cmdline()]
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and not any(
                r.get("event") == "step" for r in read_records(rank_file(run_dir, 0))):
            time.sleep(0.1)
        status = json.loads((run_dir / "status.json").read_text())
        supervisor = psutil.Process(status["supervisor_pid"])
        assert supervisor.ppid() == zygote_pid
        assert f"--parent-pid {child.pid}" in " ".join(supervisor.cmdline())
        # The ranks run where the child runs, not where the zygote was started.
        ranks = [p for p in run_processes(run_dir) if "labkit.rank.worker" in " ".join(p.cmdline())]
        assert len(ranks) == 2 and {p.cwd() for p in ranks} == {str(workdir)}
        killed = time.monotonic()
        child.kill()
        child.wait()
        while time.monotonic() < killed + 30 and run_processes(run_dir):
            time.sleep(0.1)
        assert run_processes(run_dir) == []
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "stopped" and f"parent process {child.pid}" in summary["cause"], summary
        assert lender.alive()  # the zygote serves the session on
    finally:
        child.kill()

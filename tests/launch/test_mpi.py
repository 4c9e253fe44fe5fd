"""Exported Open MPI jobs for real: `labkit export --launcher openmpi`, then `job/launch.sh`, which runs
DeepSpeed's runner with `--launcher openmpi`: a real `mpirun -n 2` (Debian's openmpi-bin, 4.1) on this
machine, `localhost slots=2` in the hostfile. As root (this machine, CI) the script lets mpirun run as
root; nothing else changes. Three real runs of the exported job (~30-80 s each here): finished; `kill` of
the script -> stopped; a rank SIGKILLed; and one `labkit run --hostfile --launcher openmpi`. The refusals
end before mpirun starts.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from labkit.core.config import ConfigError
from labkit.launch.launcher import free_port
from labkit.launch.multinode import check_tools, deepspeed_env_text
from labkit.launch.summary import rank_records
from labkit.rank.entry import rank_env
from labkit.ui.dashboard import load_series
from tests.conftest import REPO, run_processes
from tests.launch.cluster_jobs import assert_trained

RUN_TIMEOUT_S = 400  # a 2-rank DeepSpeed run on a loaded 2-core machine


@pytest.fixture(scope="session")
def mpirun() -> str:
    missing = [tool for tool in ("mpirun", "ompi_info") if shutil.which(tool) is None]
    if missing:
        message = f"Open MPI tests need {missing} (apt-get install openmpi-bin)"
        if os.environ.get("LABKIT_MPI_REQUIRED"):
            pytest.fail(message)
        pytest.skip(message)
    return str(shutil.which("mpirun"))


def export_mpi(tmp_path: Path, hosts: str = "localhost slots=2\n", steps: int = 4) -> Path:
    (tmp_path / "hosts").write_text(hosts)
    job = tmp_path / "job"
    done = subprocess.run(
        [sys.executable, "-m", "labkit", "export", "--example", "zero3", "--world-size", "2", "--micro-batch", "8",
         "--steps", str(steps), "--hidden", "32", "--dataset-size", "256", "--launcher", "openmpi",
         "--hostfile", str(tmp_path / "hosts"), "--master-port", str(free_port()), "--out", str(job)],
        cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return job


def user_env(**extra: str) -> dict[str, str]:
    """A user's shell: no venv, a plain PATH (the script must find labkit's Python and mpirun itself)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "PATH": "/usr/local/bin:/usr/bin:/bin", **extra}


def launch(job: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["/bin/bash", str(job / "launch.sh")], cwd="/", env=env or user_env(),
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


# -- pure parts --------------------------------------------------------------------------
def test_mpirun_rank_variables_become_torch_variables():
    rank = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_SIZE": "8",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500"}
    assert rank_env(rank) == {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_SIZE": "4"}


def test_the_runner_starts_rank_entry_as_a_module_under_mpirun(tmp_path: Path):
    """What labkit relies on in DeepSpeed's own OpenMPIRunner: `python -u -m <module>` for every slot
    of the hostfile, `-x K=V` for what it forwards. Built by DeepSpeed's code, not a copy of it."""
    from deepspeed.launcher import runner
    from deepspeed.launcher.multinode_runner import OpenMPIRunner

    from labkit.core.config import RunConfig
    from labkit.launch.launcher import build_command
    from labkit.launch.multinode import launcher_command

    (tmp_path / "hostfile").write_text("localhost slots=2\n")
    config = RunConfig(example="zero3", world_size=2, micro_batch=8, steps=4, hidden=32, dataset_size=256,
                       hostfile=str(tmp_path / "hostfile"))
    argv, _ = build_command(config, tmp_path, master_port=29555, base_env={}, master_addr="localhost")
    argv = launcher_command(argv, "openmpi", tmp_path / "labkit")
    args = runner.parse_args(argv[4:])
    pool = runner.fetch_hostfile(args.hostfile)
    command = OpenMPIRunner(args, runner.encode_world_info(pool), pool).get_cmd({}, {"localhost": [0, 1]})
    assert command[:5] == ["mpirun", "-n", "2", "-hostfile", str(tmp_path / "hostfile")]
    assert command[-6:] == [sys.executable, "-u", "-m", "labkit.rank.entry", "--run-dir", str(tmp_path)]
    # One host: without --force_multi the runner would take its local path, launch.py, and no mpirun.
    assert args.force_multi and args.no_ssh_check


def test_mpirun_exports_no_value_deepspeed_would_quote():
    env = {"LABKIT_NOTE": "two words", "TORCH_EXTENSIONS_DIR": "/shared/ext", "MASTER_PORT": "29500"}
    # add_export wraps "two words" in double quotes for pdsh's shell; mpirun's -x would keep them.
    assert deepspeed_env_text(env, "openmpi").splitlines() == ["MASTER_PORT=29500", "TORCH_EXTENSIONS_DIR=/shared/ext"]
    assert "LABKIT_NOTE=two words" in deepspeed_env_text(env, "pdsh")


def test_missing_mpirun_is_refused(tmp_path: Path):
    with pytest.raises(ConfigError) as error:
        check_tools("openmpi", str(tmp_path))
    assert "needs mpirun and ompi_info on the PATH" in str(error.value) and "openmpi-bin" in str(error.value)


def test_labkit_run_refuses_a_launcher_it_cannot_use(tmp_path: Path):
    from labkit.core.config import RunConfig
    from labkit.launch.run import Run

    (tmp_path / "hosts").write_text("localhost slots=2\n")
    config = RunConfig(example="zero3", world_size=2, micro_batch=8, steps=4, hidden=32, dataset_size=256)
    cases = [(Run(config, out=tmp_path / "a", launcher="openmpi"), "it needs --hostfile"),
             (Run(RunConfig(**{**config.to_dict(), "hostfile": str(tmp_path / "hosts")}), out=tmp_path / "b",
                  launcher="openmpi", env={"PATH": str(tmp_path)}), "needs mpirun and ompi_info on the PATH"),
             (Run(config, out=tmp_path / "c", launcher="slurm"), "labkit export --launcher slurm")]
    for run, text in cases:
        with pytest.raises(ConfigError) as error:
            run.start()
        assert error.value.field == "launcher" and text in str(error.value)
        assert run.run_dir is None and not run._out.exists()  # refused before anything was written


# -- real runs under mpirun ----------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.mpi
def test_exported_openmpi_job_trains_to_finished(mpirun: str, tmp_path: Path):
    job = export_mpi(tmp_path)
    script = (job / "launch.sh").read_text()
    # Only as root does the script let mpirun run as root.
    assert 'if [ "$EUID" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi' in script
    done = launch(job)
    assert done.returncode == 0, (done.stdout, done.stderr, (job / "launcher.log").read_text()[-3000:])
    assert done.stdout.strip() == "finished"
    assert "mpirun -n 2 -hostfile" in (job / "launcher.log").read_text()
    assert_trained(job, "openmpi")  # ranks from mpirun's OMPI_COMM_WORLD_RANK / _LOCAL_RANK / _SIZE


@pytest.mark.slow
@pytest.mark.mpi
def test_kill_of_the_script_ends_every_rank_and_the_summary_says_stopped(mpirun: str, tmp_path: Path):
    job = export_mpi(tmp_path, steps=100000)
    script = subprocess.Popen(["/bin/bash", str(job / "launch.sh")], cwd="/", env=user_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        # The live progress, read from the job directory while mpirun runs: both ranks' steps.
        while min(len(rank.trace("samples_per_s")[0]) for rank in load_series(job)) == 0:
            assert time.monotonic() < deadline and script.poll() is None, script.communicate()
            time.sleep(0.5)
        # `kill <pid of launch.sh>`: the script alone gets SIGTERM and passes it on to the supervisor
        # (without that, the script would die at once and print nothing; its ranks would end on their own).
        script.send_signal(signal.SIGTERM)
        out, err = script.communicate(timeout=120)
    finally:
        if script.poll() is None:
            os.killpg(script.pid, signal.SIGKILL)
            script.wait()
    assert script.returncode == 130, (out, err)
    assert out.startswith("stopped: stopped by request (SIGTERM)"), out
    assert json.loads((job / "summary.json").read_text())["status"] == "stopped"
    assert "every process of the run has ended" in (job / "supervisor.log").read_text()
    assert not run_processes(job)


@pytest.mark.slow
@pytest.mark.mpi
def test_a_rank_killed_under_mpirun_is_named(mpirun: str, tmp_path: Path):
    job = export_mpi(tmp_path, steps=400)
    done = launch(job, user_env(LABKIT_FAULT="kill@rank1:step3"))  # rank 1 SIGKILLs itself at step 3
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stdout.startswith("failed: rank 1 on node localhost: killed by SIGKILL"), done.stdout
    summary = json.loads((job / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["failed_rank"] == 1
    assert not run_processes(job)


@pytest.mark.slow
@pytest.mark.mpi
def test_a_job_mpirun_cannot_run_is_refused_before_it_starts(mpirun: str, tmp_path: Path):
    job = export_mpi(tmp_path)
    # No mpirun on the PATH.
    done = launch(job, user_env(PATH="/nonexistent"))
    assert done.returncode == 2 and "needs mpirun and ompi_info on the PATH" in done.stderr, done.stderr
    # A hostfile edited since the export: fewer slots than ranks.
    (job / "hostfile").write_text("localhost slots=1\n")
    done = launch(job)
    assert done.returncode == 2 and "built for 2 ranks but the hostfile holds 1" in done.stderr, done.stderr
    # A second host that cannot see the job directory (here: cannot be reached at all).
    (job / "hostfile").write_text("localhost slots=1\nlabkit-no-such-host.invalid slots=1\n")
    done = launch(job)
    assert done.returncode == 2 and "not visible on every node" in done.stderr, done.stderr
    assert "labkit-no-such-host.invalid" in done.stderr and "localhost:" not in done.stderr
    assert not (job / "supervisor.log").exists() and not list(job.glob("rank*"))


@pytest.mark.slow
@pytest.mark.mpi
def test_labkit_run_with_a_hostfile_and_the_openmpi_launcher(mpirun: str, tmp_path: Path):
    (tmp_path / "hosts").write_text("localhost slots=2\n")
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "labkit", "run", "--example", "zero3", "--world-size", "2", "--micro-batch", "8",
         "--steps", "4", "--hidden", "32", "--dataset-size", "256", "--hostfile", str(tmp_path / "hosts"),
         "--launcher", "openmpi", "--out", str(run_dir)], cwd=REPO, capture_output=True, text=True,
        timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, (done.stdout, done.stderr[-3000:])
    assert done.stdout.splitlines()[-1].startswith("finished: 4 steps"), done.stdout
    assert "mpirun -n 2 -hostfile" in (run_dir / "launcher.log").read_text()
    records = rank_records(run_dir, 2)
    assert [(records[r][0]["rank"], records[r][0]["local_rank"]) for r in (0, 1)] == [(0, 0), (1, 1)]
    assert not run_processes(run_dir)

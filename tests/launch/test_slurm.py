"""Exported Slurm jobs for real: `labkit export --launcher slurm`, then `sbatch job/launch.sh`.

The session fixture is a one-machine Slurm cluster of the test's own (Debian's slurm-wlm 22.05 and
munge): a munge key, socket and daemon in a temp dir, a `slurm.conf` with this host as the one node
(2 CPUs) of a `debug` partition on spare ports, `slurmctld` and `slurmd`. It waits until `sinfo`
shows the node idle, points SLURM_CONF at it for the session, and at the end cancels its jobs and
stops the three daemons it started, by their pids. Three real jobs (~30-60 s each here): one trains
to `finished`; one is `scancel`led once its progress shows in the job directory; in one a rank is
SIGKILLed. The refusals run real jobs too, which end before anything starts.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from labkit.core.config import ConfigError
from labkit.launch.export import SlurmOptions
from labkit.launch.job_start import nodes_not_seeing
from labkit.launch.launcher import free_port
from labkit.launch.multinode import check_slots, check_tools, deepspeed_env_text
from labkit.rank.entry import LauncherEnvError, rank_env, tasks_per_node
from labkit.ui.dashboard import load_series
from tests.conftest import REPO, run_processes
from tests.launch.cluster_jobs import assert_trained

SLURM_TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel")
JOB_TIMEOUT_S = 400  # a 2-rank DeepSpeed job on a loaded 2-core machine, queueing included
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")


@dataclass
class SlurmCluster:
    node: str       # the one node: this host's name
    home: Path      # slurm.conf, the daemons' logs and state

    def logs(self) -> str:
        logs = sorted(self.home.glob("*.log"))
        return "".join(f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}" for path in logs)


def _require_slurm() -> None:
    missing = [tool for tool in SLURM_TOOLS if shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin")
               is None]
    if missing:
        message = f"Slurm tests need {missing} (apt-get install slurm-wlm munge)"
        if os.environ.get("LABKIT_SLURM_REQUIRED"):
            pytest.fail(message)
        pytest.skip(message)


def _sbin(tool: str) -> str:
    return shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin") or tool


@pytest.fixture(scope="session")
def slurm_cluster():
    _require_slurm()
    # Not under pytest's 0700 tmp dirs: munged wants every directory above its socket searchable by all.
    home = Path(tempfile.mkdtemp(prefix="labkit-slurm-"))
    home.chmod(0o755)
    key = home / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    node = socket.gethostname().split(".")[0]
    ctld_port, slurmd_port = free_port(), free_port()
    conf = home / "slurm.conf"
    conf.write_text(f"""\
ClusterName=labkit{ctld_port}
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={home / 'munge.sock'}
StateSaveLocation={home / 'state'}
SlurmdSpoolDir={home / 'spool'}
SlurmctldPidFile={home / 'slurmctld.pid'}
SlurmdPidFile={home / 'slurmd.pid'}
SlurmctldLogFile={home / 'slurmctld.log'}
SlurmdLogFile={home / 'slurmd.log'}
# No cgroups, no accounting: one test node in a container.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
NodeName={node} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
""")
    daemons: list[subprocess.Popen] = []

    def start(*command: str) -> None:
        with open(home / f"{Path(command[0]).name}.out", "ab") as out:  # the daemon keeps its own copy
            daemons.append(subprocess.Popen(list(command), stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL))

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SLURM_CONF", str(conf))  # sbatch, srun, sinfo ... and the jobs find this cluster
        try:
            start(_sbin("munged"), "-F", f"--socket={home / 'munge.sock'}", f"--key-file={key}",
                  f"--pid-file={home / 'munged.pid'}", f"--log-file={home / 'munged.log'}",
                  f"--seed-file={home / 'munged.seed'}")
            deadline = time.monotonic() + 30
            while not (home / "munge.sock").exists():
                assert time.monotonic() < deadline and daemons[0].poll() is None, (home / "munged.out").read_text()
                time.sleep(0.1)
            start(_sbin("slurmctld"), "-D", "-i", "-f", str(conf))
            start(_sbin("slurmd"), "-D", "-f", str(conf))
            cluster = SlurmCluster(node=node, home=home)
            deadline = time.monotonic() + 90
            while _sinfo_state(node) != "idle":
                assert time.monotonic() < deadline and all(d.poll() is None for d in daemons), \
                    f"node not idle: {_sinfo_state(node)!r}\n{cluster.logs()}"
                time.sleep(0.5)
            yield cluster
        finally:
            subprocess.run(["scancel", f"--user={os.getuid()}"], capture_output=True, timeout=30)
            deadline = time.monotonic() + 60  # KillWait (30 s) and the jobs' own ends
            while _squeue() and time.monotonic() < deadline:
                time.sleep(0.5)
            for daemon in reversed(daemons):  # slurmd, slurmctld, then munged
                daemon.terminate()
                try:
                    daemon.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait()
            shutil.rmtree(home, ignore_errors=True)


def _sinfo_state(node: str) -> str:
    done = subprocess.run(["sinfo", "-h", "-N", "-n", node, "-o", "%t"], capture_output=True, text=True, timeout=30)
    return done.stdout.strip()


def _squeue() -> list[str]:
    done = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=30)
    return done.stdout.split()


def job_info(job_id: str) -> dict[str, str]:
    """`scontrol show job` as key -> value (JobState, ExitCode, ...)."""
    text = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                          timeout=30).stdout
    return dict(part.split("=", 1) for part in text.split() if "=" in part)


def wait_job(job_id: str, timeout: float = JOB_TIMEOUT_S) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        info = job_info(job_id)
        if info.get("JobState") in FINAL_STATES:
            return info
        assert time.monotonic() < deadline, f"job {job_id} still {info.get('JobState')} after {timeout} s"
        time.sleep(0.5)


def export_slurm(job: Path, *args: str, steps: int = 4) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "labkit", "export", "--example", "zero3", "--world-size", "2", "--micro-batch", "8",
         "--steps", str(steps), "--hidden", "32", "--dataset-size", "256", "--launcher", "slurm", "--out", str(job),
         *args], cwd=REPO, capture_output=True, text=True)


def submit(job: Path, *options: str, env: dict[str, str] | None = None) -> str:
    """`sbatch job/launch.sh` from another directory, as a user on a login node would; the job id."""
    done = subprocess.run(["sbatch", "--parsable", *options, str(job / "launch.sh")], cwd="/", capture_output=True,
                          text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def job_output(job: Path, job_id: str) -> str:
    path = job / f"slurm-{job_id}.out"
    return path.read_text() if path.exists() else ""


# -- pure parts --------------------------------------------------------------------------
def test_slurm_task_counts_expand():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("4") == [4]


def test_srun_task_variables_become_torch_variables():
    task = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_ID": "0",
            "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NUM_NODES": "2",
            "MASTER_ADDR": "gpu01", "MASTER_PORT": "29500"}
    assert rank_env(task) == {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_SIZE": "2",
                              "CROSS_RANK": "1", "CROSS_SIZE": "2"}
    # The batch script has SLURM_PROCID too, but it is no task of a step: refused, not taken for rank 0.
    with pytest.raises(LauncherEnvError, match="neither by srun"):
        rank_env({k: v for k, v in task.items() if k != "SLURM_STEP_ID"})
    with pytest.raises(LauncherEnvError, match="MASTER_PORT not set"):
        rank_env({k: v for k, v in task.items() if k != "MASTER_PORT"})


def test_srun_exports_only_values_it_can_split():
    env = {"LABKIT_FAULT": "hang@rank0:step3,kill@rank1:step4", "PATH": "/venv/bin:/usr/bin", "MASTER_ADDR": "gpu01",
           "TORCH_EXTENSIONS_DIR": "/shared/ext", "NCCL_DEBUG": "INFO"}
    lines = deepspeed_env_text(env, "slurm").splitlines()
    # A comma would split srun's --export=ALL,K=V list; PATH is the job's own (srun's ALL).
    assert lines == ["MASTER_ADDR=gpu01", "NCCL_DEBUG=INFO", "TORCH_EXTENSIONS_DIR=/shared/ext"]
    assert "LABKIT_FAULT=hang@rank0:step3,kill@rank1:step4" in deepspeed_env_text(env, "pdsh")


def test_the_runner_starts_rank_entry_by_path_under_slurm(tmp_path: Path):
    """What labkit relies on in DeepSpeed's own SlurmRunner: given `--module <file>`, it runs the file
    with `python -u` (it never adds -m: multinode_runner.py:419-420 in 0.19.8) under `srun -n` with
    the whole environment (`--export=ALL`). Built by DeepSpeed's code, not by a copy of it."""
    from deepspeed.launcher import runner
    from deepspeed.launcher.multinode_runner import SlurmRunner

    from labkit.launch.launcher import build_command
    from labkit.launch.multinode import launcher_command

    (tmp_path / "hostfile").write_text("node-a slots=2\nnode-b slots=2\n")
    config = _config(tmp_path, world_size=4)
    argv, _ = build_command(config, tmp_path, master_port=29555, base_env={}, master_addr="node-a")
    argv = launcher_command(argv, "slurm", tmp_path / "labkit")
    args = runner.parse_args(argv[4:])
    pool = runner.fetch_hostfile(args.hostfile)
    slurm = SlurmRunner(args, runner.encode_world_info(pool), pool)
    command = slurm.get_cmd({}, {host: list(range(n)) for host, n in pool.items()})
    assert command[:4] == ["srun", "-n", "4", "--export=ALL"]
    assert command[4:] == [sys.executable, "-u", str(tmp_path / "labkit" / "rank" / "entry.py"),
                           "--run-dir", str(tmp_path)]
    assert args.force_multi and args.no_ssh_check


def _config(tmp_path: Path, **overrides):
    from labkit.core.config import RunConfig

    values = dict(example="zero3", world_size=2, micro_batch=8, steps=4, hidden=32, dataset_size=256,
                  hostfile=str(tmp_path / "hostfile"))
    return RunConfig(**{**values, **overrides})


@pytest.mark.parametrize(("options", "world_size", "field", "text"), [
    ({"time": "an hour"}, 2, "time", "not a Slurm time limit"),
    ({"nodes": 0}, 2, "nodes", "positive integer"),
    ({"nodes": 3}, 4, "nodes", "do not split evenly"),
    ({"gpus_per_node": 1}, 4, "gpus_per_node", "each rank needs its own GPU"),
    ({"partition": "gpu debug"}, 2, "partition", "not a Slurm partition name"),
    ({"account": "proj;rm"}, 2, "account", "not a Slurm account name"),
])
def test_bad_slurm_options_are_refused(tmp_path: Path, options, world_size, field, text):
    with pytest.raises(ConfigError) as error:
        SlurmOptions(**options).sbatch_lines(world_size, tmp_path, "labkit-zero3")
    assert error.value.field == field and text in str(error.value)


def test_sbatch_lines_defaults_and_options(tmp_path: Path):
    lines = SlurmOptions(nodes=2).sbatch_lines(8, tmp_path, "labkit-zero3")
    assert lines == ["#SBATCH --job-name=labkit-zero3", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4",
                     "#SBATCH --time=01:00:00", "#SBATCH --gres=gpu:4",  # one GPU per rank by default
                     f"#SBATCH --output={tmp_path}/slurm-%j.out", f"#SBATCH --chdir={tmp_path}"]
    lines = SlurmOptions(partition="debug", time="2-00:00:00", gpus_per_node=0, account="proj1").sbatch_lines(
        2, tmp_path, "j")
    assert "#SBATCH --partition=debug" in lines and "#SBATCH --time=2-00:00:00" in lines
    assert "#SBATCH --account=proj1" in lines and not any("--gres" in line for line in lines)


def test_world_size_against_the_allocation():
    check_slots(4, {"gpu01": 2, "gpu02": 2}, "the allocation", uniform=True)
    with pytest.raises(ConfigError, match="built for 4 ranks but the allocation holds 2"):
        check_slots(4, {"gpu01": 1, "gpu02": 1}, "the allocation", uniform=True)
    with pytest.raises(ConfigError, match="uneven ranks per node"):
        check_slots(4, {"gpu01": 3, "gpu02": 1}, "the allocation", uniform=True)


def test_missing_slurm_tools_are_refused(tmp_path: Path):
    (tmp_path / "srun").write_text("#!/bin/sh\n")
    (tmp_path / "srun").chmod(0o755)
    with pytest.raises(ConfigError) as error:
        check_tools("slurm", str(tmp_path))
    assert "needs sinfo and scontrol on the PATH" in str(error.value) and "slurm-client" in str(error.value)


def test_nodes_that_did_not_see_the_job_directory_are_named():
    assert nodes_not_seeing("gpu01 seen\ngpu03 seen\n", ["gpu01", "gpu02", "gpu03"]) == ["gpu02"]


@pytest.mark.slow
def test_export_refuses_a_slurm_job_where_it_cannot_be_submitted(tmp_path: Path):
    done = subprocess.run([sys.executable, "-m", "labkit", "export", "--example", "zero3", "--world-size", "2",
                           "--launcher", "slurm", "--out", str(tmp_path / "job")], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, "PATH": str(tmp_path)})
    assert done.returncode == 2 and "sbatch is not on the PATH" in done.stderr, done.stderr
    assert not (tmp_path / "job").exists()


@pytest.mark.slow
def test_export_refuses_a_hostfile_and_slurm_options_without_slurm(tmp_path: Path):
    (tmp_path / "hosts").write_text("a slots=2\n")
    done = export_slurm(tmp_path / "job", "--hostfile", str(tmp_path / "hosts"))
    assert done.returncode == 2 and "Slurm chooses the nodes" in done.stderr, done.stderr
    done = subprocess.run([sys.executable, "-m", "labkit", "export", "--example", "zero3", "--world-size", "2",
                           "--hostfile", str(tmp_path / "hosts"), "--partition", "gpu", "--out", str(tmp_path / "j2")],
                          cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 2 and "--partition: Slurm's options, for --launcher slurm" in done.stderr, done.stderr
    assert not (tmp_path / "job").exists() and not (tmp_path / "j2").exists()


# -- real jobs on the one-machine cluster -------------------------------------------------
@pytest.mark.slow
@pytest.mark.slurm
def test_sbatch_of_the_exported_job_trains_to_finished(slurm_cluster: SlurmCluster, tmp_path: Path):
    job = tmp_path / "job"
    export = export_slurm(job, "--partition", "debug", "--time", "15", "--gpus-per-node", "0")
    assert export.returncode == 0, export.stderr
    assert f"submit it with: sbatch {job / 'launch.sh'}" in export.stdout
    script = (job / "launch.sh").read_text()
    for line in ("#SBATCH --partition=debug", "#SBATCH --time=15", "#SBATCH --ntasks-per-node=2",
                 f"#SBATCH --output={job}/slurm-%j.out"):
        assert line in script
    assert "--gres" not in script and "--account" not in script
    job_id = submit(job)
    info = wait_job(job_id)
    output = job_output(job, job_id)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), (output, slurm_cluster.logs())
    assert output.splitlines()[-1] == "finished", output
    assert f"slurm-{job_id}.out (this output)" in output and f"scancel {job_id} stops every rank" in output
    # The allocation became the job's hostfile and master address when it started.
    assert (job / "hostfile").read_text().splitlines()[1:] == [f"{slurm_cluster.node} slots=2"]
    argv = json.loads((job / "launch.json").read_text())["argv"]
    assert argv[argv.index("--master_addr") + 1] == slurm_cluster.node and "srun -n 2" in \
        (job / "launcher.log").read_text()
    assert_trained(job, "slurm")  # ranks from srun's SLURM_PROCID / SLURM_LOCALID / SLURM_STEP_NUM_TASKS


@pytest.mark.slow
@pytest.mark.slurm
def test_scancel_ends_every_rank_and_the_summary_says_stopped(slurm_cluster: SlurmCluster, tmp_path: Path):
    job = tmp_path / "job"
    assert export_slurm(job, "--partition", "debug", "--gpus-per-node", "0", steps=100000).returncode == 0
    job_id = submit(job)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    # The live progress, read from the job directory while the job runs: both ranks' steps.
    while min(len(rank.trace("samples_per_s")[0]) for rank in load_series(job)) == 0:
        assert time.monotonic() < deadline and job_info(job_id)["JobState"] in ("PENDING", "RUNNING"), \
            (job_output(job, job_id), slurm_cluster.logs())
        time.sleep(0.5)
    assert job_info(job_id)["JobState"] == "RUNNING"
    subprocess.run(["scancel", job_id], check=True, timeout=30)
    info = wait_job(job_id, timeout=120)
    assert info["JobState"] == "CANCELLED", info
    summary = json.loads((job / "summary.json").read_text())
    assert summary["status"] == "stopped", (summary["cause"], (job / "supervisor.log").read_text())
    log = (job / "supervisor.log").read_text()
    assert "every process of the run has ended" in log, log
    assert not run_processes(job)
    assert "stopped" in job_output(job, job_id)


@pytest.mark.slow
@pytest.mark.slurm
def test_a_rank_killed_inside_the_allocation_is_named(slurm_cluster: SlurmCluster, tmp_path: Path):
    job = tmp_path / "job"
    assert export_slurm(job, "--partition", "debug", "--gpus-per-node", "0", steps=400).returncode == 0
    # sbatch carries the submitting environment to the job, srun to the ranks: rank 1 SIGKILLs itself at step 3.
    job_id = submit(job, env={**os.environ, "LABKIT_FAULT": "kill@rank1:step3"})
    info = wait_job(job_id)
    output = job_output(job, job_id)
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "1:0"), output
    summary = json.loads((job / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["failed_rank"] == 1, summary["cause"]
    assert summary["cause"].startswith(f"rank 1 on node {slurm_cluster.node}: killed by SIGKILL"), summary["cause"]
    assert summary["cause"] in output
    assert not run_processes(job)


@pytest.mark.slow
@pytest.mark.slurm
def test_a_job_is_refused_before_anything_starts(slurm_cluster: SlurmCluster, tmp_path: Path):
    job = tmp_path / "job"
    assert export_slurm(job, "--partition", "debug", "--gpus-per-node", "0").returncode == 0
    # Run outside an allocation (as one would a pdsh job): refused, with the line that submits it.
    outside = subprocess.run([str(job / "launch.sh")], capture_output=True, text=True, timeout=60,
                             env={k: v for k, v in os.environ.items() if not k.startswith("SLURM_JOB")})
    assert outside.returncode == 2 and f"submit it: sbatch {job}/launch.sh" in outside.stderr, outside.stderr
    # Submitted with one task per node where the job was built for two: sbatch's own option wins over
    # the #SBATCH line, and the job ends with exit 2 before its supervisor starts.
    job_id = submit(job, "--ntasks-per-node=1")
    info = wait_job(job_id)
    output = job_output(job, job_id)
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "2:0"), output
    assert f"built for 2 ranks but Slurm job {job_id}'s allocation holds 1" in output, output
    assert not (job / "supervisor.log").exists() and not list(job.glob("rank*"))

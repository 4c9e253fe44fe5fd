"""Multi-node runs for real: DeepSpeed's pdsh launcher over real ssh to two "nodes" on loopback.

The fixture starts sshd of its own on 127.0.0.1 and 127.0.0.2 (a spare port, a host key and a
user key generated into a tmp dir) and a third "node", 127.0.0.3, whose sshd runs in a mount
namespace of its own with a tmpfs over one directory: a node that does not share that
directory. The nodes are ssh aliases (`lk<port>n0` ...) in a test-owned ssh config that
~/.ssh/config includes until teardown, so DeepSpeed's `ssh <host> hostname` check, pdsh and
labkit's own ssh all reach them, and the alias -> address resolution is exercised too.
Few real runs (each ~35 s here): finish, remote SIGKILL, Stop, the exported job.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from labkit.core.config import ConfigError, RunConfig
from labkit.launch.launcher import free_port
from labkit.launch.multinode import (
    deepspeed_env_text,
    hostname_from_ssh_config,
    pdsh_failed_hosts,
    rank_hosts,
    remote_stop_script,
    run_process_pattern,
)
from labkit.launch.run import Run
from labkit.launch.summary import rank_records
from labkit.ui.dashboard import load_series
from tests.conftest import REPO, run_processes

pytestmark = pytest.mark.multinode
SSHD = "/usr/sbin/sshd"
RUN_TIMEOUT_S = 300  # two DeepSpeed "nodes" on a loaded 2-core machine


@dataclass
class Cluster:
    nodes: list[str]          # ssh aliases of 127.0.0.1, 127.0.0.2
    isolated: str             # alias of 127.0.0.3, which does not see `hidden`
    hidden: Path              # a directory only the first two nodes see
    sshd_log: Path

    def hostfile(self, path: Path, hosts: list[str], slots: int = 1) -> str:
        path.write_text("".join(f"{host} slots={slots}\n" for host in hosts))
        return str(path)


def _require_tools() -> None:
    missing = [tool for tool in ("pdsh", "ssh", "ssh-keygen", "unshare") if shutil.which(tool) is None]
    missing += [SSHD] if not os.access(SSHD, os.X_OK) else []
    if missing:
        message = f"multi-node tests need {missing} (apt-get install pdsh openssh-server)"
        if os.environ.get("LABKIT_MULTINODE_REQUIRED"):
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    _require_tools()
    home = tmp_path_factory.mktemp("cluster")
    for key in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(home / key)], check=True)
    (home / "authorized_keys").write_text((home / "user_key.pub").read_text())
    port = free_port()
    addresses = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    aliases = [f"lk{port}n{i}" for i in range(3)]
    host_key = (home / "host_key.pub").read_text().split()
    (home / "known_hosts").write_text(
        ",".join(f"[{a}]:{port}" for a in addresses) + f" {host_key[0]} {host_key[1]}\n")
    hidden = home / "hidden"
    hidden.mkdir()
    sshds = []
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    for name, listen in (("shared", addresses[:2]), ("isolated", addresses[2:])):
        config = home / f"sshd_{name}.conf"
        config.write_text(f"Port {port}\n" + "".join(f"ListenAddress {a}\n" for a in listen) + f"""\
HostKey {home / 'host_key'}
PidFile {home / f'sshd_{name}.pid'}
AuthorizedKeysFile {home / 'authorized_keys'}
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
MaxStartups 100
MaxSessions 100
LogLevel VERBOSE
""")
        command = [SSHD, "-D", "-e", "-f", str(config)]
        if name == "isolated":
            # Its own mount namespace, where `hidden` is an empty tmpfs: a node without that directory.
            command = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                       f'mount -t tmpfs none "{hidden}" && exec "$@"', "sh", *command]
        with open(home / f"sshd_{name}.log", "ab") as log:  # the sshd keeps its own copy of the descriptor
            sshds.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
    (home / "ssh_config").write_text("".join(f"""\
Host {alias}
    HostName {address}
    Port {port}
    User root
    IdentityFile {home / 'user_key'}
    IdentitiesOnly yes
    UserKnownHostsFile {home / 'known_hosts'}
    StrictHostKeyChecking yes
    BatchMode yes
""" for alias, address in zip(aliases, addresses, strict=True)))
    user_config = Path.home() / ".ssh" / "config"
    user_config.parent.mkdir(mode=0o700, exist_ok=True)
    include = f"Include {home / 'ssh_config'}\n"
    existed = user_config.exists()
    # At the top: an Include after a `Host` block would belong to that block.
    user_config.write_text(include + (user_config.read_text() if existed else ""))
    try:
        deadline = time.monotonic() + 20
        for alias in aliases:
            while subprocess.run(["ssh", alias, "true"], capture_output=True).returncode != 0:
                assert time.monotonic() < deadline, f"sshd on {alias} did not come up: " + \
                    "".join(p.read_text() for p in home.glob("sshd_*.log"))
                time.sleep(0.2)
        yield Cluster(nodes=aliases[:2], isolated=aliases[2], hidden=hidden, sshd_log=home / "sshd_shared.log")
    finally:
        text = user_config.read_text().replace(include, "", 1)
        if text or existed:
            user_config.write_text(text)
        else:
            user_config.unlink()
        for sshd in sshds:
            sshd.terminate()
            sshd.wait(timeout=10)


def tiny(hostfile: str, **overrides) -> RunConfig:
    values = dict(example="zero3", world_size=2, micro_batch=8, steps=4, hidden=32, dataset_size=256,
                  hostfile=hostfile, heartbeat_s=120.0, startup_timeout_s=240.0)
    return RunConfig(**{**values, **overrides})


# -- pure parts --------------------------------------------------------------------------
def test_deepspeed_env_carries_what_remote_ranks_need():
    env = {"PATH": "/venv/bin:/usr/bin", "TORCH_EXTENSIONS_DIR": "/cache", "DS_ACCELERATOR": "cuda",
           "NCCL_DEBUG": "INFO", "LABKIT_FAULT": "kill@rank1:step3", "HOME": "/root", "BAD": "x",
           "NCCL_WEIRD": 'has "quotes"'}
    lines = deepspeed_env_text(env).splitlines()
    assert lines == ["DS_ACCELERATOR=cuda", "LABKIT_FAULT=kill@rank1:step3", "NCCL_DEBUG=INFO",
                     "PATH=/venv/bin:/usr/bin", "TORCH_EXTENSIONS_DIR=/cache"]


def test_ranks_are_numbered_host_by_host(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=2\n# comment\nb slots=1\n")
    assert rank_hosts(hostfile) == ["a", "a", "b"]


def test_nodes_pdsh_saw_fail_are_found_in_the_launcher_log():
    log = "node1: [INFO] spawned\npdsh@login: node2: ssh exited with exit code 255\nnode1: ssh exited\n"
    assert pdsh_failed_hosts(log) == {"node2": 255}


def test_ssh_alias_resolves_to_its_hostname():
    assert hostname_from_ssh_config("user root\nhostname 10.0.0.5\nport 22\n") == "10.0.0.5"
    assert hostname_from_ssh_config("user root\n") is None


@pytest.mark.slow
def test_stop_pattern_matches_only_this_runs_processes(tmp_path):
    run_dir = tmp_path / "run.1"
    pattern = run_process_pattern(run_dir)
    ours = [f"/v/bin/python -u -m deepspeed.launcher.launch --world_info=x --enable_each_rank_log={run_dir}/logs "
            f"labkit.rank.guard --run-dir {run_dir}",
            f"/v/bin/python -u -m labkit.rank.guard --local_rank=0 --run-dir {run_dir}",
            f"/v/bin/python -u -m labkit.rank.worker --local_rank=0 --run-dir {run_dir}"]
    not_ours = [f"/v/bin/python -u -m deepspeed.launcher.runner --hostfile h --module labkit.rank.guard "
                f"--run-dir {run_dir}",
                f"/v/bin/python -m labkit.launch.supervisor {run_dir} --parent-pid 1",
                "/v/bin/python -u -m deepspeed.launcher.launch --world_info=y labkit.rank.guard "
                "--run-dir /other",
                f"/v/bin/python -u -m labkit.rank.worker --run-dir {tmp_path / 'run01'}",  # `.` is not a wildcard
                f"bash -c {remote_stop_script(run_dir)}"]  # the shell that runs pkill
    grep = subprocess.run(["grep", "-E", "-e", pattern], input="\n".join(ours + not_ours) + "\n",
                          capture_output=True, text=True)
    assert grep.stdout.splitlines() == ours


def _export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "labkit", "export", "--example", "zero3", *args],
                          cwd=REPO, capture_output=True, text=True)


@pytest.mark.slow
def test_export_on_a_login_node_writes_a_self_contained_job(tmp_path):
    job = tmp_path / "job"
    (tmp_path / "hosts").write_text("gpu1 slots=8\ngpu2 slots=8\n")
    # fp16 on this GPU-less machine: refused for a run here, not for a job for the cluster.
    done = _export("--world-size", "16", "--precision", "fp16", "--warmup-steps", "5", "--lr-scaling", "linear",
                   "--micro-batch", "4", "--steps", "200", "--hostfile", str(tmp_path / "hosts"), "--out", str(job))
    assert done.returncode == 0, done.stderr
    ds_config = json.loads((job / "ds_config.json").read_text())
    peak = 1e-3 * (16 * 4) / 64
    assert ds_config["scheduler"] == {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.0, "warmup_max_lr": peak, "warmup_num_steps": 5, "warmup_type": "linear"}}
    assert ds_config["steps_per_print"] == 20 and ds_config["fp16"]["enabled"]
    assert (job / "labkit" / "rank" / "worker.py").is_file()
    assert (job / "hostfile").read_text().startswith("gpu1 slots=8")
    assert f"PATH={Path(sys.executable).parent}:" in (job / ".deepspeed_env").read_text()
    script = (job / "launch.sh").read_text()
    assert f'export PATH={Path(sys.executable).parent}:"$PATH"' in script
    launch = json.loads((job / "launch.json").read_text())
    assert launch["argv"][4:6] == ["--launcher", "pdsh"] and "PATH" not in launch["env"]
    assert launch["argv"][launch["argv"].index("--hostfile") + 1] == str(job / "hostfile")
    # Again, with the job's own hostfile (was shutil.SameFileError) and another launcher.
    again = _export("--world-size", "16", "--hostfile", str(job / "hostfile"), "--launcher", "openmpi",
                    "--out", str(job))
    assert again.returncode == 0, again.stderr
    assert json.loads((job / "launch.json").read_text())["argv"][4:6] == ["--launcher", "openmpi"]
    assert "--hostfile" in _export("--world-size", "2", "--out", str(tmp_path / "x")).stderr


@pytest.mark.slow
def test_master_addr_is_the_first_hosts_address_not_its_ssh_alias(cluster: Cluster, tmp_path: Path):
    from labkit.launch.launcher import build_command

    hostfile = cluster.hostfile(tmp_path / "hostfile", cluster.nodes)
    argv, _ = build_command(tiny(hostfile), tmp_path, master_port=29500, base_env={})
    assert argv[argv.index("--master_addr") + 1] == "127.0.0.1"


# -- real runs on the loopback cluster ---------------------------------------------------
@pytest.mark.slow
def test_run_on_two_nodes_records_every_rank(cluster: Cluster, tmp_path: Path):
    hostfile = cluster.hostfile(tmp_path / "hostfile", cluster.nodes)
    run = Run(tiny(hostfile), out=tmp_path / "run").start()
    assert run.wait(timeout=RUN_TIMEOUT_S) == "finished", (run.cause, (run.run_dir / "launcher.log").read_text())
    records = rank_records(run.run_dir, 2)
    assert sorted(records) == [0, 1]
    for rank in (0, 1):
        assert [r["step"] for r in records[rank] if r.get("event") == "step"] == [1, 2, 3, 4]
        assert records[rank][-1]["event"] == "done"
    # Each rank came through its own node's ssh session: pdsh prefixes each node's output.
    launcher_log = (run.run_dir / "launcher.log").read_text()
    assert all(f"{node}: " in launcher_log for node in cluster.nodes), launcher_log
    env_file = (run.run_dir / ".deepspeed_env").read_text()
    assert f"PATH={Path(sys.executable).parent}:" in env_file and "TORCH_EXTENSIONS_DIR=" in env_file
    # The live charts' data source sees both ranks' steps.
    series = load_series(run.run_dir)
    assert [list(s.trace("samples_per_s")[0]) for s in series] == [[1, 2, 3, 4], [1, 2, 3, 4]]


@pytest.mark.slow
def test_rank_killed_on_second_node_ends_the_run_naming_cause_and_node(cluster: Cluster, tmp_path: Path):
    hostfile = cluster.hostfile(tmp_path / "hostfile", cluster.nodes)
    run = Run(tiny(hostfile, steps=400), out=tmp_path / "run", env={"LABKIT_FAULT": "kill@rank1:step3"}).start()
    status = run.wait(timeout=RUN_TIMEOUT_S)
    assert status == "failed", (status, run.cause)
    assert run.cause.startswith(f"rank 1 on node {cluster.nodes[1]}: killed by SIGKILL"), run.cause
    assert "OOM killer" not in run.cause  # this machine's OOM counter says nothing about that node
    killed_at = (run.run_dir / "rank1.exit").stat().st_mtime
    ended_at = json.loads((run.run_dir / "status.json").read_text())["finished_at"]
    assert ended_at - killed_at < 10.0, (ended_at - killed_at, (run.run_dir / "supervisor.log").read_text())
    assert not run_processes(run.run_dir)


@pytest.mark.slow
def test_stop_ends_this_run_on_every_node_and_spares_other_deepspeed_launches(cluster: Cluster, tmp_path: Path):
    # Another DeepSpeed launch of the same user on the same host, by the command line DeepSpeed's
    # own Stop (`pkill -f "<python> -u -m deepspeed.launcher.launch"`) would kill.
    unrelated = subprocess.Popen([f"{sys.executable} -u -m deepspeed.launcher.launch --world_info=unrelated",
                                  "-c", "import time; time.sleep(600)"], executable=sys.executable)
    try:
        hostfile = cluster.hostfile(tmp_path / "hostfile", cluster.nodes)
        run = Run(tiny(hostfile, steps=100000), out=tmp_path / "run").start()
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not all(any(r.get("event") == "step" for r in rank) for rank in run.records().values()) \
                or len(run.records()) < 2:
            assert time.monotonic() < deadline and not run.done, run.cause
            time.sleep(0.5)
        assert run.stop() == "stopped"
        time.sleep(1.0)  # DeepSpeed's own stop (the runner's SIGTERM handler) takes about that long
        assert unrelated.poll() is None, "Stop killed another DeepSpeed launch of this user"
        log = (run.run_dir / "supervisor.log").read_text()
        for node in cluster.nodes:
            assert f"{node}: none of this run's processes is left" in log, log
        assert "every process of the run has ended" in log, log
        assert not run_processes(run.run_dir)
        remote = subprocess.run(["ssh", cluster.nodes[1], f"pgrep -af {run.run_dir}/ | grep -v pgrep"],
                                capture_output=True, text=True)
        assert remote.stdout.strip() == "", remote.stdout
    finally:
        unrelated.kill()
        unrelated.wait()


@pytest.mark.slow
def test_run_dir_a_node_cannot_see_is_refused_before_launch(cluster: Cluster, tmp_path: Path):
    hostfile = cluster.hostfile(tmp_path / "hostfile", [cluster.nodes[0], cluster.isolated])
    out = cluster.hidden / "run"
    with pytest.raises(ConfigError) as error:
        Run(tiny(hostfile), out=out).start()
    message = str(error.value)
    assert f"{cluster.isolated}: does not see" in message and "not visible on every node" in message, message
    assert cluster.nodes[0] not in message
    assert not (out / "launch.json").exists() and not (out / "supervisor.log").exists()
    assert list(out.iterdir()) == []  # the nonce is gone too


@pytest.mark.slow
def test_exported_pdsh_job_runs_unchanged_on_the_cluster(cluster: Cluster, tmp_path: Path):
    hostfile = cluster.hostfile(tmp_path / "hostfile", cluster.nodes)
    job = tmp_path / "job"
    export = subprocess.run(
        [sys.executable, "-m", "labkit", "export", "--example", "zero3", "--world-size", "2", "--micro-batch", "8",
         "--steps", "4", "--hidden", "32", "--dataset-size", "256", "--warmup-steps", "2", "--precision", "fp16",
         "--hostfile", hostfile, "--launcher", "pdsh", "--out", str(job), "--master-port", str(free_port())],
        cwd=REPO, capture_output=True, text=True)
    # fp16 is refused by this CPU machine's runs, not by an export for a cluster.
    assert export.returncode == 0, export.stderr
    ds_config = json.loads((job / "ds_config.json").read_text())
    assert ds_config["scheduler"]["type"] == "WarmupLR"
    assert ds_config["scheduler"]["params"]["warmup_num_steps"] == 2 and ds_config["steps_per_print"] == 1
    # This machine has no fp16: run the job as exported but for its precision.
    config = json.loads((job / "config.json").read_text())
    config["precision"] = "fp32"
    (job / "config.json").write_text(json.dumps(config))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = "/usr/local/bin:/usr/bin:/bin"  # a user's plain PATH: the script must find the rest
    job_run = subprocess.run([str(job / "launch.sh")], cwd="/", env=env, capture_output=True, text=True,
                             timeout=RUN_TIMEOUT_S)
    supervisor_log = (job / "supervisor.log").read_text() if (job / "supervisor.log").exists() else ""
    assert job_run.returncode == 0, (job_run.stdout, job_run.stderr, supervisor_log)
    assert job_run.stdout.strip() == "finished"
    records = rank_records(job, 2)
    assert all(records[rank][-1]["event"] == "done" for rank in (0, 1))
    assert not run_processes(job)

"""GPU leases: a second run on GPUs a live run holds is refused before it starts.

The locks are real flocks and the hand-off to a supervisor is a real child process; only the
GPUs are absent here, so `Run._lease_plan` is given a CUDA `Devices` description, and CPU runs lease
emulated slots (`LABKIT_EMULATED_DEVICES`) through the same code.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from labkit.core.config import ConfigError, RunConfig
from labkit.launch import device_lease
from labkit.launch.launcher import build_command
from labkit.launch.run import Run
from labkit.runtime.devices import Devices


def test_candidate_devices_follow_the_visible_devices():
    assert device_lease.visible_ids(4, None) == ["0", "1", "2", "3"]
    assert device_lease.visible_ids(4, "3, 1,0") == ["3", "1", "0"]
    assert device_lease.visible_ids(8, "") == []  # nothing visible means nothing, not everything


@pytest.mark.parametrize("visible", ["GPU-8f3a1b2c-0d4e-4f5a-9b6c-7d8e9f0a1b2c",
                                     "0,MIG-4b2d5f6a-1c3e-5a7b-9d0f-2e4a6c8e0b1d", "MIG-GPU-1/0/0"])
def test_uuid_and_mig_visible_devices_are_refused_with_a_clear_error_before_launch(visible):
    """DeepSpeed's runner does int() on each id and crashes after labkit wrote the run."""
    with pytest.raises(ConfigError) as refused:
        device_lease.visible_ids(4, visible, "CUDA_VISIBLE_DEVICES")
    assert refused.value.field == "CUDA_VISIBLE_DEVICES" and "nvidia-smi -L" in str(refused.value)


def test_a_lease_takes_free_devices_not_always_the_first(tmp_path):
    """On an 8-GPU node a second 1-GPU run gets another GPU, not a refusal."""
    candidates = [str(i) for i in range(8)]
    first_ids, first = device_lease.take_free("cuda", candidates, 1, "run runs/first", tmp_path)
    try:
        second_ids, second = device_lease.take_free("cuda", candidates, 1, "run runs/second", tmp_path)
        assert first_ids == ["0"] and second_ids == ["1"]
        device_lease.release(second)
        with pytest.raises(device_lease.DevicesBusy, match="runs/first"):
            device_lease.take_free("cuda", candidates, 8, "run runs/third", tmp_path)
        with pytest.raises(ConfigError, match="only 8 are visible"):
            device_lease.take_free("cuda", candidates, 9, "run runs/fourth", tmp_path)
    finally:
        device_lease.release(first)


def test_lease_directory_must_be_sticky_and_owned_by_root_or_the_user(tmp_path):
    """In a world-writable directory without the sticky bit anyone can delete a live lease."""
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)
    with pytest.raises(device_lease.DevicesBusy, match="sticky"):
        device_lease.take("cuda", ["0"], "run", loose)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    os.chmod(foreign, 0o1777)
    if os.getuid() == 0:
        os.chown(foreign, 65534, 65534)  # another user's directory
        with pytest.raises(device_lease.DevicesBusy, match="owned by root or by you"):
            device_lease.take("cuda", ["0"], "run", foreign)
    fresh = tmp_path / "fresh"
    device_lease.release(device_lease.take("cuda", ["0"], "run", fresh))  # created sticky: accepted
    assert os.stat(fresh).st_mode & 0o1777 == 0o1777


NOBODY = 65534  # the lease code runs as this user in a child process; root's files are "another user's"
AS_NOBODY_CODE = """
import json, sys
from labkit.launch import device_lease

leases, foreign_dir = sys.argv[1], sys.argv[2]
calls = {
    "take 0": lambda: device_lease.take("cuda", ["0"], "run of nobody", leases),
    "take_free 0": lambda: device_lease.take_free("cuda", ["0"], 1, "run of nobody", leases),
    "take_free 0,1": lambda: device_lease.take_free("cuda", ["0", "1"], 1, "run of nobody", leases)[0],
    "take 2": lambda: len(device_lease.take("cuda", ["2"], "run of nobody", leases)),
    "foreign dir": lambda: device_lease.take("cuda", ["0"], "run of nobody", foreign_dir),
}
out = {}
for name, call in calls.items():
    try:
        out[name] = ["ok", call()]
    except Exception as exc:
        out[name] = [type(exc).__name__, isinstance(exc, device_lease.DevicesBusy), str(exc)]
print(json.dumps(out))
"""


def _as_nobody(*argv: str) -> subprocess.CompletedProcess:
    repo = str(Path(device_lease.__file__).resolve().parents[2])
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                           sys.executable, *argv], capture_output=True, text=True, cwd=repo, timeout=120,
                          env={**os.environ, "PYTHONPATH": repo, "HOME": "/nonexistent"})


@pytest.mark.slow
def test_another_users_lease_file_is_refused_by_name_not_with_a_permission_error():
    """A lock file another user left (root's, mode 0644) in the shared sticky lease directory
    cannot be opened for writing: the lease code must refuse with DevicesBusy naming the file's owner, not
    raise a raw PermissionError, and take_free must go on to the next device. Run as user nobody."""
    if os.getuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run the lease code as another user")
    probe = _as_nobody("-c", "import labkit.launch.device_lease")
    if probe.returncode != 0:
        pytest.skip(f"user nobody cannot import labkit here (repo or venv unreadable): "
                    f"{(probe.stderr.strip().splitlines() or ['?'])[-1]}")
    top = Path(tempfile.mkdtemp(prefix="labkit-lease-test-"))  # in the temp dir: nobody can reach it
    try:
        os.chmod(top, 0o755)
        leases = top / "leases"
        leases.mkdir()
        os.chmod(leases, 0o1777)  # as DEFAULT_LEASE_DIR: root's, sticky, world-writable
        stale = leases / "cuda0.lock"
        stale.write_text("run runs/of-root")
        os.chmod(stale, 0o644)  # root's stale lease file: nobody may not write it
        shared = leases / "cuda2.lock"
        shared.write_text("")
        os.chmod(shared, 0o666)  # root's lease file as labkit leaves it: anybody may lease through it
        foreign = top / "foreign"
        foreign.mkdir()
        os.chmod(foreign, 0o1777)
        os.chown(foreign, NOBODY - 1, NOBODY - 1)  # a third user's directory: leases there mean nothing
        result = _as_nobody("-c", AS_NOBODY_CODE, str(leases), str(foreign))
        assert result.returncode == 0, result.stderr
        out = json.loads(result.stdout)
        for name in ("take 0", "take_free 0"):
            kind, busy, message = out[name]
            assert busy, f"{name}: {kind}: {message}"  # DevicesBusy (a ConfigError), not PermissionError
            assert str(stale) in message and "uid 0" in message, message
        assert out["take_free 0,1"] == ["ok", ["1"]]  # the stale file blocks device 0 only
        assert out["take 2"] == ["ok", 1]  # opened without O_CREAT: fine under fs.protected_regular too
        kind, busy, message = out["foreign dir"]
        assert busy and "owned by root or by you" in message, message
        assert stale.read_text() == "run runs/of-root"
        assert os.stat(leases / "cuda1.lock").st_uid == NOBODY
    finally:
        shutil.rmtree(top)


def test_second_lease_on_a_held_device_is_refused_naming_the_holder(tmp_path):
    held = device_lease.take("cuda", ["0", "1"], "run runs/first", tmp_path)
    try:
        with pytest.raises(device_lease.DevicesBusy) as refused:
            device_lease.take("cuda", ["1", "2"], "run runs/second", tmp_path)
        assert isinstance(refused.value, ConfigError) and refused.value.field == "world_size"
        assert "cuda device 1" in str(refused.value) and "runs/first" in str(refused.value)
        # All or nothing: the refused attempt did not keep device 2.
        device_lease.release(device_lease.take("cuda", ["2"], "run runs/third", tmp_path))
    finally:
        device_lease.release(held)
    device_lease.release(device_lease.take("cuda", ["0", "1"], "run runs/fourth", tmp_path))


@pytest.mark.slow
def test_lease_lives_in_the_process_it_was_handed_to_and_dies_with_it(tmp_path):
    fds = device_lease.take("cuda", ["0"], "run runs/handed-over", tmp_path)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], pass_fds=fds)
    try:
        device_lease.release(fds)  # as Run.start() does once the supervisor holds its copy
        with pytest.raises(device_lease.DevicesBusy, match="handed-over"):
            device_lease.take("cuda", ["0"], "run runs/next", tmp_path)
    finally:
        child.send_signal(signal.SIGKILL)  # a SIGKILLed supervisor must not leave the GPU leased
        child.wait()
    device_lease.release(device_lease.take("cuda", ["0"], "run runs/next", tmp_path))


def test_run_leases_the_gpus_it_launches_on_but_not_cpu_ranks(tmp_path, monkeypatch):
    monkeypatch.setattr(device_lease, "DEFAULT_LEASE_DIR", tmp_path)
    gpus = Devices(accelerator="cuda", device_count=4, max_ranks=4, backend="nccl", bf16=True, fp16=True,
                   device_name="NVIDIA H100", total_memory_bytes=80 << 30)
    config = RunConfig(example="zero3", world_size=2, max_world_size=4)
    kind, candidates, count = Run(config)._lease_plan(gpus, {"CUDA_VISIBLE_DEVICES": "2,3"})
    assert (kind, candidates, count) == ("cuda", ["2", "3"], 2)
    ids, first = device_lease.take_free(kind, candidates, count, "run runs/first")
    # ... and those are the devices the launch command gives the ranks.
    _, env = build_command(config, tmp_path / "run", master_port=29500, base_env={}, accelerator="cuda",
                           device_ids=ids)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    try:
        assert sorted(p.name for p in tmp_path.iterdir()) == ["cuda2.lock", "cuda3.lock"]
        with pytest.raises(device_lease.DevicesBusy, match="cuda device 2"):
            device_lease.take_free(*Run(config)._lease_plan(gpus, {"CUDA_VISIBLE_DEVICES": "2,3"}), "second")
        other_ids, other = device_lease.take_free(*Run(config)._lease_plan(gpus, {}), "third")
        assert other_ids == ["0", "1"]
        device_lease.release(other)
    finally:
        device_lease.release(first)
    cpu = Devices(accelerator="cpu", device_count=1, max_ranks=2, backend="gloo", bf16=True, fp16=False,
                  device_name="cpu", total_memory_bytes=24 << 30)
    assert Run(config)._lease_plan(cpu, {})[2] == 0  # CPU ranks share cores; runs may overlap
    assert Run(config)._lease_plan(cpu, {device_lease.EMULATED_DEVICES_ENV: "3"}) == ("emulated", ["0", "1", "2"], 2)


def test_a_leased_port_is_not_handed_out_again(tmp_path):
    port, fds = device_lease.take_port(tmp_path)
    try:
        with pytest.raises(device_lease.DevicesBusy):
            device_lease.take("port", [str(port)], "another run", tmp_path)
        others = [device_lease.take_port(tmp_path) for _ in range(5)]
        assert port not in {p for p, _ in others}
        for _, held in others:
            device_lease.release(held)
    finally:
        device_lease.release(fds)


def test_lease_files_are_not_followed_through_symlinks(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    leases = tmp_path / "leases"
    leases.mkdir()
    (leases / "cuda0.lock").symlink_to(victim)
    with pytest.raises(OSError):
        device_lease.take("cuda", ["0"], "run", leases)
    assert victim.read_text() == "precious"


@pytest.mark.slow
def test_sweep_waits_for_the_lease_of_the_run_before(tmp_path, monkeypatch):
    """A run whose ranks all recorded `done` still holds its devices until its supervisor
    exits. The sweep launched the next point at once and `Run.start()` raised DevicesBusy: `labkit answer`
    stopped after one point on any GPU machine. CPU ranks lease emulated slots here, through the same code."""
    from labkit.study.sweep import Sweep

    monkeypatch.setattr(device_lease, "DEFAULT_LEASE_DIR", tmp_path / "leases")
    monkeypatch.setenv(device_lease.EMULATED_DEVICES_ENV, "2")
    points = [RunConfig(example="zero3", stage=stage, world_size=2, micro_batch=8, hidden=32, steps=2,
                        dataset_size=256, census_every=100) for stage in (0, 1, 2)]
    table = Sweep(points, tmp_path / "sweep", parallel=1, progress=False, retries=0).run()
    assert list(table["status"]) == ["finished"] * 3, table.to_dict("records")


SWEEP_POINT = dict(example="zero3", world_size=2, micro_batch=8, hidden=32, steps=2, dataset_size=256,
                   census_every=100)


def test_the_supervisors_slow_exit_fault_is_its_own():
    from labkit.rank.faults import SUPERVISOR, Fault, FaultHooks, FaultSpecError, parse_faults, supervisor_exit_delay_s

    spec = "raise@rank1:step5,slowexit@supervisor:7"
    assert parse_faults(spec) == [Fault("raise", 1, 5), Fault("slowexit", SUPERVISOR, 7)]
    assert supervisor_exit_delay_s(spec) == 7.0 and supervisor_exit_delay_s("raise@rank0:3") == 0.0
    assert FaultHooks(0, spec).faults == [] and len(FaultHooks(1, spec).faults) == 1  # ranks never see it
    for wrong in ("slowexit@rank0:3", "raise@supervisor:3"):
        with pytest.raises(FaultSpecError, match="supervisor"):
            parse_faults(wrong)
    assert supervisor_exit_delay_s("slowexit@rank0:3") == 0.0  # the ranks name a bad spec; the supervisor goes on


def _slow_supervisors(tmp_path, monkeypatch, exit_delay_s: int) -> None:
    """CPU runs lease 2 emulated slots; every supervisor sleeps `exit_delay_s` after its summary, holding them
    (the fault hook), and Run.wait() gives it 1 s instead of 10 (the test's time, not the behaviour)."""
    from labkit.launch import run as run_module

    monkeypatch.setattr(device_lease, "DEFAULT_LEASE_DIR", tmp_path / "leases")
    monkeypatch.setenv(device_lease.EMULATED_DEVICES_ENV, "2")
    monkeypatch.setenv("LABKIT_FAULT", f"slowexit@supervisor:{exit_delay_s}")
    monkeypatch.setattr(run_module, "SUPERVISOR_EXIT_WAIT_S", 1.0)


@pytest.mark.slow
def test_sweep_waits_for_a_supervisor_slower_than_wait(tmp_path, monkeypatch):
    """The sweep dropped a done run once Run.wait() stopped waiting for its supervisor
    (10 s); a slower supervisor still held the devices and the next point's start was refused (DevicesBusy)."""
    from labkit.study.sweep import Sweep

    _slow_supervisors(tmp_path, monkeypatch, exit_delay_s=6)
    points = [RunConfig(stage=stage, **SWEEP_POINT) for stage in (1, 2)]
    table = Sweep(points, tmp_path / "sweep", parallel=1, progress=False, retries=0).run()
    assert list(table["status"]) == ["finished"] * 2, table.to_dict("records")
    # It returns once its last run's lease is free too: the next sweep's first start is not refused.
    device_lease.release(device_lease.take("emulated", ["0", "1"], "the next sweep", tmp_path / "leases"))


@pytest.mark.slow
def test_sweep_names_a_run_whose_supervisor_keeps_the_lease(tmp_path, monkeypatch):
    """Bounded: a supervisor that never lets go is named (run directory, PID), finished points are kept."""
    import psutil

    from labkit.study import sweep as sweep_module

    _slow_supervisors(tmp_path, monkeypatch, exit_delay_s=120)
    monkeypatch.setattr(sweep_module, "LEASE_RELEASE_TIMEOUT_S", 2.0)
    points = [RunConfig(stage=1, **SWEEP_POINT), RunConfig(stage=2, **SWEEP_POINT)]
    sweep = sweep_module.Sweep(points, tmp_path / "sweep", parallel=1, progress=False, retries=0)
    with pytest.raises(sweep_module.LeaseNotReleased) as stuck:
        sweep.run()
    supervisor = psutil.Process(stuck.value.supervisor_pid)
    try:
        assert "labkit.launch.supervisor" in supervisor.cmdline()
        message = str(stuck.value)
        assert str(stuck.value.run_dir) in message and f"kill {supervisor.pid}" in message
        assert len(list((tmp_path / "sweep" / "runs").iterdir())) == 1  # the second point was not started
        assert list(sweep.table()["status"]) == ["finished"]  # the first point is kept
    finally:
        supervisor.kill()
        supervisor.wait(timeout=10)

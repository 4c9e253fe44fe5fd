"""GPU leases: a second run on GPUs a live run holds is refused before it starts (issue #6).

The locks are real flocks and the hand-off to a supervisor is a real child process; only the
GPUs are absent here, so `Run._device_ids` is given a CUDA `Devices` description.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from labkit import device_lease
from labkit.config import ConfigError, RunConfig
from labkit.devices import Devices
from labkit.launcher import build_command
from labkit.run import Run


def test_run_devices_follow_the_visible_devices():
    assert device_lease.run_devices(2, 4, None) == ["0", "1"]
    assert device_lease.run_devices(2, 4, "3, 1,0") == ["3", "1"]
    assert device_lease.run_devices(1, 8, "") == ["0"]


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
    ids = Run(config)._device_ids(gpus, {"CUDA_VISIBLE_DEVICES": "2,3"})
    assert ids == ["2", "3"]
    # ... and those are the devices the launch command gives the ranks.
    _, env = build_command(config, tmp_path / "run", master_port=29500, base_env={}, accelerator="cuda",
                           device_ids=ids)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    first = device_lease.take("cuda", ids, "run runs/first")
    try:
        assert sorted(p.name for p in tmp_path.iterdir()) == ["cuda2.lock", "cuda3.lock"]
        with pytest.raises(device_lease.DevicesBusy, match="cuda device 2"):
            device_lease.take("cuda", Run(config)._device_ids(gpus, {"CUDA_VISIBLE_DEVICES": "2,3"}), "second")
        other = device_lease.take("cuda", Run(config)._device_ids(gpus, {}), "third")  # GPUs 0, 1: fine
        device_lease.release(other)
    finally:
        device_lease.release(first)
    cpu = Devices(accelerator="cpu", device_count=1, max_ranks=2, backend="gloo", bf16=True, fp16=False,
                  device_name="cpu", total_memory_bytes=24 << 30)
    assert Run(config)._device_ids(cpu, {}) == []  # CPU ranks share cores; runs may overlap


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

"""What the lab knows about the machine's devices, asked through DeepSpeed's accelerator API."""

from __future__ import annotations

import os

import pytest

from labkit.runtime.devices import Devices, _probe_in_child, detect_devices


@pytest.mark.slow
def test_gpu_probe_runs_in_a_child_and_fills_every_field():
    """On GPUs detect_devices() asks in a child process (the kernel must hold no device context).
    Here the child answers for the CPU accelerator; what it prints must build a Devices."""
    probed = Devices(**_probe_in_child())
    here = detect_devices()
    assert probed.accelerator == here.accelerator and probed.backend == here.backend
    assert probed.visible_devices_env == here.visible_devices_env


def test_datasheet_peak_matches_whole_model_names_only():
    def peak(name: str) -> float | None:
        return Devices("cuda", 1, 1, "nccl", True, True, name, 0).peak_flops("bf16")

    assert peak("NVIDIA H100 80GB HBM3") == 989e12
    assert peak("NVIDIA H100 NVL") == 835e12 and peak("NVIDIA H100 PCIe") == 756e12  # not the SXM's peak
    assert peak("NVIDIA H200 NVL") == 835e12 and peak("NVIDIA H200") == 989e12
    assert peak("NVIDIA L4") == 121e12
    assert peak("NVIDIA A10") == 125e12 and peak("NVIDIA A10G") == 70e12  # the cloud variant's own figure
    assert peak("NVIDIA L40S") is None  # not the L4's figure: unknown parts measure a matmul instead
    assert peak("Tesla T4") is None  # no bf16 tensor cores on Turing


def test_cpu_ranks_are_capped_at_the_cores():
    devices = detect_devices()
    if devices.is_cpu:
        assert devices.max_ranks == (os.cpu_count() or 1)


# labkit's public API alone, from 8 threads, in a fresh process whose first
# DeepSpeed import this is. Before labkit.runtime.ds_import it deadlocked 4 times out of 4.
_CONCURRENT_FIRST_IMPORT = """
import sys, threading, traceback
assert "deepspeed" not in sys.modules
from labkit.core.config import RunConfig
import labkit.core.memory
errors = []
def make_config():
    try:
        RunConfig(example="zero3", stage=3, world_size=2, micro_batch=16, steps=5)
    except Exception:
        errors.append(traceback.format_exc())
def estimate():
    try:
        labkit.core.memory.deepspeed_estimates(10_000_000, world_size=2)
    except Exception:
        errors.append(traceback.format_exc())
threads = [threading.Thread(target=make_config if i % 2 else estimate) for i in range(8)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print("".join(errors))
sys.exit(1 if errors else 0)
"""


@pytest.mark.slow
def test_first_deepspeed_import_from_eight_threads_does_not_deadlock():
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    result = subprocess.run([sys.executable, "-c", _CONCURRENT_FIRST_IMPORT], capture_output=True, text=True,
                            env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


def test_ranks_load_the_saved_config_without_probing_devices_again(tmp_path, monkeypatch):
    """Every rank's RunConfig.load re-ran detect_devices() (on GPUs a child process and a
    context on GPU 0; refused in exclusive-process mode) and re-opened a relative hostfile path."""
    import json

    from labkit.core.config import RunConfig
    from labkit.core.files import write_json_atomic

    (tmp_path / "hosts").write_text("node-a slots=1\nnode-b slots=1\n")
    monkeypatch.chdir(tmp_path)
    saved = RunConfig(example="zero3", world_size=2, hostfile="hosts").to_dict()
    write_json_atomic(tmp_path / "config.json", saved)
    monkeypatch.chdir(tmp_path.parent)  # a rank on another node: the relative path means nothing there
    detect_devices.cache_clear()
    loaded = RunConfig.load(tmp_path / "config.json")
    assert detect_devices.cache_info().currsize == 0  # no probe
    assert loaded.to_dict() == json.loads((tmp_path / "config.json").read_text())


def test_bf16_counts_only_native_support():
    """torch's is_bf16_supported() counts emulation, so the probe said yes on V100 and T4."""
    from labkit.runtime.devices import native_bf16

    assert not native_bf16((7, 0)) and not native_bf16([7, 5])  # V100, T4
    assert native_bf16((8, 0)) and native_bf16((8, 9)) and native_bf16([9, 0])  # A100, L4, H100


@pytest.mark.slow
def test_gpu_check_without_a_gpu_says_so_fails_and_still_writes_its_report(tmp_path):
    """`make gpu-check` on a machine with no GPU: it said "no GPU" in passing, built CPU ops, ran nothing and
    exited 0 with "failures: none", as if the GPU path had passed. It must say plainly that there is no GPU
    and why, check nothing else, and exit non-zero, with the report (device, versions) written."""
    import subprocess
    import sys
    from pathlib import Path

    import pytest
    import torch

    if not detect_devices().is_cpu:
        pytest.skip("a GPU is here: make gpu-check checks it for real")
    root = str(Path(__file__).resolve().parents[2])
    report = tmp_path / "report.txt"
    result = subprocess.run([sys.executable, "-m", "labkit.study.gpu_check", "--report", str(report), "--runs-root",
                             str(tmp_path / "runs")], capture_output=True, text=True, timeout=900, cwd=root)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    text = report.read_text()
    assert "NO GPU: DeepSpeed's accelerator is cpu." in text and "NO GPU" in result.stdout
    assert "versions: python" in text and "failures: 1" in text and "- no GPU: " in text
    if torch.version.cuda is None:
        assert f"torch {torch.__version__} is a CPU-only build" in text
    assert "ops:" not in text and "gpu tests:" not in text and not (tmp_path / "runs").exists()  # nothing ran


def test_gpu_check_names_why_torch_sees_no_gpu(monkeypatch):
    from labkit.study.gpu_check import why_no_gpu

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert why_no_gpu().startswith("DS_ACCELERATOR=cpu")
    monkeypatch.delenv("DS_ACCELERATOR")
    monkeypatch.setattr("torch.version.cuda", "12.8")
    monkeypatch.setattr("torch.version.hip", None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert "hides every GPU" in why_no_gpu()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr("shutil.which", lambda name: None)
    assert "no NVIDIA driver" in why_no_gpu()


def test_torch_adam_replaces_deepspeeds_cuda_adam_without_nvcc():
    """Without an nvcc matching torch's CUDA, FusedAdam cannot be built: torch's Adam runs."""
    from labkit.core.config import RunConfig
    from labkit.runtime.ops import choose_optimizer_impl, cuda_ops_buildable, with_optimizer_impl

    def impl(cuda_ops, offload=False, accelerator="cuda", optimizer="adam"):
        return choose_optimizer_impl(example="zero3", optimizer=optimizer, offload=offload,
                                     accelerator=accelerator, cuda_ops=cuda_ops)

    assert impl(True) == "fused_adam" and impl(True, offload=True) == "cpu_adam"
    assert impl(False) == "torch_adam" and impl(False, offload=True) == "cpu_adam"  # CPU Adam: g++, no nvcc
    assert impl(False, accelerator="cpu") == "fused_adam"  # CPU ops build with the host compiler
    assert impl(False, optimizer="sgd") == "torch_sgd"
    offload = RunConfig(example="offload", world_size=1).ds_config()
    patched = with_optimizer_impl(offload, "torch_adam")
    assert patched["optimizer"]["params"]["torch_adam"] is True and patched["zero_force_ds_cpu_optimizer"] is False
    assert "torch_adam" not in offload["optimizer"]["params"]  # a copy
    assert with_optimizer_impl(offload, "cpu_adam") is offload
    buildable, why = cuda_ops_buildable()
    assert isinstance(buildable, bool) and why  # here: no CUDA toolkit, said in words


def test_telemetry_finishes_a_record_after_a_short_write(tmp_path):
    """os.write may write part of a record (here: a signal arrives while a pipe is full);
    the rest must follow, or the partial line is glued onto the next record."""
    import json
    import signal
    import threading
    import time

    from labkit.core.records import rank_file
    from labkit.rank.telemetry import RankTelemetry

    os.mkfifo(rank_file(tmp_path, 0))
    received = bytearray()

    def read_slowly():
        with open(rank_file(tmp_path, 0), "rb", buffering=0) as pipe:
            while chunk := pipe.read(65536):
                received.extend(chunk)
                time.sleep(0.002)

    reader = threading.Thread(target=read_slowly)
    reader.start()
    previous = signal.signal(signal.SIGALRM, lambda *_: None)  # interrupts a blocked pipe write: a short write
    signal.setitimer(signal.ITIMER_REAL, 0.001, 0.001)
    try:
        telemetry = RankTelemetry(tmp_path, 0)
        for step in range(20):
            telemetry.step(step=step, payload="x" * 300_000)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, previous)
    try:
        telemetry.close()
    except OSError:
        pass  # fsync of a pipe: EINVAL, nothing to make durable
    reader.join(timeout=60)
    lines = bytes(received).decode().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(20))


def test_noise_probe_matches_a_float64_reference():
    """The probe no longer builds float64 gradient vectors; its figures stay those of one."""
    import torch
    from torch import nn

    from labkit.models.mlp import SimpleModel
    from labkit.rank.noise_probe import gradient_noise_probe

    torch.manual_seed(0)
    model = SimpleModel(20, 32, 5, 2)
    inputs, labels = torch.randn(16, 20), torch.randint(0, 5, (16,))
    got = gradient_noise_probe(lambda: SimpleModel(20, 32, 5, 2), list(model.parameters()), inputs, labels,
                               device="cpu")
    reference = model.double()
    halves = []
    for part in (slice(0, 8), slice(8, 16)):
        loss = nn.CrossEntropyLoss()(reference(inputs[part].double()), labels[part])
        halves.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, list(reference.parameters()))]))
    small = float(sum(h.pow(2).sum() for h in halves) / 2)
    big = float(((halves[0] + halves[1]) / 2).pow(2).sum())
    assert abs(got["grad_norm_small_sq"] - small) <= 1e-4 * small and abs(got["grad_norm_big_sq"] - big) <= 1e-4 * big

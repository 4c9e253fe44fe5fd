"""What the lab knows about the machine's devices, asked through DeepSpeed's accelerator API."""

from __future__ import annotations

import os

from labkit.devices import Devices, _probe_in_child, detect_devices


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
    assert peak("NVIDIA L4") == 121e12
    assert peak("NVIDIA L40S") is None  # not the L4's figure: unknown parts measure a matmul instead
    assert peak("Tesla T4") is None  # no bf16 tensor cores on Turing


def test_cpu_ranks_are_capped_at_the_cores():
    devices = detect_devices()
    if devices.is_cpu:
        assert devices.max_ranks == (os.cpu_count() or 1)

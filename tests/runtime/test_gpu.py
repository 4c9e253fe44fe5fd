"""GPU-only checks (`pytest -m gpu`, run by `make gpu-check`); each skips without a CUDA GPU."""

from __future__ import annotations

import pytest

from labkit.runtime.devices import detect_devices

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(detect_devices().accelerator != "cuda", reason="no CUDA GPU")]


def test_probe_reports_bf16_only_where_native():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_capability(0) >= (8, 0))"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert detect_devices().bf16 == (out == "True")


def test_peak_flops_from_the_datasheet_or_a_large_matmul_timed_with_events():
    """The line `make gpu-check` copies into its report (run with -s): the device's peak, measured too."""
    from labkit.runtime.devices import datasheet_peak_flops, measured_matmul_flops

    devices = detect_devices()
    precision = "bf16" if devices.bf16 else "fp16"
    measured, how = measured_matmul_flops("cuda:0", precision)
    datasheet = datasheet_peak_flops(devices.device_name, precision)
    print(f"peak: {devices.device_name} {precision}: datasheet "
          + (f"{datasheet / 1e12:.0f} TFLOP/s" if datasheet else "unknown") + f"; {how}: {measured / 1e12:.0f} TFLOP/s")
    assert "8192x8192" in how and "events" in how and measured > 1e12
    if datasheet:
        assert measured < 1.1 * datasheet  # dense peak: a random-data matmul reaches 60-85% of it

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


def test_one_gpu_run_leases_its_device_and_records_its_optimizer(tmp_path):
    from labkit import Run, RunConfig
    from labkit.runtime.ops import cuda_ops_buildable

    run = Run(RunConfig(example="zero3", stage=2, world_size=1, micro_batch=8, steps=3, hidden=128,
                        dataset_size=256), root=tmp_path).start()
    assert run.device_ids and run.wait(timeout=600) == "finished", run.cause
    expected = "fused_adam" if cuda_ops_buildable()[0] else "torch_adam"
    assert run.summary["optimizer_impl"] == expected

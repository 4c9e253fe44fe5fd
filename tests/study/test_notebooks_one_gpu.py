"""A learner's Run All on one GPU goes on: notebook 03b, whose every run is between ranks, executed
by nbval with the `workshop` profile on a stand-in for one H100 80GB (the lead's reference machine).

The kernel's IPython startup file replaces `labkit.runtime.devices.detect_devices` with the stand-in before any cell
runs, so every cell takes the one-GPU path for real: sizes resolved for it (bf16, world size capped at 1), the skip
note, the formulas computed for 2 ranks, and no launch and no link fit (the only parts that would need the GPU).
03 and 03a launch runs on their one rank, which needs the device itself: see test_notebook_sizes.py for their
runs on one GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ONE_H100 = {"accelerator": "cuda", "device_count": 1, "max_ranks": 1, "backend": "nccl", "bf16": True, "fp16": True,
            "device_name": "NVIDIA H100 80GB HBM3", "total_memory_bytes": 80 * 2**30}
STARTUP = """\
import json
import os

from labkit.runtime import devices

STAND_IN = devices.Devices(**json.loads(os.environ["LABKIT_TEST_DEVICES"]))
devices.detect_devices = lambda: STAND_IN
"""


@pytest.mark.slow
def test_03b_runs_all_on_one_gpu_with_the_workshop_profile(tmp_path):
    startup = tmp_path / "ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True)
    (startup / "00-stand-in-devices.py").write_text(STARTUP)
    env = {**os.environ, "IPYTHONDIR": str(tmp_path / "ipython"), "LABKIT_PROFILE": "workshop",
           "LABKIT_TEST_DEVICES": json.dumps(ONE_H100), "LABKIT_RUNS_DIR": str(tmp_path / "runs")}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
                             str(REPO / "notebooks" / "03b-communication.ipynb")],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert not (tmp_path / "runs").exists()  # one GPU: nothing launched

"""The predictor counts ZeRO-3's gathers after the first as overlappable because DeepSpeed prefetches them
(`comms._stage3`); it prefetches only while its module trace is complete. Checked on real DeepSpeed runs: under
activation checkpointing (torch's reentrant and non-reentrant, DeepSpeed's own) the trace is complete from the
second step on and never invalidated, so the recomputed forward keeps the prefetch (docs/predict.md, the ZeRO++
points)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from labkit.launch.launcher import free_port
from labkit.runtime.build_locks import report_stale_locks
from labkit.runtime.ops import interpreter_path
from tests.conftest import REPO

PROBE = REPO / "tests" / "scripts" / "zero3_trace_probe.py"


@pytest.mark.slow
def test_zero3_prefetch_survives_activation_checkpointing():
    # As labkit's launcher runs ranks: the ninja that built the op cache first on PATH (`interpreter_path`). Not
    # supervised like a labkit run, so a build lock left by a killed build is cleared first, as `make ops` does.
    report_stale_locks(os.environ["TORCH_EXTENSIONS_DIR"], clear=True)
    env = {**os.environ, "PATH": interpreter_path(os.environ.get("PATH"))}
    done = subprocess.run([sys.executable, str(PROBE), str(free_port())], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    steps: dict[str, list[dict]] = {}
    for line in done.stdout.splitlines():
        if line.startswith('{"mode"'):
            record = json.loads(line)
            steps.setdefault(record["mode"], []).append(record)
    plain = steps["none"]
    assert len(plain) == 3 and plain[0].get("fetch_without_trace", 0) > 0  # the first step records the trace
    for mode in ("torch-reentrant", "torch-nonreentrant", "deepspeed"):
        assert len(steps[mode]) == 3, mode
        assert steps[mode][0].get("fetch_without_trace", 0) > 0, mode  # a fresh engine records its own trace
        for step in steps[mode][1:]:
            assert step.get("invalidations", 0) == 0 and step.get("fetch_without_trace", 0) == 0, step
            # the recomputed forward fetches its blocks' modules once more: checkpointing did run
            assert step["fetch_with_trace"] > plain[-1]["fetch_with_trace"], step

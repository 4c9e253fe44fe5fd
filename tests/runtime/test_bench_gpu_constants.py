"""benchmarks/bench_gpu_constants.py's CPU path: the GPU sections are recorded as skipped (with the reason), the host
ones measured on real DeepSpeed (a 1-rank ZeRO-3 and ZeRO-0 engine on gloo)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "bench_gpu_constants.py"


@pytest.mark.slow
def test_cpu_path_writes_every_section(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("the CPU path: this machine has a GPU (make gpu-check runs the script there)")
    out = tmp_path / "constants.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--budget-s", "600", "--out", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=REPO)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["format"] == "labkit-gpu-constants/1"
    assert result["source"].startswith("measured on CPU") and "in this lab" in result["source"]
    for section in ("gemm", "memory", "host_copy", "gpu_adamw", "attention"):
        assert result[section]["skipped"] == "no CUDA GPU"
    assert result["launch"]["device"] == "cpu" and result["launch"]["launch_s"] > 0
    zero3 = result["zero3"]
    assert "skipped" not in zero3, zero3
    assert zero3["backend"] == "gloo" and zero3["depths"] == [4, 12]
    assert set(zero3["timings"]) == {f"stage{s}_depth{d}" for s in (0, 3) for d in ("4", "12", "12_relu")}
    for key in ("per_module_per_micro_step_s", "fetch_s", "per_micro_step_s", "step_per_module_s", "step_fixed_s",
                "per_paramless_module_per_micro_step_s"):
        assert math.isfinite(zero3[key])
    assert zero3["fetch_s"] == pytest.approx(zero3["per_module_per_micro_step_s"] / 2)
    adam = result["cpu_adam"]  # built by `make ops`; else the reason it was not
    assert adam.get("s_per_param", 0) > 0 or adam["skipped"].startswith("cpu_adam op")
    if "skipped" not in adam:  # ZeRO-Offload's two host passes, timed beside it
        assert adam["unscale_s_per_param"] > 0 and adam["to_bit16_s_per_param"] > 0
    # the table is printed last
    assert done.stdout.rstrip().splitlines()[-1].startswith("wall time")
    # a file measured without a GPU is not taken for a GPU kind's constants
    from labkit.runtime import hardware

    with pytest.raises(ValueError, match="without a CUDA GPU"):
        hardware.load_measured(out)


def test_the_table_says_which_gemm_efficiency_the_model_takes_from_a_gpu_grid() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_gpu_constants", SCRIPT)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from labkit.runtime import hardware

    measured = json.loads((REPO / "data" / "reference-h100-80gb" / "gpu_constants.json").read_text())
    rows = dict(bench.table(measured))
    h100 = hardware.gpu("H100-SXM")  # the committed file is this preset's grid: the same figure, computed twice
    assert rows["GEMM bf16, the model's efficiency"] == f"{h100.gemm_efficiency('bf16'):.3f} of H100-SXM's peak " \
        "(median rate per SM)"
    assert float(rows["GEMM bf16, the model's efficiency"].split()[0]) < \
        measured["gemm"]["bf16"]["best_flops_per_s"] / h100.peak("bf16")  # the median, below the best GEMM
    assert not bench.model_gemm_efficiency({**measured, "device": {"cuda": False, "name": "cpu"}})


@pytest.mark.slow
def test_unknown_section_is_refused() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--only", "gemm,nccl", "--out", "/dev/null"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2 and "nccl" in done.stderr

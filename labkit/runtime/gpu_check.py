"""`make gpu-check`: what a user with a GPU runs first, and attaches to a bug report.

It builds DeepSpeed's ops (or says why not: no nvcc matching torch's CUDA means torch_adam), runs the
GPU-marked tests (`pytest -m gpu`), one 2-rank run per ZeRO stage, and writes a short report: device,
versions, results, failures. On a machine where DeepSpeed finds no GPU it says so, with the likely
reason (a CPU-only torch, no driver, CUDA_VISIBLE_DEVICES), checks nothing else, writes the report and
exits non-zero: a check that passed there would say nothing about the GPU path.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

STAGES = (0, 1, 2, 3)


def check(report_path: Path, runs_root: Path, run_timeout_s: float = 600) -> list[str]:
    """Run every check; write the report; return the failures (empty: all good)."""
    lines: list[str] = ["# labkit gpu-check", ""]
    failures: list[str] = []

    import deepspeed
    import torch

    from labkit.runtime.devices import detect_devices
    from labkit.runtime.ops import build_all, cuda_ops_buildable

    devices = detect_devices()
    buildable, why = cuda_ops_buildable()
    lines += [f"device: {devices.device_name} x{devices.device_count} ({devices.accelerator}, {devices.backend}, "
              f"bf16={devices.bf16}, fp16={devices.fp16}, {devices.total_memory_bytes / 2**30:.1f} GiB)",
              f"versions: python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
              f"deepspeed {deepspeed.__version__}",
              f"CUDA ops buildable: {buildable} ({why})", ""]
    gpu = not devices.is_cpu
    if not gpu:
        reason = why_no_gpu()
        failures.append(f"no GPU: {reason}")
        lines += [f"NO GPU: DeepSpeed's accelerator is cpu. {reason}",
                  "Nothing was checked (ops, GPU tests, 2-rank runs): run this on the GPU machine."]
        _write_report(report_path, lines, failures)
        return failures

    try:
        built = build_all()
        lines.append(f"ops: {', '.join(built) or 'none built'}")
    except Exception as exc:
        failures.append(f"ops build: {type(exc).__name__}: {exc}")
        lines.append(f"ops: FAILED\n{traceback.format_exc(limit=3)}")

    tests = Path(__file__).resolve().parents[2] / "tests"
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                             str(tests / "test_gpu.py")], capture_output=True, text=True)
    summary = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
    lines.append(f"gpu tests: {summary}")
    if result.returncode not in (0, 5):  # 5: nothing collected
        failures.append(f"gpu tests: {summary}")
        lines.append(result.stdout[-3000:])

    if gpu and devices.device_count >= 2:
        from labkit.launch.config import RunConfig
        from labkit.launch.run import Run
        from labkit.study.sweep import LEASE_RELEASE_TIMEOUT_S

        for stage in STAGES:
            try:
                run = Run(RunConfig(example="zero3", stage=stage, world_size=2, micro_batch=8, steps=5,
                                    hidden=256, dataset_size=1024), root=runs_root).start()
                status = run.wait(timeout=run_timeout_s)
                impl = (run.summary or {}).get("optimizer_impl")
                lines.append(f"2-rank ZeRO-{stage}: {status} (optimizer {impl}; {run.run_dir})"
                             + (f": {run.cause}" if status != "finished" else ""))
                if status != "finished":
                    if not run.done:
                        run.stop()
                    failures.append(f"ZeRO-{stage} run: {status}: {run.cause}")
                # The next stage needs the same GPUs, which this run's supervisor holds until it exits.
                released_by = time.monotonic() + LEASE_RELEASE_TIMEOUT_S
                while run.holds_devices and time.monotonic() < released_by:
                    time.sleep(0.2)
            except Exception as exc:
                failures.append(f"ZeRO-{stage} run: {type(exc).__name__}: {exc}")
                lines.append(f"2-rank ZeRO-{stage}: could not start: {exc}")
    else:
        lines.append("2-rank runs: skipped (" + ("no GPU" if not gpu else f"{devices.device_count} GPU visible") + ")")

    _write_report(report_path, lines, failures)
    return failures


def _write_report(report_path: Path, lines: list[str], failures: list[str]) -> None:
    lines = [*lines, "", "failures: " + ("none" if not failures else str(len(failures))), *(f"- {f}" for f in failures)]
    report_path.parent.mkdir(parents=True, exist_ok=True)
    report_path.write_text("\n".join(lines) + "\n")


def why_no_gpu() -> str:
    """The likely reason torch (and so DeepSpeed) sees no GPU here, in words a user can act on."""
    import torch

    if os.environ.get("DS_ACCELERATOR", "").strip() == "cpu":
        return "DS_ACCELERATOR=cpu makes DeepSpeed use the CPU; unset it."
    if torch.version.cuda is None and torch.version.hip is None:
        return (f"torch {torch.__version__} is a CPU-only build: install torch's CUDA build "
                f"(README: GPU prerequisites).")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and not [d for d in visible.split(",") if d.strip() and d.strip() != "-1"]:
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU."
    if shutil.which("nvidia-smi") is None and torch.version.hip is None:
        return (f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but finds no GPU, and there "
                f"is no nvidia-smi: no NVIDIA driver is installed (or this container was started without GPUs).")
    return (f"torch {torch.__version__} (CUDA {torch.version.cuda}, ROCm {torch.version.hip}) finds no GPU; "
            f"`nvidia-smi` shows whether the driver sees one and which CUDA version it supports.")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", type=Path, default=Path("gpu-check-report.txt"))
    parser.add_argument("--runs-root", type=Path, default=Path("runs") / "gpu-check")
    args = parser.parse_args()
    try:
        failures = check(args.report, args.runs_root)
    except Exception as exc:  # a broken install (torch, DeepSpeed): the report says so, for the bug report
        failures = [f"gpu-check could not run: {type(exc).__name__}: {exc}"]
        _write_report(args.report, ["# labkit gpu-check", "", traceback.format_exc()], failures)
    print(args.report.read_text())
    print(f"report written to {args.report}")
    return 1 if failures else 0  # no GPU is a failure: nothing GPU-only was checked


if __name__ == "__main__":
    sys.exit(main())

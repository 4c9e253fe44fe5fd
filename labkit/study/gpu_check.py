"""`make gpu-check`: what a user with a GPU runs first, and attaches to a bug report.

It checks what a workshop runs, in about 3 minutes on one GPU with a warm op cache:

- DeepSpeed's ops build and load (FusedAdam needs an nvcc matching torch's CUDA; CPU Adam only a C++
  compiler), with a TORCH_CUDA_ARCH_LIST DeepSpeed can parse (labkit.runtime.ops.deepspeed_arch_list);
- the GPU-marked tests (`pytest -m gpu`) and the device's peak FLOP/s (datasheet, else a measured matmul);
- one run per ZeRO stage on 1 GPU, in bf16 where the GPU computes it natively (fp16 elsewhere), recording the
  optimizer that ran; ZeRO-Offload with DeepSpeed's CPU Adam; an out-of-memory probe that must be classified
  as out of memory; on 2+ GPUs one 2-rank run per stage (NCCL) too.

On one GPU the multi-rank checks are listed as skipped, not counted as failures. The report ends with
"failures: none" only when every check that ran passed. On a machine where DeepSpeed finds no GPU it says so,
with the likely reason (a CPU-only torch, no driver, CUDA_VISIBLE_DEVICES), checks nothing else, writes the
report and exits non-zero: a check that passed there would say nothing about the GPU path.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labkit.runtime.devices import Devices

STAGES = (0, 1, 2, 3)
OOM_OVERSHOOT = 1.5  # the out-of-memory probe asks for this many times the device's memory in activations
# A model small enough to start in seconds and still use every code path of a stage.
RUN_MODEL = dict(hidden=1024, depth=2, micro_batch=32, steps=5, dataset_size=1024)
OOM_MODEL = dict(hidden=8192, depth=2, input_size=100, dataset_size=4096)


@dataclass(kw_only=True)
class Check:
    """One run gpu-check launches: its RunConfig fields and what it must end as."""

    label: str
    fields: dict[str, Any]
    expect_status: str = "finished"
    expect_impl: str | None = None  # optimizer_impl the run must record (None: not checked)


@dataclass(kw_only=True)
class Plan:
    checks: list[Check] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # what this machine cannot check, and why


def run_plan(devices: Devices, *, cuda_ops: bool, cpu_ops: bool) -> Plan:
    """The runs to check on these devices (pure). `cuda_ops`: FusedAdam buildable; `cpu_ops`: a C++ compiler."""
    from labkit.core import memory

    precision = "bf16" if devices.bf16 else "fp16"
    stage_impl = "fused_adam" if cuda_ops else "torch_adam"
    plan = Plan()
    for stage in STAGES:
        plan.checks.append(Check(label=f"1-rank ZeRO-{stage} ({precision})", expect_impl=stage_impl,
                                 fields=dict(example="deepspeed", stage=stage, world_size=1, precision=precision,
                                             **RUN_MODEL)))
    plan.checks.append(Check(label=f"1-rank ZeRO-2 + offload ({precision}, DeepSpeed's CPU Adam)",
                             expect_impl="cpu_adam" if cpu_ops else "torch_adam",
                             fields=dict(example="offload", stage=2, world_size=1, precision=precision, **RUN_MODEL)))
    per_sample = memory.mlp_activation_bytes_per_sample(OOM_MODEL["input_size"], OOM_MODEL["hidden"],
                                                        OOM_MODEL["depth"], 10)
    oom_batch = math.ceil(OOM_OVERSHOOT * devices.total_memory_bytes / per_sample)
    plan.checks.append(Check(label=f"out-of-memory probe (micro-batch {oom_batch:,}: ~{OOM_OVERSHOOT}x the memory)",
                             expect_status="oom",
                             fields=dict(example="pytorch", world_size=1, micro_batch=oom_batch, steps=2,
                                         sample_with_replacement=True, **OOM_MODEL)))
    multi = [f"2-rank ZeRO-{stage} ({precision}, NCCL)" for stage in STAGES]
    if devices.device_count >= 2:
        plan.checks += [Check(label=label, expect_impl=stage_impl,
                              fields=dict(example="deepspeed", stage=stage, world_size=2, precision=precision,
                                          **RUN_MODEL)) for stage, label in zip(STAGES, multi, strict=True)]
    else:
        plan.skipped += [f"{label}: needs 2 GPUs, {devices.device_count} visible" for label in multi]
    return plan


def check(report_path: Path, runs_root: Path, run_timeout_s: float = 300) -> list[str]:
    """Run every check; write the report; return the failures (empty: all good, skipped checks included)."""
    lines: list[str] = ["# labkit gpu-check", ""]
    failures: list[str] = []
    started = time.monotonic()

    import deepspeed
    import torch

    from labkit.runtime.devices import detect_devices
    from labkit.runtime.ops import build_all, cuda_ops_buildable, deepspeed_arch_list, host_compiler

    devices = detect_devices()
    buildable, why = cuda_ops_buildable()
    compiler = host_compiler()
    lines += [f"device: {devices.device_name} x{devices.device_count} ({devices.accelerator}, {devices.backend}, "
              f"bf16={devices.bf16}, fp16={devices.fp16}, {devices.total_memory_bytes / 2**30:.1f} GiB)",
              f"versions: python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
              f"deepspeed {deepspeed.__version__}",
              f"CUDA ops buildable: {buildable} ({why})",
              f"C++ compiler for CPU Adam: {compiler or 'none (offload runs use torch Adam)'}"]
    arch_list, note = deepspeed_arch_list(os.environ.get("TORCH_CUDA_ARCH_LIST"))
    lines.append(f"TORCH_CUDA_ARCH_LIST: {note}" if note else
                 f"TORCH_CUDA_ARCH_LIST: {arch_list or '(unset: DeepSpeed asks the devices)'}, parseable as it is")
    lines.append("")
    gpu = not devices.is_cpu
    if not gpu:
        reason = why_no_gpu()
        failures.append(f"no GPU: {reason}")
        lines += [f"NO GPU: DeepSpeed's accelerator is cpu. {reason}",
                  "Nothing was checked (ops, GPU tests, runs): run this on the GPU machine."]
        _write_report(report_path, lines, failures)
        return failures

    try:
        built = build_all()
        lines.append(f"ops: {', '.join(built) or 'none built'}")
    except Exception as exc:
        failures.append(f"ops build: {type(exc).__name__}: {exc}")
        lines.append(f"ops: FAILED\n{traceback.format_exc(limit=3)}")

    tests = Path(__file__).resolve().parents[2] / "tests"
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-m", "gpu", "-p", "no:cacheprovider",
                             str(tests / "test_gpu.py")], capture_output=True, text=True)
    summary = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
    lines.append(f"gpu tests: {summary}")
    lines += [line for line in result.stdout.splitlines() if line.startswith("peak:")]
    if result.returncode not in (0, 5):  # 5: nothing collected
        failures.append(f"gpu tests: {summary}")
        lines.append(result.stdout[-3000:])

    plan = run_plan(devices, cuda_ops=buildable, cpu_ops=compiler is not None)
    for item in plan.checks:
        problem = _run_check(item, runs_root, run_timeout_s, lines)
        if problem:
            failures.append(f"{item.label}: {problem}")
    for skipped in plan.skipped:
        lines.append(f"SKIPPED {skipped}")
    lines.append(f"checks: {len(plan.checks)} runs, {len(plan.skipped)} skipped; "
                 f"{time.monotonic() - started:.0f} s in all")
    _write_report(report_path, lines, failures, skipped=len(plan.skipped))
    return failures


def _run_check(item: Check, runs_root: Path, timeout_s: float, lines: list[str]) -> str | None:
    """Launch one check's run and judge it; a line in the report either way; returns what is wrong, or None."""
    from labkit.core.config import RunConfig
    from labkit.launch.run import Run
    from labkit.study.sweep import LEASE_RELEASE_TIMEOUT_S

    began = time.monotonic()
    try:
        run = Run(RunConfig(**item.fields), root=runs_root).start()
    except Exception as exc:
        lines.append(f"{item.label}: could not start: {type(exc).__name__}: {exc}")
        return f"could not start: {exc}"
    status = run.wait(timeout=timeout_s)
    if not run.done:
        run.stop()
        status = run.status
    impl = (run.summary or {}).get("optimizer_impl")
    problem = None
    if status != item.expect_status:
        problem = f"{status} (expected {item.expect_status}): {run.cause}"
    elif item.expect_impl and impl != item.expect_impl:
        problem = f"optimizer {impl}, expected {item.expect_impl}"
    detail = f"optimizer {impl}" if status == "finished" else f"cause: {run.cause}"
    lines.append(f"{item.label}: {'ok' if problem is None else 'FAILED'}: {status}, {detail} "
                 f"({time.monotonic() - began:.0f} s; {run.run_dir})")
    # The next run needs the same GPUs, which this run's supervisor holds until it exits.
    released_by = time.monotonic() + LEASE_RELEASE_TIMEOUT_S
    while run.holds_devices and time.monotonic() < released_by:
        time.sleep(0.2)
    return problem


def _write_report(report_path: Path, lines: list[str], failures: list[str], skipped: int = 0) -> None:
    lines = [*lines, "", "failures: " + ("none" if not failures else str(len(failures)))
             + (f" ({skipped} check(s) skipped: not run on this machine, listed above)" if skipped else ""),
             *(f"- {f}" for f in failures)]
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

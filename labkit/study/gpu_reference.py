"""The GPU reference run: `make gpu-reference` (or one step of it) on a GPU machine, into data/reference-<gpu>/.

    python -m labkit.study.gpu_reference check       # (a) make gpu-check: report in gpu-check-report.txt
    python -m labkit.study.gpu_reference notebooks   # (b) notebooks 00-05 under nbval, LABKIT_PROFILE=workshop
    python -m labkit.study.gpu_reference answer      # (c) labkit answer --profile workshop, published
    python -m labkit.study.gpu_reference all         # the three, each skipped once it has passed

Each step writes into data/reference-<gpu-slug>/ (`gpu_slug`: "h100-80gb", "t4", "a10g-x4", ...) and records
itself in steps.json (status, seconds, when); a step that passed is not run again (`--force` reruns it), so a
step cut off by a time limit is simply called again. The answer is resumable on its own (its runs stay in
runs/answer-workshop). machine.json names the device (written by `labkit answer`, and by this module before).
Notebook 04 reads data/reference-<gpu>/ on a machine with that GPU (`reference_dir`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from labkit.runtime.devices import Devices

REPO = Path(__file__).resolve().parents[2]
STEPS = ("check", "notebooks", "answer")
NOTEBOOKS = ("00-setup", "01-pytorch-baseline", "02-zero-offload", "03-zero3-multi-gpu", "03a-zero3-inside",
             "03b-communication", "04-the-answer", "04a-learning-rate", "05-live-panel", "06-predict")
PROFILE = "workshop"


def gpu_slug(devices: Devices) -> str:
    """A short directory name for the GPU model: "NVIDIA H100 80GB HBM3" -> "h100-80gb", "Tesla T4" -> "t4",
    "NVIDIA A100-SXM4-80GB" -> "a100-80gb", "NVIDIA H100 NVL" -> "h100-nvl"; "-x4" for 4 GPUs. Pure."""
    words = [w for w in re.split(r"[^a-z0-9]+", devices.device_name.lower()) if w]
    model = next((w for w in words if re.fullmatch(r"[a-z]{1,2}\d{1,4}[a-z]?", w) and w not in ("sxm4", "sxm5")),
                 None)
    keep = [model] if model else [w for w in words if w not in ("nvidia", "tesla", "geforce")][:2]
    keep += [w for w in words if re.fullmatch(r"\d+gb", w) or w in ("nvl", "pcie")]
    slug = "-".join(dict.fromkeys(w for w in keep if w)) or devices.accelerator
    return slug + (f"-x{devices.device_count}" if devices.device_count > 1 else "")


def reference_dir(devices: Devices | None = None) -> str | None:
    """data/reference-<this GPU>/ when it holds an answer (results.csv), else None (CPU machines: None)."""
    if devices is None:
        from labkit.runtime.devices import detect_devices

        devices = detect_devices()
    if devices.is_cpu:
        return None
    path = REPO / "data" / f"reference-{gpu_slug(devices)}"
    return str(path) if (path / "results.csv").is_file() else None


def step_commands(step: str, out: Path, python: str = sys.executable) -> list[list[str]]:
    """The commands of one step (run from the repository root). Pure."""
    if step == "check":
        return [[python, "-m", "labkit.study.gpu_check", "--report", str(out / "gpu-check-report.txt"),
                 "--runs-root", str(REPO / "runs" / "gpu-check")]]
    if step == "notebooks":
        return [[python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-ra", "--nbval-lax",
                 "--junitxml", str(out / "notebooks-junit.xml"), *(f"notebooks/{n}.ipynb" for n in NOTEBOOKS)]]
    if step == "answer":
        return [[python, "-m", "labkit", "answer", "--profile", PROFILE,
                 "--out", str(REPO / "runs" / f"answer-{PROFILE}"), "--reference", str(out)]]
    raise ValueError(f"unknown step {step!r}: one of {STEPS} or 'all'")


def run_step(step: str, out: Path, *, force: bool = False) -> dict[str, Any]:
    """Run one step unless it passed before; its output goes to <out>/<step>.log; returns its record."""
    record_file = out / "steps.json"
    steps = json.loads(record_file.read_text()) if record_file.is_file() else {}
    if steps.get(step, {}).get("status") == "passed" and not force:
        print(f"{step}: passed before ({steps[step]['seconds']:.0f} s), skipped (--force reruns it)", flush=True)
        return steps[step]
    env = {**os.environ, "LABKIT_PROFILE": PROFILE}
    started, status = time.monotonic(), "passed"
    with open(out / f"{step}.log", "w") as log:
        for command in step_commands(step, out):
            print(f"{step}: {' '.join(command)}", flush=True)
            code = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
            if code != 0:
                status = f"failed (exit {code})"
                break
    record = {"status": status, "seconds": round(time.monotonic() - started, 1),
              "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "log": f"{step}.log"}
    steps = json.loads(record_file.read_text()) if record_file.is_file() else {}
    record_file.write_text(json.dumps({**steps, step: record}, indent=1) + "\n")
    print(f"{step}: {status} in {record['seconds']:.0f} s (log: {out / (step + '.log')})", flush=True)
    return record


def write_machine(out: Path, devices: Devices) -> None:
    """machine.json naming the device, unless `labkit answer` wrote a fuller one there already."""
    path = out / "machine.json"
    if path.is_file() and "answer_runtime_s" in json.loads(path.read_text()):
        return
    import platform

    import torch

    path.write_text(json.dumps({"device": devices.device_name, "devices": devices.device_count,
                                "accelerator": devices.accelerator, "device_memory_bytes": devices.total_memory_bytes,
                                "gpu_slug": gpu_slug(devices), "profile": PROFILE, "python": platform.python_version(),
                                "torch": torch.__version__, "cpu_cores": os.cpu_count()}, indent=1) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=(*STEPS, "all"))
    parser.add_argument("--force", action="store_true", help="run a step again even if it passed")
    parser.add_argument("--out", type=Path, default=None, help="default: data/reference-<gpu-slug>")
    args = parser.parse_args()
    from labkit.runtime.devices import detect_devices

    devices = detect_devices()
    if devices.is_cpu:
        print("no GPU: the reference run is for a GPU machine (`make gpu-check` says why DeepSpeed sees none)")
        return 1
    out = args.out or REPO / "data" / f"reference-{gpu_slug(devices)}"
    out.mkdir(parents=True, exist_ok=True)
    write_machine(out, devices)
    records = [run_step(step, out, force=args.force) for step in (STEPS if args.step == "all" else (args.step,))]
    return 0 if all(r["status"] == "passed" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())

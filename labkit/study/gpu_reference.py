"""The GPU reference run: `make gpu-reference` (or one step of it) on a GPU machine, into data/reference-<gpu>/.

    python -m labkit.study.gpu_reference check       # (a) make gpu-check: report in gpu-check-report.txt
    python -m labkit.study.gpu_reference notebooks   # (b) notebooks 00-06 under nbval, LABKIT_PROFILE=workshop
    python -m labkit.study.gpu_reference answer      # (c) labkit answer --profile workshop, published
    python -m labkit.study.gpu_reference all         # the three, each skipped once it has passed
    python -m labkit.study.gpu_reference notebooks --jobs 5   # (b) with 5 notebooks at once (below)

Each step writes into data/reference-<gpu-slug>/ (`gpu_slug`: "h100-80gb", "t4", "a10g-x4", ...) and records
itself in steps.json (status, seconds, when); a step that passed is not run again (`--force` reruns it), so a
step cut off by a time limit is simply called again. The answer is resumable on its own (its runs stay in
runs/answer-workshop). machine.json names the device (written by `labkit answer`, and by this module before).
Notebook 04 reads data/reference-<gpu>/ on a machine with that GPU (`reference_dir`).

`--jobs N` (notebooks): each notebook in its own pytest process, N at a time, each with its own device-lease
directory (TMPDIR), so runs of different notebooks SHARE the GPUs: it proves in minutes that every notebook runs
there, but its timings are not one run's alone. The notebooks that find the memory boundary (ALONE) run first, by
themselves. Logs and JUnit files per notebook in <out>/notebooks/.
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
# Notebooks whose runs find the device's memory boundary: under --jobs they run first, alone, since other
# notebooks' runs on the same GPU would move it.
ALONE = ("01-pytorch-baseline",)
INTERRUPT_GRACE_S = 60.0  # after Ctrl-C (or `timeout -s INT`), how long a step's command may take to stop its runs


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


def run_command(command: list[str], env: dict[str, str], log: Any) -> int:
    """Run `command` from the repository root, output to `log`; its exit code. On Ctrl-C the command got the same
    SIGINT (one process group): it is given INTERRUPT_GRACE_S to stop its runs and keep what it recorded (`labkit
    answer` resumes from there), not killed at once as subprocess.run would."""
    child = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        return child.wait()
    except KeyboardInterrupt:
        try:
            child.wait(timeout=INTERRUPT_GRACE_S)
        except subprocess.TimeoutExpired:
            child.kill()
        raise


def notebook_command(notebook: str, junit: Path, python: str = sys.executable) -> list[str]:
    """One notebook under nbval (--jobs). Pure."""
    return [python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-ra", "--nbval-lax", "--junitxml", str(junit),
            f"notebooks/{notebook}.ipynb"]


def run_notebooks_at_once(out: Path, jobs: int, env: dict[str, str]) -> tuple[str, dict[str, Any]]:
    """(status, {notebook: {status, seconds}}): ALONE first, then the others `jobs` at a time (module doc)."""
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    folder = out / "notebooks"
    folder.mkdir(exist_ok=True)

    def one(notebook: str) -> tuple[str, dict[str, Any]]:
        started = time.monotonic()
        leases = tempfile.mkdtemp(prefix=f"labkit-{notebook}-")  # its own lease directory: shares the GPUs
        with open(folder / f"{notebook}.log", "w") as log:
            code = run_command(notebook_command(notebook, folder / f"{notebook}.xml"), {**env, "TMPDIR": leases}, log)
        status = "passed" if code == 0 else f"failed (exit {code})"
        print(f"notebooks: {notebook} {status} in {time.monotonic() - started:.0f} s", flush=True)
        return notebook, {"status": status, "seconds": round(time.monotonic() - started, 1)}

    results = dict(one(n) for n in NOTEBOOKS if n in ALONE)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results.update(pool.map(one, [n for n in NOTEBOOKS if n not in ALONE]))
    failed = [n for n, r in results.items() if r["status"] != "passed"]
    return (f"failed ({', '.join(failed)})" if failed else "passed"), results


def run_step(step: str, out: Path, *, force: bool = False, jobs: int = 1) -> dict[str, Any]:
    """Run one step unless it passed before; its output goes to <out>/<step>.log (with --jobs, per notebook in
    <out>/notebooks/); returns its record."""
    record_file = out / "steps.json"
    steps = json.loads(record_file.read_text()) if record_file.is_file() else {}
    if steps.get(step, {}).get("status") == "passed" and not force:
        print(f"{step}: passed before ({steps[step]['seconds']:.0f} s), skipped (--force reruns it)", flush=True)
        return steps[step]
    env = {**os.environ, "LABKIT_PROFILE": PROFILE}
    started, status, extra = time.monotonic(), "passed", {}
    if step == "notebooks" and jobs > 1:
        status, by_notebook = run_notebooks_at_once(out, jobs, env)
        extra = {"jobs": jobs, "notebooks": by_notebook}
    else:
        with open(out / f"{step}.log", "w") as log:
            for command in step_commands(step, out):
                print(f"{step}: {' '.join(command)}", flush=True)
                code = run_command(command, env, log)
                if code != 0:
                    status = f"failed (exit {code})"
                    break
    record = {"status": status, "seconds": round(time.monotonic() - started, 1),
              "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "log": "notebooks/" if extra else f"{step}.log", **extra}
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
    parser.add_argument("--jobs", type=int, default=1,
                        help="notebooks: this many at once, sharing the GPUs (module doc); default 1")
    args = parser.parse_args()
    from labkit.runtime.devices import detect_devices

    devices = detect_devices()
    if devices.is_cpu:
        print("no GPU: the reference run is for a GPU machine (`make gpu-check` says why DeepSpeed sees none)")
        return 1
    out = args.out or REPO / "data" / f"reference-{gpu_slug(devices)}"
    out.mkdir(parents=True, exist_ok=True)
    write_machine(out, devices)
    steps = STEPS if args.step == "all" else (args.step,)
    records = [run_step(step, out, force=args.force, jobs=args.jobs) for step in steps]
    return 0 if all(r["status"] == "passed" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())

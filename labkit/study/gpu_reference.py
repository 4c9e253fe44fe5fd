"""The GPU reference run: `make gpu-reference` (or one step of it) on a GPU machine, into data/reference-<gpu>/.

    python -m labkit.study.gpu_reference check       # (a) make gpu-check: report in gpu-check-report.txt
    python -m labkit.study.gpu_reference notebooks   # (b) notebooks 00-06 under nbval, LABKIT_PROFILE=workshop
    python -m labkit.study.gpu_reference answer      # (c) labkit answer --profile workshop, published
    python -m labkit.study.gpu_reference all         # the three, each skipped once it has passed
    python -m labkit.study.gpu_reference notebooks --jobs 5   # (b) with 5 notebooks at once (below)

Each step writes into data/reference-<gpu-slug>/ (`gpu_slug`: "h100-80gb", "t4", "a10g-x4", ...) and records
itself in steps.json (status, seconds, when); a step that passed is not run again (`--force` reruns it), so a
step cut off by a time limit is simply called again. The answer is resumable on its own (its runs stay in
runs/answer-workshop); an answer step that did not pass (a device call's time limit, Ctrl-C) copies what it
measured so far into <out>/answer-partial/ (`keep_partial`: results.csv and each run's records), which
`calibrate.gpu_comparison` reads. machine.json names the device (written by `labkit answer`, and by this module
before).
Notebook 04 reads data/reference-<gpu>/ on a machine with that GPU (`reference_dir`).

`--jobs N` (notebooks): each notebook in its own pytest process, N at a time, each with its own device-lease
directory (TMPDIR), so runs of different notebooks SHARE the GPUs: it proves in minutes that every notebook runs
there, but its timings are not one run's alone. The notebooks that find the memory boundary (ALONE) run first, by
themselves. Logs and JUnit files per notebook in <out>/notebooks/; steps.json records each notebook as it ends, and
a step called again runs only those that did not pass.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
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
        return [[python, "-m", "labkit", "answer", "--profile", PROFILE, "--out", str(ANSWER_DIR),
                 "--reference", str(out)]]
    raise ValueError(f"unknown step {step!r}: one of {STEPS} or 'all'")


ANSWER_DIR = REPO / "runs" / f"answer-{PROFILE}"
# What answer-partial/run-records/ keeps of each run: its records and configs, not its rank logs (DeepSpeed's
# output, megabytes) nor command.txt and launch.json (private: the caller's environment).
RUN_RECORD_FILES = ("summary.json", "status.json", "supervisor.log", "launcher.log", "config.json", "ds_config.json",
                    "point.json", "rank*.jsonl", "rank*.exit")


def keep_partial(answer_dir: Path, out: Path) -> Path | None:
    """Copy an unfinished answer's results.csv and its runs' records (RUN_RECORD_FILES) into <out>/answer-partial/,
    replacing an older copy; None when it has no results.csv yet. What data/reference-*/answer-partial/ holds."""
    import shutil

    results = answer_dir / "results.csv"
    if not results.is_file():
        return None
    partial = out / "answer-partial"
    shutil.rmtree(partial, ignore_errors=True)
    (partial / "run-records").mkdir(parents=True)
    shutil.copy2(results, partial / "results.csv")
    for run in sorted(p for p in (answer_dir / "runs").glob("*") if p.is_dir()):
        kept = partial / "run-records" / run.name
        kept.mkdir()
        for pattern in RUN_RECORD_FILES:
            for file in run.glob(pattern):
                shutil.copy2(file, kept / file.name)
    return partial


def run_command(command: list[str], env: dict[str, str], log: Any,
                children: list[subprocess.Popen] | None = None) -> int:
    """Run `command` from the repository root, output to `log`; its exit code. `children` collects the process (for
    a caller that waits on several from threads). On Ctrl-C, `stop_gracefully`."""
    child = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    if children is not None:
        children.append(child)
    try:
        return child.wait()
    except KeyboardInterrupt:
        stop_gracefully([child])
        raise


def stop_gracefully(children: list[subprocess.Popen]) -> None:
    """Ctrl-C reached the children too (one process group): they get INTERRUPT_GRACE_S in all to stop their runs and
    keep what they recorded (`labkit answer` resumes from there), then are killed; subprocess.run kills at once."""
    deadline = time.monotonic() + INTERRUPT_GRACE_S
    for child in children:
        try:
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()


def notebook_command(notebook: str, junit: Path, python: str = sys.executable) -> list[str]:
    """One notebook under nbval (--jobs). Pure."""
    return [python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-ra", "--nbval-lax", "--junitxml", str(junit),
            f"notebooks/{notebook}.ipynb"]


def run_notebooks_at_once(out: Path, jobs: int, env: dict[str, str], results: dict[str, Any],
                          on_end: Callable[[], object] = lambda: None) -> None:
    """Fill `results` ({notebook: {status, seconds}}) as each notebook ends, then call `on_end` (one at a time):
    ALONE first, then the others `jobs` at a time (module doc). A notebook `results` already holds as passed is not
    run again (a resumed step). On Ctrl-C the running ones are stopped gracefully and recorded "interrupted"."""
    import tempfile
    import threading
    from concurrent.futures import ThreadPoolExecutor

    folder = out / "notebooks"
    folder.mkdir(exist_ok=True)
    children: list[subprocess.Popen] = []
    stopping, ended = threading.Event(), threading.Lock()

    def one(notebook: str) -> None:
        started = time.monotonic()
        # Its own lease directory, so its runs share the GPUs with the other notebooks'.
        with tempfile.TemporaryDirectory(prefix=f"labkit-{notebook}-") as leases, \
                open(folder / f"{notebook}.log", "w") as log:
            code = run_command(notebook_command(notebook, folder / f"{notebook}.xml"), {**env, "TMPDIR": leases}, log,
                               children)
        status = "passed" if code == 0 else "interrupted" if stopping.is_set() else f"failed (exit {code})"
        with ended:
            results[notebook] = {"status": status, "seconds": round(time.monotonic() - started, 1)}
            on_end()
        print(f"notebooks: {notebook} {status} in {results[notebook]['seconds']:.0f} s", flush=True)

    todo = [n for n in NOTEBOOKS if results.get(n, {}).get("status") != "passed"]
    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        for notebook in (n for n in todo if n in ALONE):
            one(notebook)
        for future in [pool.submit(one, n) for n in todo if n not in ALONE]:
            future.result()
    except KeyboardInterrupt:
        stopping.set()
        stop_gracefully([c for c in children if c.poll() is None])
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def run_step(step: str, out: Path, *, force: bool = False, jobs: int = 1) -> dict[str, Any]:
    """Run one step unless it passed before; its output goes to <out>/<step>.log (with --jobs, per notebook in
    <out>/notebooks/, and a notebooks step resumes: those that passed are not run again); returns its record."""
    record_file = out / "steps.json"
    steps = json.loads(record_file.read_text()) if record_file.is_file() else {}
    if steps.get(step, {}).get("status") == "passed" and not force:
        print(f"{step}: passed before ({steps[step]['seconds']:.0f} s), skipped (--force reruns it)", flush=True)
        return steps[step]
    env = {**os.environ, "LABKIT_PROFILE": PROFILE}
    started, status, extra = time.monotonic(), "passed", {}
    if step == "notebooks" and jobs > 1:
        by_notebook: dict[str, Any] = {} if force else dict(steps.get(step, {}).get("notebooks", {}))
        extra = {"jobs": jobs, "notebooks": by_notebook}
        try:  # recorded as each notebook ends: a call killed outright keeps what ended before
            run_notebooks_at_once(out, jobs, env, by_notebook, lambda: _record(out, step, "running", started, extra))
        except KeyboardInterrupt:
            _record(out, step, "interrupted", started, extra)
            raise
        failed = [n for n, r in by_notebook.items() if r["status"] != "passed"]
        status = f"failed ({', '.join(failed)})" if failed else "passed"
    else:
        try:
            with open(out / f"{step}.log", "w") as log:
                for command in step_commands(step, out):
                    print(f"{step}: {' '.join(command)}", flush=True)
                    code = run_command(command, env, log)
                    if code != 0:
                        status = f"failed (exit {code})"
                        break
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        finally:
            if step == "answer" and status != "passed":
                partial = keep_partial(ANSWER_DIR, out)
                if partial is not None:
                    print(f"answer: {status}; what it measured so far is in {partial}", flush=True)
                    extra = {"partial": str(partial.relative_to(out))}
                if status == "interrupted":
                    _record(out, step, status, started, extra)
    record = _record(out, step, status, started, extra)
    print(f"{step}: {status} in {record['seconds']:.0f} s (log: {out / record['log']})", flush=True)
    return record


def _record(out: Path, step: str, status: str, started: float, extra: dict[str, Any]) -> dict[str, Any]:
    """Write the step's record into <out>/steps.json beside the others'; returns it."""
    record = {"status": status, "seconds": round(time.monotonic() - started, 1),
              "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "log": "notebooks/" if "notebooks" in extra else f"{step}.log", **extra}
    record_file = out / "steps.json"
    steps = json.loads(record_file.read_text()) if record_file.is_file() else {}
    record_file.write_text(json.dumps({**steps, step: record}, indent=1) + "\n")
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


def _jobs(text: str) -> int:
    """--jobs: a whole number of notebooks at once, 1 or more (0 and -1 were taken as 1)."""
    if not re.fullmatch(r"[0-9]+", text.strip()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a number of notebooks at once, 1 or more, got {text!r}")
    return int(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=(*STEPS, "all"))
    parser.add_argument("--force", action="store_true", help="run a step again even if it passed")
    parser.add_argument("--out", type=Path, default=None, help="default: data/reference-<gpu-slug>")
    parser.add_argument("--jobs", type=_jobs, default=1,
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

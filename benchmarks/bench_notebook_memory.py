"""What a notebook asks of a learner's machine: peak summed RSS and wall time under nbval.

    python benchmarks/bench_notebook_memory.py notebooks/03-zero3-multi-gpu.ipynb [more.ipynb ...]
        [--limit-bytes 8e9] [--json out.json]

Runs each notebook as CI does (`LABKIT_PROFILE=ci python -m pytest --nbval-lax NB`), in a
fresh run store, and samples once a second, with psutil, the RSS of every process of the
notebook's Jupyter kernel and its descendants: the kernel, each run's supervisor, DeepSpeed's
launcher and launch.py, the rank guards and the ranks. It prints, per notebook: the peak of
that sum (RSS summed over processes: pages shared between them, torch's libraries for one, count
once per process, as they would on the laptop's meter of each process), the most rank processes
alive at one sample, the wall time of the pytest command and the load average before it started
(the machine may be shared: compare figures taken back to back), and the CPU seconds pytest and
everything below it used (what other people's load does not change much: on a busy machine more
processes at once get a larger share of the cores, so wall times favour whichever runs more at once).

The notebook runs in its own checkout (the nearest folder above it with a pyproject.toml, put
first on PYTHONPATH), so a copy of another commit measures that commit's labkit: before/after pairs
back to back. `--limit-bytes` sets `LABKIT_MEMORY_LIMIT_BYTES` for the notebook (a simulated smaller machine:
labkit.launch.admission). The notebook's pass/fail is pytest's exit code, printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from labkit.launch.admission import runs_module

REPO = Path(__file__).resolve().parent.parent
RANK_MODULE = "labkit.rank.worker"  # a rank's training process (under its rank guard)
SAMPLE_S = 1.0


def kernels(root: psutil.Process) -> list[psutil.Process]:
    """The Jupyter kernels among `root`'s descendants (nbval starts one per notebook)."""
    found = []
    for proc in root.children(recursive=True):
        try:
            if "ipykernel_launcher" in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def tree_sample(kernel: psutil.Process) -> tuple[int, int, int]:
    """(summed RSS of the kernel and every descendant, rank processes among them, the kernel's own RSS);
    a process that ends while it is read is left out."""
    total, ranks, own = 0, 0, 0
    try:
        procs = [kernel, *kernel.children(recursive=True)]
    except psutil.Error:
        return 0, 0, 0
    for proc in procs:
        try:
            rss = proc.memory_info().rss
            total += rss
            own = rss if proc is kernel else own
            if runs_module(proc.cmdline(), RANK_MODULE):
                ranks += 1
        except psutil.Error:
            continue
    return total, ranks, own


def _children_cpu_s() -> float:
    """CPU seconds (user + system) of every descendant this process has reaped: pytest, the kernel, and each
    run's processes (each parent waits for its children, so their times add up to pytest's)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def checkout_of(notebook: Path) -> Path:
    """The checkout a notebook belongs to: the nearest folder above it with a pyproject.toml."""
    for folder in notebook.parents:
        if (folder / "pyproject.toml").is_file():
            return folder
    raise SystemExit(f"{notebook} is not inside a checkout (no pyproject.toml above it)")


def measure(notebook: Path, limit_bytes: float | None) -> dict:
    checkout = checkout_of(notebook)
    env = {**os.environ, "LABKIT_PROFILE": "ci", "PYTHONPATH": str(checkout)}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    if limit_bytes is not None:
        env["LABKIT_MEMORY_LIMIT_BYTES"] = str(int(limit_bytes))
    with tempfile.TemporaryDirectory(prefix="bench-nb-memory-") as runs:
        env["LABKIT_RUNS_DIR"] = runs
        load = os.getloadavg()
        cpu_before = _children_cpu_s()
        started = time.monotonic()
        log_path = Path(runs) / "pytest.log"  # a file, not a pipe: a long failure report cannot block pytest
        with open(log_path, "w") as log:
            pytest = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
                                       str(notebook)], cwd=checkout, env=env, stdout=log, stderr=subprocess.STDOUT)
            root = psutil.Process(pytest.pid)
            peak, peak_ranks, peak_kernel, samples = 0, 0, 0, 0
            while pytest.poll() is None:
                for kernel in kernels(root):
                    total, ranks, own = tree_sample(kernel)
                    peak, peak_ranks, peak_kernel = max(peak, total), max(peak_ranks, ranks), max(peak_kernel, own)
                    samples += 1
                time.sleep(SAMPLE_S)
        output = log_path.read_text(errors="replace")
        wall = time.monotonic() - started
        cpu = _children_cpu_s() - cpu_before
    return {"notebook": notebook.name, "checkout": str(checkout), "exit_code": pytest.returncode,
            "peak_rss_bytes": peak, "kernel_peak_rss_bytes": peak_kernel,
            "peak_rank_processes": peak_ranks, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "samples": samples,
            "load_average_before": [round(x, 2) for x in load], "limit_bytes": limit_bytes,
            "pytest_tail": output.strip().splitlines()[-1:] if output else [],
            "failure": output[-6000:] if pytest.returncode else None}  # what failed: the temporary log goes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--limit-bytes", type=float, default=None,
                        help="LABKIT_MEMORY_LIMIT_BYTES for the notebook: a simulated smaller machine")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    results = []
    for notebook in args.notebooks:
        result = measure(notebook.resolve(), args.limit_bytes)
        results.append(result)
        print(f"{result['notebook']}: exit {result['exit_code']}, peak {result['peak_rss_bytes'] / 1e9:.2f} GB summed "
              f"RSS (kernel tree; the kernel alone {result['kernel_peak_rss_bytes'] / 1e9:.2f} GB), "
              f"{result['peak_rank_processes']} rank processes at most, {result['wall_s']:.0f} s "
              f"wall, {result['cpu_s']:.0f} CPU-s, load average before {result['load_average_before'][0]:.2f} "
              f"({' '.join(result['pytest_tail'])})", flush=True)
        if result["failure"]:
            print(result["failure"], flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(r["exit_code"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Small helpers the lesson notebooks (notebooks/00-04) share, so no notebook copies code.

    from labkit import lessons
    runs = lessons.launch_all({"stage 0": RunConfig(...), "stage 1": RunConfig(...)})
    lessons.summary_table(runs)          # one row per run: status, timings, batch
    lessons.rank_table(runs)             # one row per (run, rank): model-state bytes in MiB
    lessons.stacked_bars(table, [...])   # a static plotly bar chart

Everything here reads what the runs recorded (`Run.summary`, `Run.records()`, the rank
logs); nothing is estimated except where a function says so.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from labkit.config import ConfigError, RunConfig
from labkit.run import Run

MiB = 2**20

# Per-rank byte counters of a run summary, in the order the notebooks show them.
STATE_COLUMNS = ("param_bytes", "grad_bytes", "optim_bytes", "master_bytes")
RANK_COLUMNS = (*STATE_COLUMNS, "host_optim_bytes", "host_grad_bytes", "activation_bytes", "peak_rss_bytes",
                "device_peak_bytes")
SUMMARY_COLUMNS = ("status", "example", "stage", "offload_optimizer", "precision", "world_size", "micro_batch",
                   "grad_accum", "global_batch", "steps_completed", "median_step_time_s", "forward_s",
                   "backward_s", "optimizer_s", "samples_per_s", "final_loss", "wall_time_s")


# -- launching ---------------------------------------------------------------------------
def launch_all(configs: Mapping[str, RunConfig], timeout_s: float | None = None,
               concurrent: bool | None = None) -> dict[str, Run]:
    """Run every config; returns {label: Run}, finished or not (check `require`).

    On CPU ranks they all start at once, each with its own port: process start-up (Python,
    torch, DeepSpeed, the process group) is most of a small run's time and much of it is
    waiting, so the start-ups overlap instead of adding up. On GPUs they run one after the
    other (`concurrent=False`): every run's rank 0 uses the first GPU, and runs sharing a GPU
    would take each other's memory. `timeout_s` bounds each run.
    """
    from labkit.devices import detect_devices

    if concurrent is None:
        concurrent = detect_devices().is_cpu
    start = time.monotonic()
    runs: dict[str, Run] = {}

    def finish(run: Run) -> None:
        run.wait(timeout=timeout_s)
        if not run.done:
            run.stop()

    try:
        for label, config in configs.items():
            runs[label] = Run(config).start()
            if not concurrent:
                finish(runs[label])
        for run in runs.values():
            finish(run)
    except KeyboardInterrupt:  # Ctrl-C in the kernel: no run it started goes on unattended
        for run in runs.values():
            run.stop()
        raise
    statuses = ", ".join(f"{label}: {run.status}" for label, run in runs.items())
    print(f"{len(runs)} run(s) in {time.monotonic() - start:.0f} s ({statuses})")
    return runs


def require(runs: Mapping[str, Run], status: str = "finished") -> None:
    """Raise, naming the run and DeepSpeed's cause, if a run did not end with `status`."""
    wrong = {label: run for label, run in runs.items() if run.status != status}
    if wrong:
        lines = [f"{label}: {run.status} ({run.cause}) in {run.run_dir}" for label, run in wrong.items()]
        raise RuntimeError(f"expected every run to be {status!r}:\n" + "\n".join(lines))


def config_error(**fields: Any) -> str | None:
    """Build a RunConfig; return ConfigError's message if it refuses (nothing is launched), else None."""
    try:
        RunConfig(**fields)
    except ConfigError as exc:
        return str(exc)
    return None


# -- tables ------------------------------------------------------------------------------
def mib(value: float | None) -> float | None:
    return None if value is None else value / MiB


def summary_table(runs: Mapping[str, Run], columns: Sequence[str] = SUMMARY_COLUMNS) -> pd.DataFrame:
    """One row per run (index: its label) with the summary's headline numbers."""
    rows = {label: {key: (run.summary or {}).get(key) for key in columns} for label, run in runs.items()}
    return pd.DataFrame.from_dict(rows, orient="index", columns=list(columns))


def rank_table(runs: Mapping[str, Run], columns: Sequence[str] = RANK_COLUMNS, *, in_mib: bool = True) -> pd.DataFrame:
    """One row per (run, rank) with what that rank held; bytes shown in MiB unless `in_mib=False`.

    Columns no rank recorded (device peak on CPU, for one) are dropped.
    """
    rows = []
    for label, run in runs.items():
        for rank, values in sorted(((run.summary or {}).get("per_rank") or {}).items(), key=lambda kv: int(kv[0])):
            row = {"run": label, "rank": int(rank)}
            for key in columns:
                value = values.get(key)
                row[key.replace("_bytes", "_MiB") if in_mib else key] = mib(value) if in_mib else value
            rows.append(row)
    table = pd.DataFrame(rows).set_index(["run", "rank"])
    return table.dropna(axis=1, how="all")


def fit_line(x: Iterable[float], y: Iterable[float]) -> tuple[float, float]:
    """Least-squares (slope, intercept) of y against x."""
    import numpy as np

    slope, intercept = np.polyfit(np.asarray(list(x), dtype=float), np.asarray(list(y), dtype=float), 1)
    return float(slope), float(intercept)


def step_records(run: Run, rank: int = 0) -> pd.DataFrame:
    """The per-step records of one rank as a table (step, loss, epoch, times, bytes...)."""
    records = [r for r in run.records().get(rank, []) if r.get("event") == "step"]
    return pd.DataFrame(records).set_index("step") if records else pd.DataFrame()


def maxbatch_result(runs: Mapping[str, Run], capacity_bytes: int, *, emulated: bool):
    """Runs of one configuration at several micro-batches, read as a max-batch search.

    Returns a `labkit.maxbatch.MaxBatchResult` whose probes are these runs (sorted by
    micro-batch; counted bytes as `labkit.sweep.row_from_run` reads them), so its
    `activation_fit()`, `predicted_max_micro_batch` and `consistent()` are the max-batch
    search's own. `capacity_bytes`: the emulated budget (CPU) or the device's memory (GPU).
    """
    from labkit.maxbatch import MaxBatchResult, Probe, int_or_none
    from labkit.sweep import row_from_run, strategy_of

    probes = []
    for run in sorted(runs.values(), key=lambda r: r.config.micro_batch):
        row = row_from_run(run.run_dir) or {}
        probes.append(Probe(run.config.micro_batch, run.status, int_or_none(row.get("device_bytes")),
                            int_or_none(row.get("activation_bytes")), row.get("run_id"), False))
    first = next(iter(runs.values())).config
    return MaxBatchResult(strategy=strategy_of(first), world_size=first.world_size, budget_bytes=capacity_bytes,
                          emulated=emulated, max_micro_batch=max((p.micro_batch for p in probes if p.fits), default=0),
                          first_oom=min((p.micro_batch for p in probes if p.status == "oom"), default=None),
                          probes=probes)


# -- charts ------------------------------------------------------------------------------
def stacked_bars(table: pd.DataFrame, columns: Sequence[str], *, title: str, yaxis: str,
                 xaxis: str | None = None):
    """A static stacked bar chart: one bar per row of `table`, one segment per column."""
    import plotly.graph_objects as go

    x = [" / ".join(map(str, i)) if isinstance(i, tuple) else str(i) for i in table.index]
    fig = go.Figure([go.Bar(name=c, x=x, y=table[c]) for c in columns if c in table])
    fig.update_layout(barmode="stack", title=title, yaxis_title=yaxis, xaxis_title=xaxis or table.index.name,
                      height=380, margin=dict(t=50, b=40))
    return fig


def line_chart(table: pd.DataFrame, x: str, ys: Sequence[str], *, title: str, yaxis: str,
               log_x: bool = False, log_y: bool = False, markers: bool = True):
    """A static line chart of `ys` against column `x` of `table`."""
    import plotly.graph_objects as go

    mode = "lines+markers" if markers else "lines"
    fig = go.Figure([go.Scatter(name=y, x=table[x], y=table[y], mode=mode) for y in ys if y in table])
    fig.update_layout(title=title, xaxis_title=x, yaxis_title=yaxis, height=380, margin=dict(t=50, b=40))
    if log_x:
        fig.update_xaxes(type="log")
    if log_y:
        fig.update_yaxes(type="log")
    return fig


# -- what DeepSpeed communicated ---------------------------------------------------------
def comms_logger_overrides() -> dict[str, Any]:
    """`ds_overrides` that make DeepSpeed log every collective it runs, with the DeepSpeed
    function that called it (one line each in rank 0's log).

    The comms logger reports at INFO level and DeepSpeed's logger defaults to WARNING, so the
    run's top-level `log_level` (read by `DeepSpeedConfig`, applied by the engine) must be
    "info" too; otherwise the run logs nothing and `comm_log` comes back empty.
    """
    return {"comms_logger": {"enabled": True, "verbose": True, "prof_all": True, "debug": True},
            "log_level": "info"}


_COMM_LINE = re.compile(r"^\[(?P<when>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\].*?comm op: (?P<op>[\w.]+)"
                        r"(?: \| \[Caller Func: (?P<caller>[^\]]*)\])? \| time \(ms\): (?P<ms>[\d.]+) "
                        r"\| msg size: (?P<size>[\d.]+) ?(?P<unit>[KMGT]?B)", re.MULTILINE)
_SIZE_UNITS = {"B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40}


def rank_log_text(run: Run, rank: int = 0) -> str:
    """Everything rank `rank` printed (DeepSpeed's launcher writes one log per rank)."""
    logs = sorted((Path(run.run_dir) / "logs").glob(f"*rank{rank}.log"))
    return "\n".join(path.read_text(errors="replace") for path in logs)


def _step_ends(run: Run, rank: int) -> tuple[float | None, list[tuple[int, float]]]:
    """(wall time the rank became ready, [(step, wall time the step ended)]) from its records."""
    records = run.records().get(rank, [])
    start = next((r for r in records if r.get("event") == "start"), None)
    if start is None:
        return None, []
    origin = start["wall_time"] - start["time_s"]
    ready = next((origin + r["time_s"] for r in records if r.get("event") == "ready"), None)
    return ready, [(r["step"], origin + r["time_s"]) for r in records if r.get("event") == "step"]


def comm_log(run: Run, rank: int = 0) -> pd.DataFrame:
    """Every collective the comms logger recorded (a run launched with `comms_logger_overrides()`).

    One row per call, in order: the operation, the DeepSpeed function that called it,
    its message size in bytes as DeepSpeed reports it, its time, and the phase it fell in:
    "setup" (before the first step), the optimizer step it belongs to, or "teardown".
    Phases come from the log's millisecond timestamps against the rank's step records.
    """
    from datetime import datetime

    ready, ends = _step_ends(run, rank)
    rows = []
    for match in _COMM_LINE.finditer(rank_log_text(run, rank)):
        when = datetime.strptime(match["when"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if ready is None or when < ready:
            phase: str | int = "setup"
        else:
            phase = next((step for step, end in ends if when <= end), "teardown")
        rows.append({"phase": phase, "op": match["op"], "called from": (match["caller"] or "").strip(),
                     "bytes": float(match["size"]) * _SIZE_UNITS[match["unit"]], "ms": float(match["ms"])})
    return pd.DataFrame(rows, columns=["phase", "op", "called from", "bytes", "ms"])


def comm_ops(run: Run, rank: int = 0, first_steps: int = 2) -> pd.DataFrame:
    """The collectives of `comm_log`, counted by phase: setup, the first `first_steps` steps
    together (ZeRO-3 records and cross-checks its module trace there), and the mean of the
    later steps."""
    log = comm_log(run, rank)
    later = sorted({p for p in log["phase"] if isinstance(p, int) and p > first_steps})
    early = f"steps 1-{first_steps} (total)" if first_steps > 1 else "step 1"
    log["when"] = [p if isinstance(p, str) else early if p <= first_steps else "each later step (mean)"
                   for p in log["phase"]]
    table = log.groupby(["when", "op", "called from"], sort=False).agg(
        calls=("bytes", "size"), MiB=("bytes", "sum")).reset_index()
    table["calls"] = table["calls"].astype(float)
    mean = table["when"] == "each later step (mean)"
    if later:
        table.loc[mean, "calls"] = table.loc[mean, "calls"] / len(later)
        table.loc[mean, "MiB"] = table.loc[mean, "MiB"] / len(later)
    table["MiB"] = table["MiB"] / MiB
    return table


# -- environment (00-setup) --------------------------------------------------------------
def ds_report(lines: Sequence[str] = ("torch version", "deepspeed info", "deepspeed wheel compiled",
                                      "torch install path", "deepspeed install path", "shared memory",
                                      "cpu_adam", "fused_adam", "deepspeed_shm_comm"),
              timeout_s: float = 300) -> str:
    """The lines of DeepSpeed's environment report (`ds_report`) that mention any of `lines`.

    Runs `python -m deepspeed.env_report` in a subprocess (it is what the `ds_report`
    command runs), so this kernel's state does not matter.
    """
    result = subprocess.run([sys.executable, "-m", "deepspeed.env_report"], capture_output=True, text=True,
                            timeout=timeout_s)
    text = re.sub(r"\x1b\[[0-9;]*m", "", result.stdout)  # drop the colour codes
    wanted = [line.rstrip() for line in text.splitlines() if any(key in line.lower() for key in lines)]
    return "\n".join(wanted) if wanted else text[-2000:]


def build_ops(timeout_s: float = 1800) -> str:
    """Build (or load from the cache) DeepSpeed's JIT ops in a child process: `python -m labkit.ops`.

    Not in this kernel: on a GPU, loading the CUDA ops would give the kernel a device context
    on GPU 0 that rank 0 then shares for the whole session. Raises with the build log on failure."""
    result = subprocess.run([sys.executable, "-m", "labkit.ops"], capture_output=True, text=True, timeout=timeout_s)
    if result.returncode != 0:
        raise RuntimeError(f"building DeepSpeed's ops failed:\n{result.stdout[-2000:]}{result.stderr[-3000:]}")
    return "\n".join(line for line in result.stdout.splitlines() if ": " in line and "WARNING" not in line)


# -- DeepSpeed's own batch check, without launching ----------------------------------------
class _DataParallelGroup:
    """What `DeepSpeedConfig` asks its `mpu` argument: the data-parallel world size."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    def get_data_parallel_world_size(self) -> int:
        return self.world_size


def deepspeed_batch_check(ds_config: dict[str, Any], world_size: int) -> str:
    """What DeepSpeed's own config parser makes of a config's batch keys on `world_size` ranks.

    Builds `deepspeed.runtime.config.DeepSpeedConfig` in this process, telling it the
    data-parallel size instead of starting ranks. Returns the derived triplet, or the
    assertion DeepSpeed would stop every rank with after they had started.
    """
    from unittest import mock

    from deepspeed.runtime.config import DeepSpeedConfig

    try:
        # No process group exists here; DeepSpeedConfig only asks it for this rank's number.
        with mock.patch("deepspeed.comm.get_rank", return_value=0):
            parsed = DeepSpeedConfig(dict(ds_config), mpu=_DataParallelGroup(world_size))
    except AssertionError as exc:
        return f"DeepSpeed refuses it: AssertionError: {exc}"
    return (f"DeepSpeed accepts it: train_batch_size {parsed.train_batch_size} = micro "
            f"{parsed.train_micro_batch_size_per_gpu} x accumulation {parsed.gradient_accumulation_steps} "
            f"x {world_size} rank(s)")

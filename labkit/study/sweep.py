"""Batch-size sweep: supervised runs over strategies x global batch sizes (x world sizes).

    from labkit.study.sweep import plan, Sweep
    points = plan(["torch", "z0", "z3"], global_batches=[64, 256], world_sizes=[2],
                  base=dict(hidden=256, steps=300, target_loss=1.0, stop_at_target=True))
    table = Sweep(points, out="runs/my-sweep", parallel=2).run()   # a pandas DataFrame

Every point is a real `labkit.Run` (its own supervisor, OOM classified: status `oom`). The
results are a tidy table, one row per point, written to `<out>/results.csv` after every point;
the run directories live in `<out>/runs/`. A point is keyed by its full `RunConfig`, so a sweep
that is interrupted (Ctrl-C, a killed kernel) and started again reuses every point that already
finished or ran out of device memory, from the CSV or from the run directories, and launches only
the rest (`Sweep.launched` counts the new launches). The key also holds `MEASUREMENT_VERSION`
(recorded in each run directory the sweep launches, as `point.json`), so points measured by an
older labkit are launched again. Failed, hung and stopped points are launched
again next time; within one sweep a failed or hung point, or one the host's kernel OOM killer
ended (host memory, shared with other jobs, is not the device capacity being measured), is
retried once (`retries`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from labkit.core.config import ConfigError, RunConfig
from labkit.core.files import read_json, write_json_atomic, write_text_atomic
from labkit.core.schema import CENSUS_KEYS, device_bytes, state_bytes
from labkit.launch.launch_spec import LaunchSpec
from labkit.launch.store import run_dirs

# Strategy name -> RunConfig fields. "torch" is the plain PyTorch loop (one process).
STRATEGIES: dict[str, dict[str, Any]] = {
    "torch": {"example": "pytorch"},
    "z0": {"example": "zero3", "stage": 0, "offload_optimizer": False},
    "z1": {"example": "zero3", "stage": 1, "offload_optimizer": False},
    "z2": {"example": "zero3", "stage": 2, "offload_optimizer": False},
    "z3": {"example": "zero3", "stage": 3, "offload_optimizer": False},
    "z2-offload": {"example": "offload", "stage": 2, "offload_optimizer": True},
    "z3-offload": {"example": "zero3", "stage": 3, "offload_optimizer": True},
}
STRATEGY_LABELS = {
    "torch": "plain PyTorch", "z0": "ZeRO-0 (DDP)", "z1": "ZeRO-1", "z2": "ZeRO-2", "z3": "ZeRO-3",
    "z2-offload": "ZeRO-2 + optimizer offload", "z3-offload": "ZeRO-3 + optimizer offload",
}
# A finished or out-of-(device-)memory point is never launched again (see `settled`); a point
# the host's kernel OOM killer ended is no evidence about the device capacity being measured.
HOST_OOM = "OOM killer"
RETRY_STATUSES = ("failed", "hung")  # retried once within a sweep (a loaded machine times out, drops sockets)
_OOM_NEEDS = re.compile(r"needs (\d+) bytes")
# A point's numbers depend on how labkit measures, not only on its RunConfig: bump this when the
# census or the emulated-capacity accounting changes, so cached points (OOM verdicts included) are
# measured again. 2: grad partitions that optimizer offload keeps on the host (host_grad_bytes)
# no longer count as device bytes. Run directories without a point file were measured by 1.
# 3: one timed run at a time, held-out eval loss. 4: batches collated and moved to the device outside the timed step.
MEASUREMENT_VERSION = 4
POINT_FILE = "point.json"  # {"key", "measurement_version", "concurrent_runs"}, written by Sweep into its runs

COLUMNS = [
    "key", "strategy", "growth", "example", "stage", "offload_optimizer", "precision", "world_size", "micro_batch",
    "grad_accum", "global_batch", "threads_per_rank", "concurrent_runs", "lr_scaling", "peak_lr", "warmup_steps",
    "warmup_samples", "target_loss", "target_measured_on", "eval_every", "status", "cause",
    "steps_completed", "median_step_time_s", "samples_per_s", "time_per_epoch_s", "steps_to_target",
    "epochs_to_target", "time_to_target_s", "train_time_to_target_s", "compute_time_to_target_s", "final_loss",
    "eval_loss", "eval_time_s", "wall_time_s", "n_params",
    "param_bytes", "grad_bytes", "optim_bytes", "master_bytes", "host_optim_bytes", "host_grad_bytes",
    "buffer_bytes", "model_state_bytes", "activation_bytes", "device_bytes", "device_budget_bytes", "peak_rss_bytes",
    "device_peak_bytes", "noise_scale", "noise_g2", "noise_trace", "noise_probes", "run_id", "run_dir",
]


class UnfairTiming(ConfigError):
    """A timed sweep whose runs could share cores or devices (their step times would be confounded)."""


def fair_parallel(points: Sequence[RunConfig], *, cores: int, devices: int | None = None,
                  is_cpu: bool = True) -> int:
    """How many of `points` may run at once with none sharing a core (CPU: threads per rank x ranks
    x launches <= cores) or a device (GPU: ranks x launches <= devices). At least 1."""
    from labkit.launch.launcher import threads_per_rank

    if not points:
        return 1
    if is_cpu:
        widest = max(threads_per_rank(p, cores) * p.world_size for p in points)
        return max(1, cores // widest)
    return max(1, (devices or 1) // max(p.world_size for p in points))


def check_fair(points: Sequence[RunConfig], parallel: int, *, cores: int, devices: int | None = None,
               is_cpu: bool = True) -> None:
    """Refuse, before anything launches, a timed sweep that could oversubscribe the machine."""
    allowed = fair_parallel(points, cores=cores, devices=devices, is_cpu=is_cpu)
    if parallel > allowed:
        from labkit.launch.launcher import threads_per_rank

        widest = max(points, key=lambda p: (threads_per_rank(p, cores) if is_cpu else 1) * p.world_size)
        what = (f"{threads_per_rank(widest, cores)} threads x {widest.world_size} ranks on {cores} cores" if is_cpu
                else f"{widest.world_size} ranks on {devices} devices")
        raise UnfairTiming("parallel", f"{parallel} would let timed runs share the machine ({what}): at most "
                           f"{allowed} at a time; pass timed=False for untimed work (memory probes)")


class SweepCancelled(Exception):
    """The sweep's `cancel` event was set: runs in flight were stopped, finished points kept."""


# A finished run's supervisor holds its device lease until it exits, normally a few seconds after the
# summary. The sweep launches nothing on those devices (and does not return) until it has; past this, it
# gives up naming the run.
LEASE_RELEASE_TIMEOUT_S = 120.0


class LeaseNotReleased(RuntimeError):
    """A finished run's supervisor still holds the run's devices long after its summary: the sweep's next
    point would be refused (DevicesBusy). Finished points are kept; the sweep resumes once it is gone."""

    def __init__(self, message: str, *, run_dir: Path, supervisor_pid: int | None):
        super().__init__(message)
        self.run_dir = run_dir
        self.supervisor_pid = supervisor_pid


def settled(status: Any, cause: Any) -> bool:
    """A result that stands: finished, or out of *device* memory (real or emulated capacity)."""
    return status == "finished" or (status == "oom" and HOST_OOM not in str(cause or ""))


def strategy_of(config: RunConfig | dict[str, Any]) -> str:
    """The strategy name of a config (inverse of STRATEGIES)."""
    c = config if isinstance(config, dict) else config.to_dict()
    if c["example"] == "pytorch":
        return "torch"
    return f"z{c['stage']}" + ("-offload" if c["offload_optimizer"] else "")


def point_key(config: RunConfig | dict[str, Any], measurement_version: int = MEASUREMENT_VERSION) -> str:
    """A stable id of a point: a hash of its whole config (the detected device count excluded)
    and of the measurement version that measures it."""
    data = config.to_dict() if isinstance(config, RunConfig) else dict(config)
    data = json.loads(json.dumps(data, default=str))  # the form config.json holds
    data.pop("max_world_size", None)
    # The default model leaves the key as it was before models were selectable: old points stay reusable.
    for name, default in (("model", "mlp"), ("data", None), ("loss", None), ("script", None), ("script_args", []),
                          ("sample_with_replacement", False)):
        if data.get(name, default) == default:
            data.pop(name, None)
    data["measurement_version"] = measurement_version
    return hashlib.sha1(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]


def run_key(run_dir: str | os.PathLike, config: dict[str, Any]) -> str:
    """The point key of a run directory, with the measurement version that measured it."""
    point = read_json(Path(run_dir) / POINT_FILE) or {}
    return point_key(config, int(point.get("measurement_version") or 1))


def split_batch(global_batch: int, world_size: int, max_micro_batch: int | None = None) -> tuple[int, int] | None:
    """(micro_batch, grad_accum) for a global batch: the biggest micro-batch allowed, the rest
    by gradient accumulation. None if the batch does not split evenly over the ranks."""
    if global_batch % world_size:
        return None
    per_rank = global_batch // world_size
    cap = max_micro_batch or per_rank
    for accum in range(1, per_rank + 1):
        if per_rank % accum == 0 and per_rank // accum <= cap:
            return per_rank // accum, accum
    return None


def plan(strategies: Sequence[str], global_batches: Sequence[int], world_sizes: Sequence[int] = (2,), *,
         base: dict[str, Any] | None = None, lr_scalings: Sequence[str] = ("sqrt",),
         max_micro_batch: dict[str, int] | None = None) -> list[RunConfig]:
    """The sweep's points as validated `RunConfig`s, in a stable order.

    The plain PyTorch strategy is single-process, so it runs at world size 1 only (once, whatever
    `world_sizes` says). `max_micro_batch` (strategy -> micro-batch, e.g. from the max-batch
    search) caps the micro-batch; a bigger global batch then uses gradient accumulation.
    """
    base = dict(base or {})
    points: list[RunConfig] = []
    seen: set[str] = set()
    for strategy in strategies:
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; known: {sorted(STRATEGIES)}")
        for world_size in ([1] if strategy == "torch" else world_sizes):
            for scaling in lr_scalings:
                for batch in global_batches:
                    split = split_batch(batch, world_size, (max_micro_batch or {}).get(strategy))
                    if split is None:
                        continue
                    config = RunConfig(**{**base, **STRATEGIES[strategy], "world_size": world_size,
                                          "micro_batch": split[0], "grad_accum": split[1], "lr_scaling": scaling})
                    key = point_key(config)
                    if key not in seen:
                        seen.add(key)
                        points.append(config)
    return points


# -- one row per run ------------------------------------------------------------------------
def row_from_run(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The results row of a finished run directory (None while it has no summary)."""
    from labkit.launch.summary import rank_records, steps_of
    from labkit.study.noise_scale import from_records

    run_dir = Path(run_dir)
    summary = read_json(run_dir / "summary.json")
    config = read_json(run_dir / "config.json")
    if not summary or not config:
        return None
    records = rank_records(run_dir, config["world_size"])
    rank0 = steps_of(records.get(0, []))
    global_batch = config["micro_batch"] * config["grad_accum"] * config["world_size"]
    step_time = summary.get("median_step_time_s")
    steps_to_target = summary.get("steps_to_target")
    # Compute time to the target: rank 0's step times up to that step (no process start, no probes).
    train_time = (sum(r["step_time_s"] for r in rank0 if r["step"] <= steps_to_target)
                  if steps_to_target else None)
    finished = summary.get("status") == "finished"
    row: dict[str, Any] = {
        "key": run_key(run_dir, config),
        "strategy": strategy_of(config),
        **{k: config.get(k) for k in ("example", "stage", "offload_optimizer", "precision", "world_size",
                                       "micro_batch", "grad_accum", "lr_scaling", "warmup_samples", "target_loss",
                                       "eval_every")},
        "warmup_steps": RunConfig.from_saved(config).warmup_steps_effective,
        "threads_per_rank": _threads_of(run_dir),
        "concurrent_runs": (read_json(run_dir / POINT_FILE) or {}).get("concurrent_runs"),
        "global_batch": global_batch,
        "peak_lr": RunConfig.from_saved(config).peak_lr,
        **{k: summary.get(k) for k in ("status", "cause", "steps_completed", "median_step_time_s", "samples_per_s",
                                        "steps_to_target", "time_to_target_s", "final_loss", "wall_time_s",
                                        "n_params", "target_measured_on", "eval_loss", "eval_time_s")},
        # An epoch is dataset_size samples over all ranks (the distributed sampler shards it).
        # Only for finished points: a run that stopped early has no steady-state step time.
        "time_per_epoch_s": step_time * config["dataset_size"] / global_batch if step_time and finished else None,
        "epochs_to_target": steps_to_target * global_batch / config["dataset_size"] if steps_to_target else None,
        "train_time_to_target_s": train_time,
        # Robust to stalls on a shared machine: what the same steps take at the typical step time.
        "compute_time_to_target_s": steps_to_target * step_time if steps_to_target and step_time else None,
        "device_budget_bytes": config.get("device_memory_budget_bytes"),
        "run_id": run_dir.name,
        "run_dir": str(run_dir),
    }
    row.update(_memory_columns(records))
    noise = from_records(rank0, skip_first=0)
    row.update(noise.as_dict() if noise else {})
    return row


def _threads_of(run_dir: Path) -> int | None:
    """The OpenMP threads each CPU rank was given (launch.json); None for GPU ranks."""
    spec = LaunchSpec.read(run_dir)
    threads = spec.env.get("OMP_NUM_THREADS") if spec else None
    return int(threads) if threads else None


def _memory_columns(records: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per-rank bytes: the largest over ranks (ZeRO ranks differ only by padding)."""
    keys = CENSUS_KEYS
    out: dict[str, Any] = {}
    per_rank: list[dict[str, Any]] = []
    for rank_records in records.values():
        last = next((r for r in reversed(rank_records) if "param_bytes" in r), None)
        activation = max((r.get("activation_bytes") or 0 for r in rank_records), default=0) or None
        needed = None
        for r in rank_records:
            if r.get("event") == "error":
                match = _OOM_NEEDS.search(r.get("message") or "")
                needed = int(match.group(1)) if match else None
        states = {k: (last or {}).get(k) for k in keys}
        device = None
        if last is not None:
            # What labkit's emulated capacity check counts: model states on the device + activations
            # (what optimizer offload keeps on the host left out).
            device = device_bytes(states, activation or 0)
        per_rank.append({**states, "activation_bytes": activation, "device_bytes": needed or device,
                         "peak_rss_bytes": max((r.get("peak_rss_bytes") or 0 for r in rank_records), default=0) or None,
                         "device_peak_bytes": max((r.get("device_peak_bytes") or 0 for r in rank_records),
                                                  default=0) or None})
    for key in (*keys, "activation_bytes", "device_bytes", "peak_rss_bytes", "device_peak_bytes"):
        values = [p[key] for p in per_rank if p.get(key) is not None]
        out[key] = max(values) if values else None
    if out.get("param_bytes") is not None:
        out["model_state_bytes"] = state_bytes(out)
    return out


# -- the sweep --------------------------------------------------------------------------------
@dataclass
class Sweep:
    """Runs `points` (RunConfigs), at most `parallel` at a time, keeping results in `out`.

    `results_name` names the CSV (None: no CSV, the run directories alone remember the points);
    `extra` adds constant columns to every row, `point_extra` (key -> columns) columns of one point
    (the answer's `growth`). `progress` shows a tqdm bar (on stderr).

    `timed` (the default): the points' step times are compared, so no two may share a core or a
    device; `parallel` beyond `fair_parallel` is refused (`UnfairTiming`) before anything launches.
    Every row records `concurrent_runs`: the most other launches of this sweep that computed while
    it did (0 for a fairly timed point).
    """

    points: Sequence[RunConfig]
    out: Path  # a str or any os.PathLike is accepted too: __post_init__ makes it a Path
    parallel: int = 1
    results_name: str | None = "results.csv"
    progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)
    timeout_s: float | None = None
    on_row: Callable[[dict[str, Any]], None] | None = None
    cancel: threading.Event | None = None  # set from another thread: stop the runs in flight, return early
    retries: int = 1
    timed: bool = True
    point_extra: dict[str, dict[str, Any]] = field(default_factory=dict)
    launched: int = 0

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        self.runs_root = self.out / "runs"
        if self.timed and self.parallel > 1:
            from labkit.runtime.devices import detect_devices

            devices = detect_devices()
            check_fair(self.points, self.parallel, cores=os.cpu_count() or 1, devices=devices.device_count,
                       is_cpu=devices.is_cpu)

    @property
    def results_path(self) -> Path | None:
        return self.out / self.results_name if self.results_name else None

    # -- what is already known ------------------------------------------------------------
    def known_rows(self, wanted: set[str] | None = None) -> dict[str, dict[str, Any]]:
        """key -> row of every point (of `wanted`) that finished or ran out of memory before:
        from the CSV, else from the run directories."""
        rows: dict[str, dict[str, Any]] = {}
        if self.results_path is not None and self.results_path.is_file():
            table = pd.read_csv(self.results_path)
            for row in table.to_dict("records"):
                row = {k: (None if _isnan(v) else v) for k, v in row.items()}
                if settled(row.get("status"), row.get("cause")) and row.get("key"):
                    if wanted is not None and row["key"] not in wanted:
                        continue
                    # Rebuilt from its run directory when that is still there (derived columns follow the code).
                    run_dir = Path(str(row.get("run_dir") or ""))
                    rows[row["key"]] = (row_from_run(run_dir) if (run_dir / "summary.json").is_file() else None) or row
        for run_dir in run_dirs(self.runs_root):
            config = read_json(run_dir / "config.json")
            summary = read_json(run_dir / "summary.json")
            if config and summary and settled(summary.get("status"), summary.get("cause")):
                key = run_key(run_dir, config)
                # None only when its files vanished since they were read above.
                if key not in rows and (wanted is None or key in wanted) and (row := row_from_run(run_dir)):
                    rows[key] = row
        return rows

    # -- running --------------------------------------------------------------------------
    def run(self) -> pd.DataFrame:
        from labkit.launch.admission import SAMPLE_S, Admission, occupies
        from labkit.launch.run import Run

        self.out.mkdir(parents=True, exist_ok=True)
        keys = [point_key(p) for p in self.points]
        known = self.known_rows(set(keys))
        results: dict[str, dict[str, Any]] = {k: {**known[k], **self.extra, **self.point_extra.get(k, {})}
                                              for k in keys if k in known}
        pending = [(k, p) for k, p in zip(keys, self.points, strict=True) if k not in results]
        # Memory only: `parallel` (at most fair_parallel for timed points) already says how many share the cores.
        admission = Admission.here()
        estimates = {k: admission.estimate(p) for k, p in pending}
        for k, p in pending:  # before anything launches
            admission.check_alone(estimates[k], f"point {strategy_of(p)} b{p.global_batch} w{p.world_size}")
        rss: dict[str, int] = {}  # key -> its process tree's RSS at the last sample
        sampled_at = 0.0
        bar = None
        if self.progress:
            from tqdm.auto import tqdm  # a widget in a notebook (labkit.study.answer from 04), text elsewhere

            bar = tqdm(total=len(self.points), initial=len(results), unit="run", file=sys.stderr,
                       desc=Path(self.results_name or "sweep").stem, dynamic_ncols=True)
        running: list[tuple[str, Any, float]] = []
        releasing: list[tuple[Any, float]] = []  # done runs whose supervisor still holds their lease, since when
        tries: dict[str, int] = {}
        beside: dict[str, int] = {}  # key -> most other runs computing at once with it
        try:
            while pending or running or releasing:
                if self.cancel is not None and self.cancel.is_set():
                    raise SweepCancelled(f"{len(pending) + len(running)} points left")
                releasing = [(run, since) for run, since in releasing if _lease_still_held(run, since)]
                busy = sum(occupies(run) for _, run, _ in running) + len(releasing)
                if time.monotonic() - sampled_at >= SAMPLE_S:  # psutil walks the trees: once a second
                    sampled_at = time.monotonic()
                    rss.update({k: admission.sample(run._supervisor_pid()) for k, run, _ in running})
                while pending and busy < max(1, self.parallel):
                    decision = admission.decide(estimates[pending[0][0]], [(estimates[k], rss.get(k, 0))
                                                                           for k, _, _ in running], count_cores=False)
                    if not decision.admit:
                        if bar is not None:
                            bar.set_postfix_str(decision.describe())
                        break
                    busy += 1
                    key, config = pending.pop(0)
                    run = Run(config, root=self.runs_root).start()
                    assert run.run_dir is not None  # start() made it
                    write_json_atomic(run.run_dir / POINT_FILE,
                                      {"key": key, "measurement_version": MEASUREMENT_VERSION})
                    self.launched += 1
                    running.append((key, run, time.monotonic()))
                computing = [k for k, run, _ in running if occupies(run)]
                for k in computing:
                    beside[k] = max(beside.get(k, 0), len(computing) - 1)
                for item in list(running):
                    key, run, started = item
                    if self.timeout_s and not run.done and time.monotonic() - started > self.timeout_s:
                        run.stop()
                    if run.done:
                        run.wait(timeout=15)
                        running.remove(item)
                        admission.learn(run.config, run.run_dir, run._supervisor_pid())
                        rss.pop(key, None)
                        if run.holds_devices:  # wait() gave up on its supervisor: the lease is not free yet
                            releasing.append((run, time.monotonic()))
                        # Kept beside the run, so a resumed sweep rebuilding its row still knows it.
                        write_json_atomic(run.run_dir / POINT_FILE, {
                            "key": key, "measurement_version": MEASUREMENT_VERSION,
                            "concurrent_runs": beside.pop(key, 0)})
                        row = {**(row_from_run(run.run_dir) or {"key": key, "status": run.status}), **self.extra,
                               **self.point_extra.get(key, {})}
                        tries[key] = tries.get(key, 0) + 1
                        if not settled(row["status"], row.get("cause")) and tries[key] <= self.retries and (
                                row["status"] in RETRY_STATUSES or row["status"] == "oom"):
                            pending.insert(0, (key, run.config))  # once more, before the other points
                            continue
                        results[key] = row
                        self._write(keys, results)
                        if self.on_row:
                            self.on_row(row)
                        if bar is not None:
                            bar.set_postfix_str(f"{row.get('strategy')} b{row.get('global_batch')}: {row['status']}")
                            bar.update(1)
                if running or releasing or pending:  # pending with nothing running: waiting for memory
                    time.sleep(0.5)
        except BaseException:
            # Interrupted: end the runs in flight (their points are retried next time), keep the rest.
            for _, run, _ in running:
                run.stop()
            self._write(keys, results)
            raise
        finally:
            if bar is not None:
                bar.close()
        self._write(keys, results)
        return self.table(keys, results)

    def table(self, keys: Sequence[str] | None = None,
              results: dict[str, dict[str, Any]] | None = None) -> pd.DataFrame:
        if results is None:
            path = self.results_path
            return pd.read_csv(path) if path is not None and path.is_file() else pd.DataFrame(columns=COLUMNS)
        rows = [results[k] for k in (keys or results) if k in results]
        extra_columns = [c for row in rows for c in row if c not in COLUMNS]
        columns = [*COLUMNS, *dict.fromkeys(extra_columns)]
        return pd.DataFrame([{c: row.get(c) for c in columns} for row in rows], columns=columns)

    def _write(self, keys: Sequence[str], results: dict[str, dict[str, Any]]) -> None:
        if self.results_path is not None:
            write_text_atomic(self.results_path, self.table(keys, results).to_csv(index=False))


def _lease_still_held(run: Any, since: float) -> bool:
    """Whether a done run's supervisor still holds its device lease (`since`: when the sweep found the run
    done and its supervisor still there); raises LeaseNotReleased past LEASE_RELEASE_TIMEOUT_S."""
    if not run.holds_devices:
        return False
    if time.monotonic() - since > LEASE_RELEASE_TIMEOUT_S:
        pid = run._supervisor_pid()
        raise LeaseNotReleased(
            f"run {run.run_dir} ended ({run.status}) but its supervisor (pid {pid}) still holds its devices "
            f"({', '.join(run.device_ids)}) more than {LEASE_RELEASE_TIMEOUT_S:g} s after it ended: the next point "
            f"would be refused (DevicesBusy). End that process (kill {pid}) and run the sweep again; its "
            f"finished points are kept", run_dir=run.run_dir, supervisor_pid=pid)
    return True


def _isnan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def load_results(path: str | os.PathLike) -> pd.DataFrame:
    """A results CSV written by `Sweep` (or the reference data in data/reference-ci)."""
    return pd.read_csv(path)



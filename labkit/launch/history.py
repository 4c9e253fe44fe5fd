"""Past runs as a table: `labkit.runs()` lists the run store (only reading it), `load_run()` reopens one, and
`recover_stale()` ends the runs whose supervisor died and writes their summaries."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pandas as pd

from labkit.core.files import read_json
from labkit.launch.store import run_dirs

COLUMNS = ("run_id", "status", "example", "stage", "offload_optimizer", "precision", "world_size", "micro_batch",
           "grad_accum", "global_batch", "steps_completed", "median_step_time_s", "samples_per_s",
           "final_loss", "time_to_target_s", "cause")
INTEGER_COLUMNS = ("stage", "world_size", "micro_batch", "grad_accum", "global_batch", "steps_completed")


def runs(root: str | os.PathLike | None = None) -> pd.DataFrame:
    """One row per run directory: status, config and headline numbers (running runs included). Only reads:
    a run whose supervisor died is listed "failed" with that cause; `recover_stale` ends what it left."""
    rows = []
    for run_dir in run_dirs(root):
        summary, config, unreadable = _read(run_dir)
        config = config or {}
        if unreadable:  # listed and marked, not read: one such run must not break the whole list
            summary = {"status": "unreadable", "cause": unreadable, **(config if isinstance(config, dict) else {})}
            config = {}
        if summary is None:
            status, cause = "running" if (run_dir / "status.json").exists() else "created", None
            if _unsummarised(run_dir, summary, config):
                # "running" only while its supervisor lives (a machine reboot, a SIGKILL end it).
                from labkit.launch.run import Run

                run = Run.load(run_dir)
                if run.lost:
                    status, cause = run.status, run.cause
            factors = [config.get(k) for k in ("micro_batch", "grad_accum", "world_size")]
            summary = {"status": status, "cause": cause, **config,  # a damaged config's batch is not multiplied
                       "global_batch": math.prod(factors) if all(type(f) is int for f in factors) else None}
        if config.get("script"):
            # A learner's script: labkit's batch and strategy fields say nothing about it.
            from labkit.launch.summary import NOT_FOR_SCRIPTS

            summary = {k: v for k, v in summary.items() if k not in NOT_FOR_SCRIPTS}
        row = {key: summary.get(key) for key in COLUMNS}
        row["run_id"] = run_dir.name
        row["path"] = str(run_dir)
        rows.append(row)
    table = pd.DataFrame(rows, columns=[*COLUMNS, "path"])
    # counts stay integers where a row has none (plain PyTorch has no stage, a script no batch): 3, not 3.0
    for column in INTEGER_COLUMNS:
        table[column] = pd.to_numeric(table[column], errors="coerce").round().astype("Int64")
    return table


def recover_stale(root: str | os.PathLike | None = None) -> list[Path]:
    """End what the dead supervisors of the store's runs left running and write their summaries
    (`Run.recover`); returns those runs' directories. `labkit runs` and the panel's history call it."""
    from labkit.launch.run import Run

    recovered = []
    for run_dir in run_dirs(root):
        summary, config, unreadable = _read(run_dir)
        # A damaged summary.json is not replaced by a "supervisor died" one: it is listed as unreadable instead.
        if not unreadable and _unsummarised(run_dir, summary, config) and Run.load(run_dir).recover():
            recovered.append(run_dir)
    return recovered


def _read(run_dir: Path) -> tuple[Any, Any, str | None]:
    """A run's summary.json and config.json (None where absent), and why they do not read as a run's, else None:
    a file there that does not read (a directory, a permission), holds no JSON (binary, truncated) or JSON that is
    not an object (a list, a number)."""
    values: dict[str, Any] = {}
    problems = []
    for name in ("summary", "config"):
        path = run_dir / f"{name}.json"
        try:
            values[name] = read_json(path)
        except OSError as exc:
            values[name] = None
            problems.append(f"{name}.json does not read ({exc.strerror or type(exc).__name__})")
            continue
        if values[name] is None and path.exists():
            problems.append(f"{name}.json holds no JSON object (empty, truncated, binary or null)")
        elif values[name] is not None and not isinstance(values[name], dict):
            problems.append(f"{name}.json is not a JSON object (a {type(values[name]).__name__})")
    return values["summary"], values["config"], "; ".join(problems) or None


def _unsummarised(run_dir: Path, summary: dict | None, config: dict | None) -> bool:
    """A started run (its supervisor wrote status.json) without a summary: running, or lost."""
    return summary is None and bool(config) and (run_dir / "status.json").exists()


def load_run(run: str | os.PathLike):
    """A `Run` handle for a past run, by directory or run id."""
    from labkit.launch.run import Run
    from labkit.launch.store import default_root

    path = Path(run)
    if not path.is_dir():
        path = default_root() / str(run)
    return Run.load(path)

"""Past runs as a table: `labkit.runs()` lists the run store, `load_run()` reopens one."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from labkit.core.files import read_json
from labkit.launch.store import run_dirs

COLUMNS = ("run_id", "status", "example", "stage", "offload_optimizer", "precision", "world_size", "micro_batch",
           "grad_accum", "global_batch", "steps_completed", "median_step_time_s", "samples_per_s",
           "final_loss", "time_to_target_s", "cause")


def runs(root: str | os.PathLike | None = None) -> pd.DataFrame:
    """One row per run directory: status, config and headline numbers (running runs included)."""
    rows = []
    for run_dir in run_dirs(root):
        summary = read_json(run_dir / "summary.json")
        config = read_json(run_dir / "config.json") or {}
        if summary is None and (run_dir / "status.json").exists() and config:
            # "running" only while its supervisor lives: a run whose supervisor died (a machine
            # reboot, a SIGKILL) is recovered by Run.status, which ends what it left and writes
            # its summary, instead of being listed as running forever.
            from labkit.launch.run import Run

            Run.load(run_dir).status  # noqa: B018 -- reading status recovers a run whose supervisor died
            summary = read_json(run_dir / "summary.json")
        if summary is None:
            summary = {"status": "running" if (run_dir / "status.json").exists() else "created", **config,
                       "global_batch": config.get("micro_batch", 0) * config.get("grad_accum", 0)
                       * config.get("world_size", 0)}
        if config.get("script"):
            # A learner's script: labkit's batch and strategy fields say nothing about it.
            from labkit.launch.summary import NOT_FOR_SCRIPTS

            summary = {k: v for k, v in summary.items() if k not in NOT_FOR_SCRIPTS}
        row = {key: summary.get(key) for key in COLUMNS}
        row["run_id"] = run_dir.name
        row["path"] = str(run_dir)
        rows.append(row)
    return pd.DataFrame(rows, columns=[*COLUMNS, "path"])


def load_run(run: str | os.PathLike):
    """A `Run` handle for a past run, by directory or run id."""
    from labkit.launch.run import Run
    from labkit.launch.store import default_root

    path = Path(run)
    if not path.is_dir():
        path = default_root() / str(run)
    return Run.load(path)

"""The run store: one directory per run, written so that a kill at any moment leaves it readable.

    runs/<id>/config.json       the RunConfig
              ds_config.json    what DeepSpeed received
              command.txt       the exact launch command
              launch.json       what the supervisor starts (labkit.launch.launch_spec.LaunchSpec)
              launcher.log      DeepSpeed launcher output
              logs/             one log per rank (stdout + stderr)
              rank<N>.jsonl     one record per step (labkit.rank.telemetry)
              rank<N>.exit      how the rank process ended (labkit.rank.guard)
              summary.json      status, cause and headline numbers (labkit.launch.summary)
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path


def default_root() -> Path:
    """LABKIT_RUNS_DIR, else runs/ in the project checkout (notebooks and CLI share it), else ./runs."""
    if os.environ.get("LABKIT_RUNS_DIR"):
        return Path(os.environ["LABKIT_RUNS_DIR"])
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file():
        return checkout / "runs"
    return Path.cwd() / "runs"


def new_run_dir(name: str, root: str | os.PathLike | None = None) -> Path:
    root = Path(root) if root is not None else default_root()
    run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{name}-{secrets.token_hex(2)}"
    path = root / run_id
    path.mkdir(parents=True)
    return path


def run_dirs(root: str | os.PathLike | None = None) -> list[Path]:
    root = Path(root) if root is not None else default_root()
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if (p / "config.json").is_file())

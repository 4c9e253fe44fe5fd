"""The run store: one directory per run, written so that a kill at any moment leaves it readable.

    runs/<id>/config.json       the RunConfig
              ds_config.json    what DeepSpeed received
              command.txt       the exact launch command
              launch.json       argv + env for the supervisor
              launcher.log      DeepSpeed launcher output
              logs/             one log per rank (stdout + stderr)
              rank<N>.jsonl     one record per step (labkit.live.telemetry)
              rank<N>.exit      how the rank process ended (labkit.launch.rank_guard)
              summary.json      status, cause and headline numbers (labkit.launch.summary)
"""

from __future__ import annotations

import json
import os
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any


def write_text_atomic(path: str | os.PathLike, text: str, *, private: bool = False) -> None:
    """Write via a temporary file and rename: readers see the old file or the new one, never half.
    `private`: 0600, for files that may hold a user's secrets (environment variables)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp makes 0600 files; run files are as readable as any other file the user writes.
        os.fchmod(fd, 0o600 if private else 0o666 & ~_umask())
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process umask, read without os.umask(), which would change it under other threads."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def write_json_atomic(path: str | os.PathLike, data: Any, *, private: bool = False) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n", private=private)


def read_json(path: str | os.PathLike) -> Any | None:
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


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

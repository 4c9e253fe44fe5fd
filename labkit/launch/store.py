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
import tempfile
import time
from pathlib import Path

RUNS_DIR_ENV = "LABKIT_RUNS_DIR"


def default_root() -> Path:
    """LABKIT_RUNS_DIR, else runs/ in the project checkout (notebooks and CLI share it), else ./runs.
    LABKIT_RUNS_DIR naming a file, a path under a file, or one where no directory can be made: ConfigError naming
    the variable (`check_output_dir`), before a run writes or launches anything. Missing is fine: a run makes it."""
    if os.environ.get(RUNS_DIR_ENV):
        root = Path(os.environ[RUNS_DIR_ENV])
        if not root.is_dir():  # an existing store is taken as it is, without a probe per call
            check_output_dir(root, RUNS_DIR_ENV)
        return root
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


def check_output_dir(path: str | os.PathLike, flag: str) -> Path:
    """Refuse, before anything is written or launched, an output directory that cannot be one: an empty path (it
    would be the working directory), an existing file, a path under a file, or one where no directory can be made
    (a read-only or pseudo filesystem, no permission). ConfigError naming `flag` (`--out`, `--csv`, ...). Nothing
    is left behind: the probe directory made in the nearest existing directory is removed."""
    from labkit.core.config import ConfigError

    name = flag.lstrip("-").replace("-", "_")
    if not str(path).strip():
        raise ConfigError(name, f"{flag} is an empty path: name a directory")
    path = Path(path)
    here = path.absolute()
    for candidate in (here, *here.parents):
        if candidate.is_dir():
            base = candidate
            break
        if os.path.lexists(candidate):
            what = "is a file, not a directory" if candidate.exists() else "is a broken symbolic link"
            raise ConfigError(name, f"{flag} {path} {what}" if candidate == here
                              else f"{flag} {path} cannot be made: {candidate} {what}")
    else:  # pragma: no cover: the root is a directory
        base = Path(here.anchor)
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".labkit-probe-", dir=base))
    except OSError as exc:
        where = "written in" if base == here else "made"
        raise ConfigError(name, f"{flag} {path} cannot be {where}: no directory can be created in {base} "
                          f"({exc.strerror or exc})") from None
    return path

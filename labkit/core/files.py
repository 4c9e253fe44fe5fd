"""Files written whole or not at all (write to a temporary file, fsync, rename), and JSON read back; used by the
run store, the ranks' guard and every study that saves a result."""

from __future__ import annotations

import json
import os
import tempfile
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
    """The file's JSON value; None when it is absent or its bytes are not JSON (empty, truncated, binary). Other
    OSErrors (a directory, a permission, an I/O error) are raised: the caller says what it could not read."""
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, ValueError):  # ValueError: JSONDecodeError and UnicodeDecodeError
        return None

"""Reading rank files (`rank<N>.jsonl`, written by `labkit.rank.telemetry`): whole, or incrementally;
and the end of a file (a rank's log, the last records), in a bounded read.

Everything that watches a live run (the supervisor, the CLI's progress bar, the dashboard) uses
`RecordTail`, so a poll costs what the ranks wrote since the last one, not the run's length so far.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def rank_file(run_dir: str | os.PathLike, rank: int) -> Path:
    return Path(run_dir) / f"rank{rank}.jsonl"


def parse_lines(data: bytes) -> list[dict[str, Any]]:
    """The JSON records (objects) of complete lines; a line cut short by a kill, or anything else that is not a
    JSON object (bytes that do not decode, a list), is skipped."""
    records = []
    for line in data.splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # JSONDecodeError, UnicodeDecodeError
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def read_end(path: str | os.PathLike, max_bytes: int) -> bytes:
    """The last `max_bytes` of a file (all of it if shorter): a bounded read, whatever the file's
    length. A missing file reads as empty; other OSErrors are raised."""
    try:
        with open(path, "rb") as handle:
            handle.seek(max(0, handle.seek(0, os.SEEK_END) - max_bytes))
            return handle.read()
    except FileNotFoundError:
        return b""


def rank_log(run_dir: str | os.PathLike, rank: int) -> Path | None:
    """The rank's log in run_dir/logs (DeepSpeed names them <timestamp>_rank<N>.log), None if none yet."""
    logs = sorted(Path(run_dir, "logs").glob(f"*_rank{rank}.log"))
    return logs[-1] if logs else None


def rank_logs_text(run_dir: str | os.PathLike, rank: int) -> str:
    """Everything rank `rank` printed (DeepSpeed's launcher writes one log per rank; a restarted rank, more)."""
    logs = sorted((Path(run_dir) / "logs").glob(f"*rank{rank}.log"))
    return "\n".join(path.read_text(errors="replace") for path in logs)


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All complete records of a rank file (for a finished run, or a one-off look); none if it is absent or
    not a file."""
    try:
        return parse_lines(Path(path).read_bytes())
    except (FileNotFoundError, IsADirectoryError):
        return []


class RecordTail:
    """Reads a rank file incrementally: each `poll()` returns only the new complete records.

    It keeps its byte offset, so each byte of the file is read once (`bytes_read` counts them);
    an unfinished last line waits, unparsed, for the poll that sees its newline.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.bytes_read = 0
        self._partial = b""

    def poll(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.bytes_read)
                chunk = handle.read()
        except FileNotFoundError:
            return []
        self.bytes_read += len(chunk)
        data = self._partial + chunk
        end = data.rfind(b"\n") + 1
        self._partial = data[end:]
        return parse_lines(data[:end])

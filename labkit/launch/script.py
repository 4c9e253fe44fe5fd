"""Script mode: an unmodified DeepSpeed training script under labkit's supervisor.

    python -m labkit run --script train.py --world-size 2 -- --deepspeed_config ds.json

Each rank runs `python train.py --local_rank=N <args>` (as `deepspeed train.py` would) through
`labkit.launch.rank_guard`, which records its start, its memory seen from outside (RSS of the rank's
process tree, every `SAMPLE_S`) and how it ended. A script that adds one line per step,

    import labkit; labkit.record(step=step, loss=loss.item(), **fields)

also streams per-step records (live charts, summary.json's loss and step time). Outside labkit
(no LABKIT_RUN_DIR in the environment) `record` does nothing, so the script still runs anywhere.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

RUN_DIR_ENV = "LABKIT_RUN_DIR"
SAMPLE_S = 1.0  # the guard's memory / liveness sampling period

_state: dict[str | tuple[str | int, ...], Any] = {}  # "last_step_at", ("fd", run_dir, rank), ("start", run_dir)


def _append(run_dir: Path, rank: int, record: dict[str, Any]) -> None:
    """One line, one os.write on an O_APPEND descriptor: the guard and the script share the file."""
    fd = _state.get(("fd", str(run_dir), rank))
    if fd is None:
        fd = os.open(run_dir / f"rank{rank}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        _state[("fd", str(run_dir), rank)] = fd
    os.write(fd, (json.dumps({"rank": rank, "time_s": round(time.time() - _started(run_dir), 6), **record},
                             separators=(",", ":"), default=float) + "\n").encode())


def _started(run_dir: Path) -> float:
    """The run's start: when the supervisor wrote status.json (so every rank shares the clock)."""
    key = ("start", str(run_dir))
    if key not in _state:
        try:
            _state[key] = json.loads((run_dir / "status.json").read_text())["started_at"]
        except (OSError, ValueError, KeyError):
            _state[key] = time.time()
    return _state[key]


def record(*, step: int, loss: float | None = None, **fields: Any) -> None:
    """Record optimizer step `step` of this rank (call once per step, after it). `fields`: more
    numbers with units in their names (`tokens_per_s`, ...). `step_time_s` and this rank's memory
    are added unless given. A no-op when the script is not run by labkit."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return
    import psutil

    now = time.time()
    process = psutil.Process()
    # The first step's time counts from the process start (its setup included; summaries skip warmup steps).
    last = _state.get("last_step_at", process.create_time())
    _state["last_step_at"] = now
    memory = {"rss_bytes": process.memory_info().rss}
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            memory["device_allocated_bytes"] = int(torch.cuda.memory_allocated())
            memory["device_peak_bytes"] = int(torch.cuda.max_memory_allocated())
    except ImportError:
        pass
    values = {"step_time_s": now - last, **memory, **fields}
    if loss is not None:
        values["loss"] = float(loss)
    _append(Path(run_dir), int(os.environ.get("RANK", "0")), {"event": "step", "step": int(step), **values})


def guard_events(run_dir: Path, rank: int):
    """What the rank guard writes for a script: start, samples, done (functions, bound to the file)."""
    def start(pid: int) -> None:
        _append(run_dir, rank, {"event": "start", "wall_time": time.time(), "pid": pid,
                                "host": socket.gethostname(), "script": True})

    def sample(rss_bytes: int) -> None:
        _append(run_dir, rank, {"event": "sample", "wall_time": time.time(), "rss_bytes": rss_bytes})

    def done(returncode: int) -> None:
        if returncode == 0:
            _append(run_dir, rank, {"event": "done", "wall_time": time.time()})

    return start, sample, done

"""Script mode: an unmodified DeepSpeed training script under labkit's supervisor.

    python -m labkit run --script train.py --world-size 2 -- --deepspeed_config ds.json

Each rank runs `python train.py --local_rank=N <args>` (as `deepspeed train.py` would) through
`labkit.rank.guard`, which records its start, its memory seen from outside (RSS of the rank's
process tree, every `SAMPLE_S`) and how it ended. A script that adds one line per step,

    import labkit; labkit.record(step=step, loss=loss.item(), **fields)

also streams per-step records (live charts, summary.json's loss and step time). Outside labkit
(no LABKIT_RUN_DIR in the environment) `record` does nothing, so the script still runs anywhere.

How a script rank is judged (labkit's own worker is judged from its `done` record; a script writes none):

- exit status 0: finished.
- killed by SIGABRT or SIGSEGV *after* an `exit` record with status 0: finished, with a warning naming
  the signal. Plain 2-rank DeepSpeed scripts on CPU sometimes abort in C++ teardown once their Python code
  is over ("terminate called without an active exception": gloo / DeepSpeed threads destroyed at exit);
  with faulthandler on, its attempt to print a finalized interpreter's stacks can turn that abort into a
  SIGSEGV (seen in CI), so the exit hook turns faulthandler off. The `exit` record is written by an atexit
  hook that the first `record` call installs: it says the interpreter reached its exit with no uncaught
  exception and no non-zero `sys.exit`, i.e. exit status 0 at the Python level.
- anything else is a failure: a SIGABRT before that record (mid-training), and every SIGABRT of a script
  that never calls `record`. Without the record the guard knows only the return code, and a teardown abort
  cannot be told from an abort in training; a success it cannot prove is not claimed (the cause says so).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

RUN_DIR_ENV = "LABKIT_RUN_DIR"
SAMPLE_S = 1.0  # the guard's memory / liveness sampling period

_state: dict[str | tuple[str | int, ...], Any] = {}  # "last_step_at", "exit_status", ("fd", run_dir, rank), ...
TEARDOWN_SIGNALS = (-signal.SIGABRT, -signal.SIGSEGV)  # return codes excused after a clean exit record
TEARDOWN_ABORT = ("the known C++ teardown abort of 2-rank DeepSpeed scripts on CPU ('terminate called without "
                  "an active exception': gloo / DeepSpeed threads destroyed at exit)")


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
    are added unless given. The first call also installs the hook that records this rank's exit
    status (how labkit tells a C++ teardown abort from a failure). A no-op when the script is not run
    by labkit."""
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
    rank = int(os.environ.get("RANK", "0"))
    _append(Path(run_dir), rank, {"event": "step", "step": int(step), **values})
    _hook_exit(Path(run_dir), rank)


def _hook_exit(run_dir: Path, rank: int) -> None:
    """Install (once) what writes this rank's `exit` record, and keep that hook the last registered:
    atexit runs hooks last-in first-out, and a hook registered later (by a library, during training)
    that aborts must come after the record, not before it."""
    if "exit_hook" not in _state:
        _state["exit_hook"] = lambda: _write_exit(run_dir, rank)
        exit_function = sys.exit

        def exit_noting_status(status: Any = None) -> NoReturn:
            # atexit cannot see the status of a SystemExit; a bare `raise SystemExit(n)` still goes unseen.
            _state["exit_status"] = status
            exit_function(status)

        sys.exit = exit_noting_status
    atexit.unregister(_state["exit_hook"])  # one comparison per registered hook: microseconds a step
    atexit.register(_state["exit_hook"])


def _write_exit(run_dir: Path, rank: int) -> None:
    """The `exit` record: the interpreter's exit status as Python knows it (1 after an uncaught
    exception, sys.exit's status otherwise), written before C++ teardown can abort the process."""
    uncaught = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)  # 3.12 names it last_exc
    status = _state.get("exit_status")
    code = 1 if uncaught is not None else (0 if status is None else status if isinstance(status, int) else 1)
    record: dict[str, Any] = {"event": "exit", "wall_time": time.time(), "pid": os.getpid(), "status": code}
    if uncaught is not None:
        record["uncaught"] = f"{type(uncaught).__name__}: {uncaught}"[:500]
    try:
        _append(run_dir, rank, record)
    except OSError:
        pass  # the run directory is gone: nothing to tell
    if code == 0:
        import faulthandler

        # Only C++ teardown is left, with no Python stack to show: faulthandler dumping a finalized
        # interpreter can itself crash, and a teardown SIGABRT then ends as a SIGSEGV.
        faulthandler.disable()


def clean_exit_recorded(run_dir: Path, rank: int, pid: int, tail_bytes: int = 65536) -> bool:
    """Whether process `pid` wrote an `exit` record with status 0 (read from the end of the rank
    file: the record comes after the last step, followed at most by a few of the guard's samples)."""
    from labkit.core.records import parse_lines, rank_file, read_end

    try:
        records = parse_lines(read_end(rank_file(run_dir, rank), tail_bytes))
    except OSError:
        return False
    return any(r.get("event") == "exit" and r.get("pid") == pid and r.get("status") == 0 for r in records)


def judge_exit(run_dir: Path, rank: int, pid: int, returncode: int) -> str:
    """How a script's rank ended: "finished", "teardown_abort" (finished, with a warning) or
    "failed" (see the module docstring)."""
    if returncode == 0:
        return "finished"
    if returncode in TEARDOWN_SIGNALS and clean_exit_recorded(run_dir, rank, pid):
        return "teardown_abort"
    return "failed"


def guard_events(run_dir: Path, rank: int):
    """What the rank guard writes for a script: start, samples, done (functions, bound to the file)."""
    def start(pid: int) -> None:
        _append(run_dir, rank, {"event": "start", "wall_time": time.time(), "pid": pid,
                                "host": socket.gethostname(), "script": True})

    def sample(rss_bytes: int) -> None:
        _append(run_dir, rank, {"event": "sample", "wall_time": time.time(), "rss_bytes": rss_bytes})

    def done(verdict: str, returncode: int) -> None:
        """After the script's exit judged by `judge_exit`: a done record unless it failed."""
        if verdict == "finished":
            _append(run_dir, rank, {"event": "done", "wall_time": time.time()})
        elif verdict == "teardown_abort":
            killed_by = signal.Signals(-returncode).name
            _append(run_dir, rank, {"event": "done", "wall_time": time.time(), "teardown_abort": True,
                                    "warning": f"rank {rank}: killed by {killed_by} after its script exited cleanly "
                                               f"(exit status 0 recorded at exit): {TEARDOWN_ABORT}; counted "
                                               "as finished"})

    return start, sample, done

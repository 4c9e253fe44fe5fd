"""What a run is doing, for progress bars: starting, building ops, initializing, step k/N.

The CLI's bar (`labkit run`) and the notebook helpers that launch several runs
(`labkit.study.lessons.launch_all`) show the same phase, read the same way: rank 0's records
incrementally, and the end of rank 0's log (DeepSpeed's JIT op builds announce themselves there).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from labkit.core.records import RecordTail, rank_file, rank_log, read_end


def run_phase(events: set[str], step: int, steps: int, rank0_log: str = "", waiting_on: str | None = None,
              *, script: bool = False) -> str:
    """What a run is doing, for the progress bar: starting, initializing, building ops, step k/N.
    `waiting_on` (`Run.waiting_on`): an op build or a stale build lock the run is stuck behind.
    `script`: script mode, where steps come only from labkit.record and no `ready` record exists."""
    if step:
        return f"step {step}/{steps}"
    if waiting_on:
        return f"waiting: {waiting_on}"
    if "ready" in events:
        return "first step"
    if "start" not in events:
        return "starting processes"
    building = rank0_log.rfind("Building extension module")
    if building >= 0 and rank0_log.rfind("Loading extension module") < building:
        return "building ops (JIT, once per machine)"
    if script:
        # Its guard samples the rank's memory every second from the start: "sample" means alive.
        return ("script running (no step recorded yet; memory sampled from outside)" if "sample" in events
                else "script starting")
    return "initializing (process group, DeepSpeed engine)"


def rank0_log_tail(run_dir: str | os.PathLike, tail_bytes: int = 20000) -> str:
    """The end of rank 0's log: a bounded read, whatever the log's length (polled twice a second)."""
    log = rank_log(run_dir, 0)
    try:
        return read_end(log, tail_bytes).decode(errors="replace") if log else ""
    except OSError:
        return ""


def run_label(config: Any) -> str:
    """A run's kind in a progress bar: its example, or its script's file name (script mode)."""
    return f"script {Path(config.script).name}" if config.script else config.example


class RunProgress:
    """One run's (step, phase), polled: each poll reads only what rank 0 wrote since the last one."""

    def __init__(self, run: Any):
        self.run = run
        self.events: set[str] = set()
        self._tail: RecordTail | None = None

    def poll(self) -> tuple[int, str]:
        run = self.run
        if run.run_dir is None:
            return 0, "not started"
        if self._tail is None:
            self._tail = RecordTail(rank_file(run.run_dir, 0))
        self.events.update(r["event"] for r in self._tail.poll() if r.get("event"))
        step = run.progress()
        waiting = run.waiting_on if step == 0 else None
        return step, run_phase(self.events, step, run.config.steps, rank0_log_tail(run.run_dir), waiting,
                               script=bool(run.config.script))

"""What a rank sent, from DeepSpeed's own comms logger: `comms_rank<N>.json` in the run directory.

With `RunConfig(comms_log=True)` the ranks' ds_config turns DeepSpeed's comms logger on
(`"comms_logger": {"enabled": true, "prof_all": true, "debug": true}`): every collective that goes
through `deepspeed.comm` is counted by operation, DeepSpeed function that called it and message size
(`deepspeed.comm.comm.comms_logger.comms_dict`, filled by deepspeed/utils/comms_logging.py:104 in 0.19.8).
The worker closes a *section* at a few points, and this module moves what the logger holds into
that section:

    setup           deepspeed.initialize and everything before the first step
    step 1, step 2  the first steps alone (ZeRO-3 records and checks its module trace there)
    steady          every later step together (`steps` says how many)
    between steps   labkit's own collectives outside the steps (the held-out eval, stop-at-target)

The file is written at the end of the run (and when a rank fails, with what it had). The
parent-side reading, and the formulas the counts are checked against, are `labkit.study.comms`.

Two things DeepSpeed 0.19.8's logger does that this module undoes, by emptying the logger and its
timers at every section:
- its latencies are *cumulative*: each call's entry is the sum of every call of that name so far,
  because `timed_op` reads its timer with `elapsed(reset=False)` (deepspeed/comm/comm.py:142,
  deepspeed/utils/timer.py:100). Per-call times are the differences, recovered here;
- it keeps every latency of the run in lists and re-sums them at every call (quadratic in the calls).

What the logger costs: on a GPU it synchronizes the device after every collective
(deepspeed/comm/comm.py:133, "make op blocking for accurate logging"), so nothing overlaps compute
while it is on: a run that logs its communication is not a run to time. On CPU it adds no wait.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

# What labkit adds to ds_config when RunConfig.comms_log is on: debug=True puts the calling
# DeepSpeed function into each record's name ("all_reduce | [Caller Func: allreduce_bucket]").
SETUP, STEADY, BETWEEN_STEPS = "setup", "steady", "between steps"
KEEP_MS = 1000  # per-call times kept per (name, size) and section; counts and sums cover every call
_CALLER = " | [Caller Func: "


def comms_file(run_dir: str | os.PathLike, rank: int) -> Path:
    return Path(run_dir) / f"comms_rank{rank}.json"


def split_name(name: str) -> tuple[str, str]:
    """DeepSpeed's record name as (operation, calling function):
    "all_reduce | [Caller Func: f]" -> ("all_reduce", "f")."""
    op, _, caller = name.partition(_CALLER)
    return op.strip(), caller.rstrip("]").strip()


def per_call_ms(cumulative: dict[int, list[float]]) -> dict[int, list[float]]:
    """One name's latencies by message size, made per call. DeepSpeed 0.19.8 records each call's
    time as the running total of that name's calls since its timer was last reset, whatever the
    size, so sorting all of them gives the calls in order and the differences their own times."""
    ordered = sorted((value, size) for size, values in cumulative.items() for value in values)
    out: dict[int, list[float]] = {size: [] for size in cumulative}
    previous = 0.0
    for value, size in ordered:
        out[size].append(max(0.0, value - previous))
        previous = value
    return out


class CommsLog:
    """The rank's side: `close(section)` after each part of the run, `write()` at the end.
    Does nothing when `enabled` is False (the default run), nor where DeepSpeed's logger is off
    (the plain PyTorch example has no engine: its file says it sent nothing through deepspeed.comm)."""

    def __init__(self, run_dir: str | os.PathLike, rank: int, *, enabled: bool, steady_from: int = 3):
        self.path = comms_file(run_dir, rank)
        self.rank = rank
        self.enabled = enabled
        self.steady_from = steady_from
        self.sections: dict[str, dict[str, Any]] = {}
        self._logger_seen = False

    def close_step(self, step: int) -> None:
        """Everything logged since the last close belongs to optimizer step `step`."""
        self.close(f"step {step}" if step < self.steady_from else STEADY, steps=1)

    def close(self, section: str, *, steps: int = 0) -> None:
        """Move what DeepSpeed's logger holds into `section` (added to what it already has)."""
        if not self.enabled:
            return
        from deepspeed.comm import comm as ds_comm

        logger = ds_comm.comms_logger
        if not logger.enabled:
            return
        self._logger_seen = True
        entry = self.sections.setdefault(section, {"steps": 0, "ops": {}})
        entry["steps"] += steps
        for name, by_size in list(logger.comms_dict.items()):
            times = per_call_ms({size: list(values[1]) for size, values in by_size.items()})
            for size, values in by_size.items():
                op = entry["ops"].setdefault(f"{name}@{size}", {"name": name, "msg_bytes": int(size), "count": 0,
                                                               "ms_total": 0.0, "ms": []})
                op["count"] += int(values[0])
                op["ms_total"] += sum(times[size])
                op["ms"] = (op["ms"] + times[size])[:KEEP_MS]
            timer = ds_comm.timers.timers.get(name)
            if timer is not None:
                timer.reset()  # the next call's time starts from zero: see per_call_ms
        logger.reset_data()

    def write(self, **fields: Any) -> None:
        """`comms_rank<N>.json`, atomically: one row per (section, name, message size)."""
        if not self.enabled:
            return
        self.close(BETWEEN_STEPS)
        rows = []
        for section, entry in self.sections.items():
            for op in entry["ops"].values():
                kind, caller = split_name(op["name"])
                rows.append({"section": section, "section_steps": entry["steps"], "op": kind, "caller": caller,
                             **{k: op[k] for k in ("name", "msg_bytes", "count", "ms_total", "ms")}})
        data = {"rank": self.rank, "deepspeed_logger": self._logger_seen, "records": rows,
                "sections": {name: entry["steps"] for name, entry in self.sections.items()}, **fields}
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        try:
            os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide it from whoever reads the run store
            with os.fdopen(fd, "w") as handle:
                json.dump(data, handle)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

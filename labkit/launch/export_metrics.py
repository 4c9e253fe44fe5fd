"""`python -m labkit export-metrics RUN --tensorboard DIR --csv DIR`: a finished run's records,
for the tools learners already use.

TensorBoard: one event file per rank under DIR/rank<N>/, a scalar `labkit/<field>` per numeric
per-step field (loss, step_time_s, rss_bytes, ...) at global step `step` (needs `[monitor]`, the
tensorboard package). CSV: DIR/rank<N>.csv, one row per step, one column per field.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

from labkit.core.records import rank_file, read_records


def rank_ids(run_dir: str | os.PathLike) -> list[int]:
    """The ranks whose records (rank<N>.jsonl) `run_dir` holds; none: it is not a run directory."""
    return sorted(int(p.stem[4:]) for p in Path(run_dir).glob("rank*.jsonl") if p.stem[4:].isdigit())


def _steps_by_rank(run_dir: Path) -> dict[int, list[dict]]:
    ranks = rank_ids(run_dir)
    if not ranks:
        raise FileNotFoundError(f"{run_dir} holds no rank records (rank<N>.jsonl)")
    # A step record is one with an integer step (the global step TensorBoard plots at): a damaged line is skipped.
    return {rank: [r for r in read_records(rank_file(run_dir, rank))
                   if r.get("event") == "step" and type(r.get("step")) is int] for rank in ranks}


def _numeric(record: dict) -> dict[str, float]:
    return {k: float(v) for k, v in record.items()
            if k not in ("rank", "step") and isinstance(v, (int, float)) and not isinstance(v, bool)}


def to_tensorboard(run_dir: str | os.PathLike, out: str | os.PathLike) -> list[Path]:
    from torch.utils.tensorboard import SummaryWriter

    written = []
    for rank, steps in _steps_by_rank(Path(run_dir)).items():
        log_dir = Path(out) / f"rank{rank}"
        writer = SummaryWriter(log_dir=str(log_dir))
        for record in steps:
            for name, value in _numeric(record).items():
                writer.add_scalar(f"labkit/{name}", value, global_step=int(record["step"]))
        writer.close()
        written.append(log_dir)
    return written


def to_csv(run_dir: str | os.PathLike, out: str | os.PathLike) -> list[Path]:
    by_rank = _steps_by_rank(Path(run_dir))  # before the output dir is made: not a run, nothing is left behind
    Path(out).mkdir(parents=True, exist_ok=True)
    written = []
    for rank, steps in by_rank.items():
        columns = ["step", *sorted({k for r in steps for k in _numeric(r)})]
        path = Path(out) / f"rank{rank}.csv"
        with path.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(steps)
        written.append(path)
    return written

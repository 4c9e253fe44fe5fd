"""What every finished job of DeepSpeed's slurm and openmpi launchers must show (test_slurm.py, test_mpi.py)."""

from __future__ import annotations

import json
from pathlib import Path

from labkit.launch.summary import rank_records
from tests.conftest import run_processes


def assert_trained(job: Path, launcher: str, steps: int = 4) -> None:
    """Both ranks trained every step to `done`, each with the rank, local rank and world size its
    launcher's variables gave it (through labkit.rank.entry), each with its own log; the
    summary says finished and no process of the job is left."""
    records = rank_records(job, 2)
    for rank in (0, 1):
        start = records[rank][0]
        assert (start["event"], start["rank"], start["local_rank"], start["world_size"]) == ("start", rank, rank, 2)
        assert [r["step"] for r in records[rank] if r.get("event") == "step"] == list(range(1, steps + 1))
        assert records[rank][-1]["event"] == "done"
        assert (job / "logs" / f"{launcher}_rank{rank}.log").stat().st_size > 0
    assert json.loads((job / "summary.json").read_text())["status"] == "finished"
    assert not run_processes(job)

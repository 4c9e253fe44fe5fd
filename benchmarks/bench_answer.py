"""`labkit answer --profile ci` with warm launches (the default), timed, and its numbers set beside data/reference-ci.

    .venv/bin/python benchmarks/bench_answer.py [--cold] [--out DIR] [--json out.json]

Goal it serves (issue 25, item 3): the ci profile's answer in <= 3 minutes of wall time on this 2-core machine
(cold: about 6-8 minutes, `answer_runtime_s` in data/reference-ci/machine.json), its numbers unchanged within
run-to-run noise. It runs the CLI as a learner does, in a fresh directory, then compares every sweep point with
the reference's point of the same key: the median step time (timing, so noisy), the steps to the target loss
(optimisation: a warm launch must not change it) and the final held-out loss. Run it on a quiet machine: the
answer refuses nothing under load, it only runs slower.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parent.parent
REFERENCE = REPO / "data" / "reference-ci"
GOAL_S = 180.0


def compare(results: pd.DataFrame, reference: pd.DataFrame) -> pd.DataFrame:
    """One row per sweep point both hold: the new value over the reference's, for step time, steps and loss."""
    both = results.merge(reference, on="key", suffixes=("", "_ref"), how="inner").set_index("key")
    both = both[(both["status"] == "finished") & (both["status_ref"] == "finished")]
    return pd.DataFrame({
        "strategy": both["strategy"], "world_size": both["world_size"], "global_batch": both["global_batch"],
        "step_time_ratio": both["median_step_time_s"] / both["median_step_time_s_ref"],
        "steps_to_target": both["steps_to_target"], "steps_to_target_ref": both["steps_to_target_ref"],
        "eval_loss_diff": both["eval_loss"] - both["eval_loss_ref"],
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cold", action="store_true", help="launch cold (labkit answer --cold), for comparison")
    parser.add_argument("--out", default=None, help="answer directory (default: a temporary one)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-answer-"))
    command = [sys.executable, "-m", "labkit", "answer", "--profile", "ci", "--out", str(out)]
    if args.cold:
        command.append("--cold")
    load_before = os.getloadavg()
    started = time.monotonic()
    subprocess.run(command, cwd=REPO, check=True)
    wall_s = time.monotonic() - started
    machine = json.loads((out / "machine.json").read_text())
    table = compare(pd.read_csv(out / "results.csv"), pd.read_csv(REFERENCE / "results.csv"))
    # Equal, or both never reached the target within the step cap.
    same_steps = int(((table["steps_to_target"] == table["steps_to_target_ref"])
                      | (table["steps_to_target"].isna() & table["steps_to_target_ref"].isna())).sum())
    result = {
        "launch": "cold" if args.cold else "warm", "wall_s": wall_s, "answer_runtime_s": machine["answer_runtime_s"],
        "launches": machine["launches"], "reference_runtime_s": json.loads((REFERENCE / "machine.json").read_text())
        ["answer_runtime_s"], "goal_s": GOAL_S, "load_before": load_before, "points_compared": len(table),
        "same_steps_to_target": same_steps,
        "step_time_ratio_median": float(statistics.median(table["step_time_ratio"])),
        "step_time_ratio_range": [float(table["step_time_ratio"].min()), float(table["step_time_ratio"].max())],
        "eval_loss_abs_diff_max": float(table["eval_loss_diff"].abs().max()),
    }
    with pd.option_context("display.width", 160, "display.max_rows", 200):
        print(table.round(4).to_string())
    print(f"\nlabkit answer --profile ci ({result['launch']}): {wall_s:.0f} s wall, {machine['launches']} launches "
          f"(reference, cold: {result['reference_runtime_s']:.0f} s); goal <= {GOAL_S:.0f} s")
    print(f"{len(table)} points beside data/reference-ci: steps to target equal at {same_steps}; step time "
          f"new/reference median {result['step_time_ratio_median']:.2f} (range {result['step_time_ratio_range'][0]:.2f}"
          f"-{result['step_time_ratio_range'][1]:.2f}); held-out loss differs by at most "
          f"{result['eval_loss_abs_diff_max']:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

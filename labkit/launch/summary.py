"""Headline numbers of a run, computed from its rank files (also for failed runs)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from labkit.core import schema
from labkit.core.records import rank_file, read_records

STATE_KEYS = (*schema.STATE_KEYS, *schema.HOST_KEYS)  # the census keys a run's summary keeps per rank
MEMORY_KEYS = ("peak_rss_bytes", "device_peak_bytes", "activation_bytes")
WARMUP_STEPS = 2  # the first steps include lazy allocations and op builds; leave them out of medians
# What labkit's own worker knows and a learner's script (script mode) does not: its batch, strategy, model
# and timings are the script's own, so these are left out of a script run's summary rather than shown
# with labkit's defaults.
NOT_FOR_SCRIPTS = ("example", "stage", "offload_optimizer", "precision", "micro_batch", "grad_accum",
                   "global_batch", "n_params", "samples_per_s", "forward_s", "backward_s", "optimizer_s",
                   "target_loss", "target_measured_on", "eval_loss", "eval_count", "eval_time_s", "steps_to_target",
                   "time_to_target_s", "achieved_flops", "peak_flops", "peak_flops_source", "optimizer_impl",
                   "flops_utilization")


def mlp_flops_per_sample(n_params: int) -> float:
    """~6 FLOPs per parameter per sample for an MLP: 2 forward + 4 backward (Kaplan et al. 2020)."""
    return 6.0 * n_params


def rank_records(run_dir: str | Path, world_size: int) -> dict[int, list[dict[str, Any]]]:
    return {rank: read_records(rank_file(run_dir, rank)) for rank in range(world_size)}


def steps_of(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("event") == "step"]


def mean_loss_by_step(records_by_rank: dict[int, list[dict[str, Any]]]) -> dict[int, float]:
    """The global training loss of each step: the mean over ranks that recorded it."""
    by_step: dict[int, list[float]] = {}
    for records in records_by_rank.values():
        for record in steps_of(records):
            by_step.setdefault(record["step"], []).append(record["loss"])
    return {step: sum(losses) / len(losses) for step, losses in sorted(by_step.items())}


def time_to_target(records_by_rank: dict[int, list[dict[str, Any]]], target: float,
                   window: int = 5) -> tuple[int, float] | None:
    """(step, seconds) when the mean loss over the last `window` steps first falls to `target`.

    Seconds are rank 0's clock from its start record, so process start and op builds count:
    that is what a user waits for.
    """
    losses = mean_loss_by_step(records_by_rank)
    times = {r["step"]: r["time_s"] for r in steps_of(records_by_rank.get(0, []))}
    steps = list(losses)
    for i in range(len(steps)):
        recent = [losses[s] for s in steps[max(0, i - window + 1): i + 1]]
        if len(recent) == min(window, i + 1) and sum(recent) / len(recent) <= target and steps[i] in times:
            return steps[i], times[steps[i]]
    return None


def eval_time_to_target(records_by_rank: dict[int, list[dict[str, Any]]], target: float) -> tuple[int, float] | None:
    """(step, seconds) of the first held-out evaluation whose loss is at or below `target`
    (rank 0's records: every rank evaluates the same set and records the same mean)."""
    for record in steps_of(records_by_rank.get(0, [])):
        if record.get("eval_loss") is not None and record["eval_loss"] <= target:
            return record["step"], record["time_s"]
    return None


def has_eval(records_by_rank: dict[int, list[dict[str, Any]]]) -> bool:
    return any(r.get("eval_loss") is not None for r in steps_of(records_by_rank.get(0, [])))


def summarize(run_dir: str | Path, config: dict[str, Any], *, status: str, cause: str | None,
                failed_rank: int | None = None) -> dict[str, Any]:
    """`config` is the run's config.json (already validated when the run was created)."""
    world_size = config["world_size"]
    global_batch = config["micro_batch"] * config["grad_accum"] * world_size
    records_by_rank = rank_records(run_dir, world_size)
    per_rank: dict[str, dict[str, Any]] = {}
    for rank, records in records_by_rank.items():
        steps = steps_of(records)
        last_state: dict[str, Any] = {}
        for record in records:
            if any(k in record for k in STATE_KEYS):
                last_state = record
        per_rank[str(rank)] = {
            "steps": len(steps) or _unrecorded_steps(records),
            **{k: last_state.get(k) for k in STATE_KEYS},
            **{k: max((r.get(k, 0) or 0 for r in records), default=None) or None for k in MEMORY_KEYS},
        }
    rank0_steps = steps_of(records_by_rank.get(0, []))
    finished = status == "finished"
    # A short finished run (a max-batch probe) falls back to its warm-up steps; a run that did not
    # finish does not: an OOM at step 2 has one step of lazy allocations, not a throughput.
    timed = rank0_steps[WARMUP_STEPS:] or (rank0_steps if finished else [])
    step_time = statistics.median(r["step_time_s"] for r in timed) if timed else None
    samples_per_s = global_batch / step_time if step_time and finished else None
    n_params = next((r.get("n_params") for r in records_by_rank.get(0, []) if r.get("n_params")), None)
    done = next((r for r in records_by_rank.get(0, []) if r.get("event") == "done"), {})
    # The done record holds one device's peak; the run has world_size of them.
    peak_flops = done["peak_flops"] * world_size if done.get("peak_flops") else None
    # Measured by DeepSpeed's flops profiler for models other than the MLP (labkit.models.builders), else 6 x params.
    measured = next((r["train_flops_per_sample"] for r in records_by_rank.get(0, [])
                     if r.get("train_flops_per_sample")), None)
    per_sample = measured or (mlp_flops_per_sample(n_params) if n_params else None)
    achieved = per_sample * samples_per_s if (per_sample and samples_per_s) else None
    evaluated = has_eval(records_by_rank)
    # The target on the held-out eval loss when the run evaluated one, else on the training loss's window.
    finder = eval_time_to_target if evaluated else time_to_target
    target = finder(records_by_rank, config["target_loss"]) if config["target_loss"] else None
    evals = [r for r in rank0_steps if r.get("eval_loss") is not None]
    losses = mean_loss_by_step(records_by_rank)
    summary = {
        "status": status,
        "cause": cause,
        "failed_rank": failed_rank,
        "example": config["example"],
        "stage": config["stage"],
        "offload_optimizer": config["offload_optimizer"],
        "precision": config["precision"],
        "world_size": config["world_size"],
        "micro_batch": config["micro_batch"],
        "grad_accum": config["grad_accum"],
        "global_batch": global_batch,
        "steps_requested": config["steps"],
        "steps_completed": min((p["steps"] for p in per_rank.values()), default=0),
        "n_params": n_params,
        "median_step_time_s": step_time,
        "samples_per_s": samples_per_s,
        "forward_s": _median(timed, "forward_s"),
        "backward_s": _median(timed, "backward_s"),
        "optimizer_s": _median(timed, "optimizer_s"),
        "final_loss": list(losses.values())[-1] if losses else None,
        "target_loss": config["target_loss"],
        "target_measured_on": ("eval_loss" if evaluated else "train_loss_window") if config["target_loss"] else None,
        "eval_loss": evals[-1]["eval_loss"] if evals else None,
        "eval_count": len(evals),
        "eval_time_s": sum(r.get("eval_s") or 0.0 for r in evals),
        "steps_to_target": target[0] if target else None,
        "time_to_target_s": target[1] if target else None,
        "wall_time_s": max((r["time_s"] for r in records_by_rank.get(0, [])), default=None),
        "achieved_flops": achieved,
        "peak_flops": peak_flops,
        "peak_flops_source": done.get("peak_flops_source"),
        "optimizer_impl": done.get("optimizer_impl"),  # which optimizer ran (labkit.runtime.ops.OPTIMIZER_IMPLS)
        "flops_utilization": achieved / peak_flops if (achieved and peak_flops) else None,
        "per_rank": per_rank,
        # A done record's warning: a script rank's C++ teardown abort judged finished (labkit.rank.script).
        "warnings": [r["warning"] for records in records_by_rank.values() for r in records
                     if r.get("event") == "done" and r.get("warning")],
    }
    return script_summary(summary, config, records_by_rank) if config.get("script") else summary


def script_summary(summary: dict[str, Any], config: dict[str, Any],
                   records_by_rank: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    """A script run's summary: labkit's own fields left out (NOT_FOR_SCRIPTS), the script named, and
    per rank the memory the guard sampled from outside (RSS of the rank's process tree, every
    labkit.rank.script.SAMPLE_S) beside the steps the script recorded, if it calls labkit.record."""
    kept = {k: v for k, v in summary.items() if k not in NOT_FOR_SCRIPTS}
    for rank, records in records_by_rank.items():
        samples = [r for r in records if r.get("event") == "sample"]
        rss = [r["rss_bytes"] for r in records if r.get("event") in ("sample", "step") and r.get("rss_bytes")]
        kept["per_rank"][str(rank)] = {"steps": kept["per_rank"][str(rank)]["steps"],
                                       "peak_rss_bytes": max(rss, default=None), "memory_samples": len(samples),
                                       "last_sample_s": samples[-1]["time_s"] if samples else None}
    return {"mode": "script", "script": config["script"], "script_args": config.get("script_args", []), **kept}


def _unrecorded_steps(records: list[dict[str, Any]]) -> int:
    """Steps of a run with per-step records off: its done record, else its last heartbeat."""
    done = next((r for r in records if r.get("event") == "done"), None)
    if done is not None:
        return done.get("steps") or 0
    return max((r["step"] for r in records if r.get("event") == "beat"), default=0)


def _median(records: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in records if key in r]
    return statistics.median(values) if values else None

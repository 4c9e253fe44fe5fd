"""`python -m labkit answer`: measure the answer to the lab's question and write the report.

Can DeepSpeed keep training time flat while the batch size grows? One command runs, on this
machine, with real supervised DeepSpeed launches:

1. the batch-size sweep (`labkit.study.sweep`), timed one launch at a time (no two timed runs share a
   core or a device), growing the batch three ways (`growth` column): more ranks at a fixed
   per-rank micro-batch ("ranks"), a bigger micro-batch on fixed ranks ("micro_batch"), and more
   gradient accumulation at a fixed micro-batch and ranks ("grad_accum"), each
   point trained until a fixed held-out eval loss is met (or a step cap), with LR scaling and
   warmup in samples, with gradient-noise probes; plus an LR-scaling study (none / linear / sqrt)
   on one strategy at every global batch of the grid and more (the critical batch needs them);
2. then the max-batch search (`labkit.study.maxbatch`) per strategy: largest micro-batch that fits the
   device (GPU: real OOM; CPU: an emulated per-rank capacity, `device_memory_budget_bytes`);
3. the derived tables: memory model vs measured vs DeepSpeed's estimates, activation
   estimate from a measured micro-batch profile, gradient noise scale and critical batch;
4. the answer card (`labkit.study.card`: faster / flat / slower per way and per clock, with the
   condition each verdict depends on) and a self-contained HTML report (`labkit.study.report`) that
   opens with it; every sentence computed from 1-3.

Everything lands in `--out` (default `runs/answer-<profile>`): results.csv (the sweep),
maxbatch.csv + maxbatch_probes.csv, memory.csv, activation.csv, noise.csv, machine.json,
answer_card.json, report.html, and the run directories under runs/. Re-running reuses every finished point.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pandas as pd

from labkit.core.config import ConfigError, RunConfig
from labkit.core.files import read_json, write_json_atomic, write_text_atomic
from labkit.core.schema import HOST_KEYS, STATE_KEYS, device_bytes

# answer.PROFILES and answer.with_model: the names notebooks 04 and 04a use
from labkit.study.answer_profiles import PROFILES, AnswerProfile, with_model
from labkit.study.sweep import STRATEGIES, Sweep, plan, strategy_of

REPORT_MAX_BYTES = 5_000_000  # data/reference-ci keeps the report only below this size


def _world_sizes(profile: AnswerProfile) -> tuple[int, ...]:
    from labkit.runtime.devices import detect_devices

    if profile.world_sizes is not None:
        return profile.world_sizes
    return (max(1, detect_devices().max_ranks),)


def _budget(profile: AnswerProfile) -> int | None:
    """The emulated capacity on CPU; None on a GPU (its real memory is the limit)."""
    from labkit.runtime.devices import detect_devices

    return profile.cpu_budget_bytes if detect_devices().is_cpu else None


def _model(profile: AnswerProfile) -> dict[str, Any]:
    model = dict(profile.model)
    from labkit.runtime.devices import detect_devices

    if model.get("precision") == "bf16" and not detect_devices().bf16:
        model["precision"] = "fp32"
    return model


def rank_growth_world_sizes(max_ranks: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to `max_ranks`, and `max_ranks` itself (every GPU of the node)."""
    sizes, n = [], 1
    while n < max_ranks:
        sizes.append(n)
        n *= 2
    return (*sizes, max_ranks)


def _threads(profile: AnswerProfile, ranks: int) -> int | None:
    """CPU: threads per rank such that the widest point fills the cores once (one run at a time)."""
    from labkit.runtime.devices import detect_devices

    if not detect_devices().is_cpu:
        return None
    return profile.cpu_threads_per_rank or max(1, (os.cpu_count() or 1) // ranks)


def rank_growth_micro_batch(profile: AnswerProfile) -> int:
    ranks = max(_world_sizes(profile))
    return profile.rank_growth_micro_batch or profile.global_batches[len(profile.global_batches) // 2] // ranks


def growth_of(config: RunConfig, profile: AnswerProfile) -> str:
    """Which way(s) of growing the batch a point belongs to: "ranks", "micro_batch", "grad_accum", or
    several joined by "+" (sorted) for a point the ways share. LR-study points at the grid's batches belong
    to "micro_batch"; at the study's other batches, to none ("": the LR study only, so that every strategy
    grows over the same batches)."""
    ranks = max(_world_sizes(profile))
    strategy = strategy_of(config)
    micro = rank_growth_micro_batch(profile)
    ways = []
    per_rank = {batch // ranks for batch in profile.global_batches}
    on_grid = config.world_size == (1 if strategy == "torch" else ranks)
    if on_grid and config.grad_accum == 1 and config.micro_batch in per_rank:
        ways.append("micro_batch")
    if (strategy in profile.rank_growth_strategies and config.micro_batch == micro
            and config.grad_accum == 1 and config.world_size in rank_growth_world_sizes(ranks)
            and config.lr_scaling == profile.grid_lr_scaling):
        ways.append("ranks")
    if (strategy in profile.accum_growth_strategies and config.world_size == ranks and config.micro_batch == micro
            and config.grad_accum in profile.accum_growth and config.lr_scaling == profile.grid_lr_scaling):
        ways.append("grad_accum")
    return "+".join(sorted(ways))


def points(profile: AnswerProfile) -> list[RunConfig]:
    """Every sweep point of the profile without duplicates: growth "micro_batch" (the grid's global
    batches on the profile's ranks; plain PyTorch, one process, at the same per-rank micro-batches),
    growth "ranks" (one micro-batch on 1, 2, 4, ... ranks), growth "grad_accum" (that micro-batch on the
    profile's ranks, accumulated), the memory-only points (at the micro-batch the ways share) and the LR
    study (every scaling at every study batch of one strategy)."""
    ranks = max(_world_sizes(profile))
    base = {**_model(profile), "device_memory_budget_bytes": _budget(profile),
            "threads_per_rank": _threads(profile, ranks)}
    grid = (profile.grid_lr_scaling,)
    shared = [rank_growth_micro_batch(profile) * ranks]

    largest_micro = max(profile.global_batches) // ranks  # the grid ran it: past it, accumulate

    def growth_micro(strategies: Sequence[str], batches: Sequence[int], scalings: Sequence[str]) -> list[RunConfig]:
        torch = [s for s in strategies if s == "torch"]
        others = [s for s in strategies if s != "torch"]
        return (plan(torch, [b // ranks for b in batches if b % ranks == 0], (1,), base=base, lr_scalings=scalings)
                + plan(others, batches, (ranks,), base=base, lr_scalings=scalings,
                       max_micro_batch={s: largest_micro for s in others}))

    configs = growth_micro(profile.strategies, profile.global_batches, grid)
    micro = rank_growth_micro_batch(profile)
    for world_size in rank_growth_world_sizes(ranks):
        configs += plan([s for s in profile.rank_growth_strategies if s != "torch" or world_size == 1],
                        [micro * world_size], (world_size,), base=base, lr_scalings=grid)
    for accum in profile.accum_growth:
        configs += [RunConfig(**{**base, **STRATEGIES[s], "world_size": ranks, "micro_batch": micro,
                                 "grad_accum": accum, "lr_scaling": profile.grid_lr_scaling})
                    for s in profile.accum_growth_strategies]
    if profile.memory_only:
        configs += growth_micro(profile.memory_only, shared, grid)
    if profile.lr_study_strategy:
        configs += growth_micro([profile.lr_study_strategy], profile.lr_study_batches or profile.global_batches,
                                profile.lr_scalings)
    from labkit.study.sweep import point_key

    unique: dict[str, RunConfig] = {}
    for config in configs:
        unique.setdefault(point_key(config), config)
    return list(unique.values())


def maxbatch_templates(profile: AnswerProfile) -> list[RunConfig]:
    base = {k: v for k, v in _model(profile).items() if k not in ("stop_at_target", "target_loss",
                                                                  "noise_scale_every", "eval_every")}
    world_size = max(_world_sizes(profile))
    templates = []
    for strategy in profile.maxbatch_strategies:
        ranks = 1 if strategy == "torch" else world_size
        templates.append(RunConfig(**{**base, **STRATEGIES[strategy], "world_size": ranks, "micro_batch": 1,
                                      "device_memory_budget_bytes": _budget(profile)}))
    return templates


# -- derived tables ----------------------------------------------------------------------------
def memory_table(results: pd.DataFrame, model: dict[str, Any]) -> pd.DataFrame:
    """Measured per-rank model-state bytes vs labkit.core.memory's prediction vs DeepSpeed's estimates."""
    from labkit.core import memory
    from labkit.models import builders

    # The real parameter shapes, from the model built on the meta device (any model, no memory).
    template = RunConfig.from_saved(model)
    numels = builders.param_numels(template)
    n_params = sum(numels)
    persistent = builders.persistent_params(numels, template.zero_settings().param_persistence_threshold)
    module = builders.meta_model(template)  # DeepSpeed's estimators want the largest layer
    finished = results[results.status == "finished"].drop_duplicates(subset=["strategy", "world_size"])
    rows = []
    for r in finished.to_dict("records"):
        stage = 0 if pd.isna(r.get("stage")) else int(r["stage"])
        offload = bool(r.get("offload_optimizer")) and str(r.get("offload_optimizer")) != "False"
        precision = _state_precision(r["strategy"], r.get("precision"))
        world_size = int(r["world_size"])
        predicted = memory.model_state_bytes(n_params, stage, world_size, precision, offload,
                                             persistent_params=persistent if stage == 3 else 0,
                                             optimizer=template.optimizer)
        measured = {k: float(r[k]) for k in STATE_KEYS if not pd.isna(r.get(k))}
        # What optimizer offload keeps on the host: optimizer states + master, and grad partitions.
        host = {k: 0.0 if pd.isna(r.get(k)) else float(r[k]) for k in HOST_KEYS}
        measured_device = device_bytes({**measured, **host})
        errors = memory.compare({**measured, "host_grad_bytes": host["host_grad_bytes"],
                                 "device_bytes": measured_device, "host_bytes": sum(host.values())}, predicted)
        row = {"strategy": r["strategy"], "world_size": world_size, "stage": stage, "offload_optimizer": offload,
               "precision": precision, "n_params": n_params,
               "persistent_params": persistent if stage == 3 and world_size > 1 else 0,
               **{f"measured_{k}": v for k, v in measured.items()},
               "measured_optim_master_bytes": measured.get("optim_bytes", 0) + measured.get("master_bytes", 0),
               **{f"measured_{k}": v for k, v in host.items()},
               "measured_device_bytes": measured_device, "measured_host_bytes": sum(host.values()),
               "measured_buffer_bytes": r.get("buffer_bytes"),
               **{f"predicted_{k}": v for k, v in predicted.items()},
               **{f"error_{k}": v for k, v in errors.items()}}
        if stage in (1, 2) and not offload and "grad_bytes" in measured:
            # The paper's Psi/N assumes an exact split; DeepSpeed keeps the whole gradient of each
            # parameter that overlaps a rank's slice. The census row is the largest rank's.
            held = max(memory.zero12_grad_elements(numels, world_size))
            row["predicted_layout_grad_bytes"] = held * (4 if precision == "fp32" else 2)
            row["error_layout_grad_bytes"] = (measured["grad_bytes"] - row["predicted_layout_grad_bytes"]) / \
                row["predicted_layout_grad_bytes"]
        option = {2: "zero2", 3: "zero3"}.get(stage)  # DeepSpeed has estimators for stages 2 and 3 only
        # ... and for Adam only: their 18 B per partitioned parameter count "momentum and variance"
        # (stage_1_and_2.py:4029-4031), which torch's SGD does not keep; an SGD run gets no estimate beside it
        if option and template.optimizer == "adam":
            estimate = memory.deepspeed_estimates(module, world_size)[option + ("_offload" if offload else "")]
            row["deepspeed_estimate_device_bytes"] = estimate["device_bytes"]
            row["deepspeed_estimate_host_bytes"] = estimate["host_bytes"]
            row["deepspeed_estimate_function"] = f"estimate_{option}_model_states_mem_needs"
        rows.append(row)
    return pd.DataFrame(rows)


def _state_precision(strategy: str, precision: str | None) -> str:
    """The precision of the model states. Plain PyTorch (labkit.rank.trainers.PlainTrainer) keeps fp32
    weights, grads and Adam state and runs bf16 only under autocast: fp32 states whatever the
    run's precision. DeepSpeed keeps bf16/fp16 params and grads with an fp32 master."""
    return "fp32" if strategy == "torch" else (precision or "fp32")


def analytic_max_micro_batch(result: Any, template: RunConfig) -> int | None:
    """The max micro-batch labkit.core.memory predicts: (capacity - analytic on-device states) divided by
    the activation bytes per sample of ONE measured micro-batch profile (the search's first fit)."""
    import math

    from labkit.core import memory

    budget = template.device_memory_budget_bytes
    profile = next((p for p in result.probes if p.fits and p.activation_bytes), None)
    if budget is None or profile is None:
        return None
    from labkit.models import builders

    numels = builders.param_numels(template)
    stage = template.stage or 0
    precision = _state_precision(strategy_of(template), template.precision)
    states = memory.model_state_bytes(sum(numels), stage, template.world_size, precision,
                                      bool(template.offload_optimizer),
                                      persistent_params=builders.persistent_params(
                                          numels, template.zero_settings().param_persistence_threshold)
                                      if stage == 3 else 0, optimizer=template.optimizer)
    per_sample = memory.activation_bytes_per_sample(profile.activation_bytes, profile.micro_batch)
    return max(0, math.floor((budget - states["device_bytes"]) / per_sample))


def activation_table(results: pd.DataFrame) -> pd.DataFrame:
    """Activation bytes predicted from ONE measured micro-batch profile (the smallest micro-batch
    of each strategy), against the activation bytes measured at the other micro-batch sizes."""
    from labkit.core import memory

    rows = []
    measured = results[results.activation_bytes.notna() & (results.status == "finished")]
    for (strategy, world_size), group in measured.groupby(["strategy", "world_size"]):
        group = group.drop_duplicates(subset=["micro_batch"]).sort_values("micro_batch")
        profile = group.iloc[0]
        per_sample = memory.activation_bytes_per_sample(int(profile.activation_bytes), int(profile.micro_batch))
        for r in group.itertuples():
            predicted = memory.activation_bytes(per_sample, int(r.micro_batch))
            rows.append({"strategy": strategy, "world_size": world_size,
                         "profile_micro_batch": int(profile.micro_batch), "per_sample_bytes": per_sample,
                         "micro_batch": int(r.micro_batch),
                         "measured_activation_bytes": int(r.activation_bytes), "predicted_activation_bytes": predicted,
                         "error": (r.activation_bytes - predicted) / predicted if predicted else None})
    return pd.DataFrame(rows)


def noise_table(results: pd.DataFrame) -> pd.DataFrame:
    """Every gradient-noise probe of the sweep's runs that reached the target: step, loss and the two squared
    norms. A run that never reached it (diverged, or capped) trained along no path to the target, and its many
    probes would swamp the pooled estimate (the LR study's linear rule at batch 2048 on CI's MLP: 150 probes
    of a diverged run pulled B_simple from ~133 to ~44)."""
    from labkit.launch.summary import rank_records, steps_of

    rows = []
    reached = results[(results.status == "finished") & results.steps_to_target.notna()]
    for r in reached.to_dict("records"):
        run_dir = Path(str(r["run_dir"]))
        if not run_dir.is_dir():
            continue
        for record in steps_of(rank_records(run_dir, 1)[0]):
            if record.get("grad_norm_big_sq") is not None:
                rows.append({"strategy": r["strategy"], "global_batch": r["global_batch"],
                             "lr_scaling": r["lr_scaling"], "step": record["step"], "loss": record["loss"],
                             **{k: record[k] for k in ("grad_norm_small_sq", "grad_norm_big_sq",
                                                       "noise_b_small", "noise_b_big", "noise_scale")}})
    return pd.DataFrame(rows)


def machine_info(runtime_s: float | None = None) -> dict[str, Any]:
    import deepspeed
    import psutil
    import torch

    from labkit.runtime.devices import detect_devices

    devices = detect_devices()
    return {
        "device": devices.device_name, "accelerator": devices.accelerator, "devices": devices.device_count,
        "cpu_model": _cpu_model(), "cpu_cores": os.cpu_count(),
        "ram_bytes": int(psutil.virtual_memory().total),
        "device_memory_bytes": devices.total_memory_bytes if not devices.is_cpu else None,
        "python": platform.python_version(), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
        "platform": platform.platform(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_average": list(os.getloadavg()), "answer_runtime_s": runtime_s,
    }


def _cpu_model() -> str:
    from labkit.runtime.devices import _cpu_model as cpu_model

    return cpu_model()


# -- the command -------------------------------------------------------------------------------
def whole_dataset_points(configs: Sequence[RunConfig]) -> list[RunConfig]:
    """The points whose step reads labkit's whole training set or more: the global batch, or without a distributed
    sampler (every rank reads all of it) a rank's micro-batches of a step. Each step is then an epoch (full-batch
    descent; with replacement, past it): the workshop profile's old x16 accumulation on an H200 memorised instead of
    reaching the held-out target (answer_profiles). A learner's own data (`data=`) is theirs to size."""
    return [c for c in configs if c.data is None and (c.global_batch if c.distributed_sampler
                                                      else c.micro_batch * c.grad_accum) >= c.dataset_size]


def answer(profile_name: str = "ci", out: str | os.PathLike | None = None, *, parallel: int | None = None,
           progress: bool = True, model: str | None = None, data: str | None = None,
           loss: str | None = None) -> Path:
    """Run everything the profile asks for in `out` and return the report's path. `model`, `data`,
    `loss`: train another model (RunConfig fields; model="gpt" is the built-in byte-level GPT)."""
    from labkit.launch.store import default_root
    from labkit.runtime.devices import detect_devices
    from labkit.study import maxbatch
    from labkit.study.sweep import check_fair, fair_parallel, point_key

    if parallel is not None and parallel < 1:
        raise ConfigError("parallel", f"must be at least 1 (timed runs at once), got {parallel}; None: the most "
                          "the machine allows")
    profile = with_model(PROFILES[profile_name], model, data, loss)
    if profile.name != profile_name:
        from labkit.models.builders import check_importable

        check_importable(RunConfig(**profile.model))  # a bad import string fails before any launch
    out = Path(out) if out is not None else default_root() / f"answer-{profile.name}"
    devices = detect_devices()
    configs = points(profile)
    whole = whole_dataset_points(configs)
    if whole:
        raise ConfigError("global_batch", f"profile {profile.name!r}: these points' global batch is the whole "
                          f"dataset ({whole[0].dataset_size} samples) or more, a step an epoch: "
                          + ", ".join(f"{c.micro_batch} x {c.grad_accum} x {c.world_size} ranks" for c in whole)
                          + "; give the profile (labkit/study/answer_profiles.py) a bigger dataset_size in its "
                          "model or shorter accum_growth / lr_study_batches")
    # Timed points never share a core or a device: refused before anything launches.
    cores = os.cpu_count() or 1
    parallel = parallel or fair_parallel(configs, cores=cores, devices=devices.device_count, is_cpu=devices.is_cpu)
    check_fair(configs, parallel, cores=cores, devices=devices.device_count, is_cpu=devices.is_cpu)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    load_before = list(os.getloadavg())

    def say(text: str) -> None:
        if progress:
            print(f"[answer {time.monotonic() - started:6.1f} s] {text}", file=sys.stderr, flush=True)

    say(f"profile {profile.name}: results in {out}")
    growth = {point_key(c): {"growth": growth_of(c, profile)} for c in configs}
    sweep = Sweep(configs, out, parallel=parallel, progress=progress, point_extra=growth)
    templates = maxbatch_templates(profile)
    cancel = threading.Event()
    # The max-batch searches run after the sweep, on every device. GPU runs must not share devices
    # (labkit.launch.device_lease refuses it, and a neighbour's memory would fake an OOM). CPU ranks share
    # the cores: searches launched beside the sweep would change the contention under the sweep's
    # step times part-way through, and the report compares those times. On CPU the searches still
    # run side by side with each other (their probes are not timed), `profile.parallel` at a time.
    is_cpu = devices.is_cpu
    say(f"sweep: {len(configs)} timed points, {parallel} at a time")
    results = sweep.run()
    say(f"sweep done ({sweep.launched} new launches)")
    searches = []
    if templates:
        side_by_side = min(len(templates), max(1, profile.parallel)) if is_cpu else 1
        say(f"max-batch search for {', '.join(profile.maxbatch_strategies)} (doubling, then bisection), "
            f"{side_by_side} search(es) at a time")
        search_kwargs = dict(start=profile.maxbatch_start, tolerance=profile.maxbatch_tolerance, cancel=cancel)
        # In a thread of its own: search_many's pool waits for its searches on the way out, so
        # Ctrl-C must reach this wait, which sets `cancel` to end them.
        with ThreadPoolExecutor(max_workers=1) as pool:
            searching = pool.submit(maxbatch.search_many, templates, out, parallel=side_by_side, **search_kwargs)
            try:
                searches = searching.result()
            except BaseException:
                cancel.set()  # Ctrl-C: stop the searches' runs in flight (finished probes are kept)
                raise
    if searches:
        summary, _ = maxbatch.write_results(searches, out)
        summary["analytic_max_micro_batch"] = [analytic_max_micro_batch(s, t)
                                               for s, t in zip(searches, templates, strict=True)]
        write_text_atomic(out / "maxbatch.csv", summary.to_csv(index=False))
        for s in searches:
            say(f"  max-batch {s.strategy} x{s.world_size}: {s.max_micro_batch} per rank (first OOM {s.first_oom}) "
                f"in {s.launches} launches ({s.new_launches} new)")
        if any(s.emulated for s in searches):
            say(f"  note: {maxbatch.EMULATED_EVIDENCE}")

    tables = {"memory": memory_table(results, _model(profile)), "activation": activation_table(results),
              "noise": noise_table(results)}
    for name, table in tables.items():
        write_text_atomic(out / f"{name}.csv", table.to_csv(index=False))
    runtime = time.monotonic() - started
    launches = sweep.launched + sum(s.new_launches for s in searches)
    machine = {**machine_info(runtime), "load_average_at_start": load_before, "profile": profile_name,
               "model": profile.model.get("model", "mlp"), "data": profile.model.get("data"),
               "loss": profile.model.get("loss"),
               "launches": launches, "parallel": parallel, "timed_parallel": parallel,
               "untimed_parallel": profile.parallel if is_cpu else 1,
               "timed_threads_per_rank": sorted({c.threads_per_rank for c in configs if c.threads_per_rank})}
    previous = read_json(out / "machine.json")
    if launches == 0 and previous:
        # Nothing was measured this time (every point reused): keep when and how the numbers were taken.
        machine = {**machine, **{k: previous[k] for k in ("answer_runtime_s", "launches", "load_average",
                                                           "load_average_at_start", "date") if k in previous},
                   "report_regenerated": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_json_atomic(out / "machine.json", machine)
    report = write_report(out, results, tables, profile=profile, machine=machine, devices=devices,
                          checked=checked_section(out, remeasure=launches > 0, is_cpu=is_cpu, say=say), say=say)
    say(f"report: {report} ({report.stat().st_size / 1e6:.1f} MB) after {runtime:.0f} s")
    return report


def write_report(out: Path, results: pd.DataFrame, tables: dict[str, pd.DataFrame], *, profile: AnswerProfile,
                 machine: dict[str, Any], devices: Any, checked: str,
                 say: Callable[[str], None] = lambda _: None) -> Path:
    """answer_card.json and report.html in `out` from the answer's tables (`tables`: memory, activation, noise; the
    max-batch CSVs read from `out`) and its `checked` section; the report's path. `answer` ends with it and
    `rebuild_report` redoes it."""
    from labkit.study import card
    from labkit.study.report import build_report

    maxbatch_table = pd.read_csv(out / "maxbatch.csv") if (out / "maxbatch.csv").is_file() else None
    probes = pd.read_csv(out / "maxbatch_probes.csv") if (out / "maxbatch_probes.csv").is_file() else None
    answer_card = card.build_card(results, maxbatch=maxbatch_table, noise=tables["noise"], machine=machine)
    # the report first (written whole, atomically), then the card: a table the report cannot read leaves both as
    # they were
    report = build_report(results, out / "report.html", maxbatch=maxbatch_table, probes=probes,
                          memory=tables["memory"], activation=tables["activation"], noise=tables["noise"],
                          machine=machine, profile=dataclasses.asdict(profile), devices=devices, card=answer_card,
                          sections=[checked, predicted_section(out)])
    say(f"answer card: {card.write_card(answer_card, out)}")
    return report


GPU_CHECK_WHY = ("the calibration models CPU ranks (labkit predict --from predicts GPU runs too, with a link fit of "
                 "your GPUs: --links)")


ANSWER_TABLES = ("results.csv", "machine.json", "memory.csv", "activation.csv", "noise.csv")


def rebuild_report(out: str | os.PathLike, *, say: Callable[[str], None] = lambda _: None) -> Path:
    """Rebuild answer_card.json and report.html in `out` from the tables a finished answer left there, measuring
    nothing: after the code that writes them changed (the predicted section follows labkit.study.predict), or for
    data/reference-*, which keeps no run directories. machine.json keeps when and how the numbers were measured and
    gains `report_regenerated`. The check on this machine is kept only where its runs and link fit are
    (`calibrate.kept_report_section`). FileNotFoundError / ValueError before anything is written."""
    from labkit.study.report import require_growth

    if not str(out).strip():  # Path("") is the working directory: not what an empty argument meant
        raise FileNotFoundError("the results dir is an empty path: name an answer's (runs/answer-<profile>)")
    out = Path(out)
    if not out.is_dir():
        raise FileNotFoundError(f"no such directory: {out}")
    missing = [name for name in ANSWER_TABLES if not (out / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{out} has no {', '.join(missing)}: not the results dir of a finished "
                                "`labkit answer` (or data/reference-*)")
    machine = _read_machine(out / "machine.json")
    for key in ("profile", "model", "data", "loss"):  # names or import strings: not a list or a number
        if machine.get(key) is not None and not isinstance(machine[key], str):
            raise ValueError(f"{out / 'machine.json'}: `{key}` must be a string, as `labkit answer` writes it, got "
                             f"{machine[key]!r}")
    if machine.get("profile") not in PROFILES:
        raise ValueError(f"{out / 'machine.json'} names the profile {machine.get('profile')!r}, not one of "
                         f"{', '.join(PROFILES)}: the report is built with the profile the answer ran")
    if not machine.get("accelerator"):
        # every answer writes it (cpu, cuda); without it the card would count GPUs and the check take a GPU's path
        raise ValueError(f"{out / 'machine.json'} does not say which accelerator the answer ran on (`accelerator`: "
                         "cpu, cuda, as `labkit answer` writes it): the report's card and check depend on it")
    model = machine.get("model")
    profile = with_model(PROFILES[machine["profile"]], None if model in (None, "mlp") else model, machine.get("data"),
                         machine.get("loss"))
    results = _read_table(out / "results.csv")
    require_growth(results, dataclasses.asdict(profile))
    if "median_step_time_s" in results:  # every ratio of the card divides by them
        times_s = pd.to_numeric(results["median_step_time_s"], errors="coerce")
        bad = results.index[(results.get("status") == "finished") & ~(times_s > 0)].tolist()
        if bad:
            raise ValueError(f"{out / 'results.csv'}: median_step_time_s must be a time above 0 for every finished "
                             f"point; row(s) {', '.join(str(i + 2) for i in bad[:5])} (file lines) are not")
    tables = {name: _read_table(out / f"{name}.csv") for name in ("memory", "activation", "noise")}
    machine = {**machine, "report_regenerated": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    checked = checked_section(out, remeasure=False, is_cpu=machine.get("accelerator") == "cpu", measure=False)
    # devices=None: the rebuilt page is read where it lands, so it is not compared with the machine rebuilding it
    report = write_report(out, results, tables, profile=profile, machine=machine, devices=None, checked=checked,
                          say=say)
    write_json_atomic(out / "machine.json", machine)
    return report


def _read_machine(path: Path) -> dict[str, Any]:
    """An answer's machine.json, or ValueError naming it: not JSON (malformed, binary) or not a JSON object."""
    try:
        machine = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is malformed: not JSON ({error})") from None
    if not isinstance(machine, dict):
        raise ValueError(f"{path} is malformed: a JSON {type(machine).__name__}, not the object `labkit answer` "
                         "writes")
    return machine


def _read_table(path: Path) -> pd.DataFrame:
    """One of an answer's CSV tables, or ValueError naming it: empty, binary or not CSV."""
    try:
        return pd.read_csv(path)
    except (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError) as error:
        what = "empty" if isinstance(error, pd.errors.EmptyDataError) else "not a CSV table"
        raise ValueError(f"{path} is {what} ({type(error).__name__}: {error})") from None


def checked_section(out: str | os.PathLike, *, remeasure: bool, is_cpu: bool, measure: bool = True,
                    say: Callable[[str], None] = lambda _: None) -> str:
    """report.html's "the predictor checked on this machine" section: the ranks way's multi-rank points predicted
    from its 1-rank runs (labkit.study.calibrate.report_section; the link measured here again when the sweep ran
    anything new), or why there is none: the measured report is never lost to a check that cannot be made. CPU
    answers only: the calibration models CPU ranks sharing cores, and its link benchmark computes on the host.
    `measure` False (a rebuilt report): from the runs and link fit the results dir keeps, measuring nothing."""
    from labkit.study import calibrate

    if not is_cpu:
        return calibrate.no_check_section(GPU_CHECK_WHY)
    try:
        if not measure:
            return calibrate.kept_report_section(out)
        started = time.monotonic()
        fit = calibrate.answer_links(out, remeasure=remeasure)
        if fit is not None and remeasure:
            say(f"predictor check: the link measured as training meets it in {time.monotonic() - started:.0f} s")
        return calibrate.report_section(out, fit)
    except Exception as error:
        return calibrate.no_check_section(f"{type(error).__name__}: {error}")


def predicted_section(out: str | os.PathLike) -> str:
    """report.html's "predicted on other hardware" section for the answer in `out`, or why there is none: the
    measured report is never lost to a prediction that cannot be made."""
    import html

    from labkit.study import predict

    try:
        return predict.report_section(out)
    except Exception as error:  # whatever the prediction meets, the measured report stays
        return ("<section id='predicted-other-hardware'><h2>Predicted on other hardware (not measured)</h2>"
                f"<p>No prediction for this answer: {html.escape(f'{type(error).__name__}: {error}')}</p></section>")


def results_dir_for(profile: str, model: str | None = None, *, also: str = "") -> Path:
    """Where notebooks 04 and 04a read an answer: the committed data/reference-<name>/ first, then a sweep run
    here (runs/answer-<name>/), and for the MLP data/reference-ci last (the report's banner says when it is another
    profile's). FileNotFoundError naming the command to run when none holds results.csv (`also`: another way)."""
    from labkit.launch.store import default_root

    name = with_model(PROFILES[profile], model).name  # "ci", or "ci-gpt" for the GPT
    data = Path(__file__).resolve().parents[2] / "data"
    candidates = [data / f"reference-{name}", default_root() / f"answer-{name}"]
    if model is None:
        candidates.append(data / "reference-ci")
    found = next((d for d in candidates if (d / "results.csv").is_file()), None)
    if found is None:
        flag = f" --model {model}" if model else ""
        raise FileNotFoundError(f"no results.csv in {[str(c) for c in candidates]}: run `python -m labkit answer"
                                f" --profile {profile}{flag}`{also}")
    return found


def publish(out: str | os.PathLike, reference: str | os.PathLike) -> list[Path]:
    """Copy the small artifacts of an answer (CSVs, machine.json, answer_card.json, report if < 5 MB) to
    `reference`."""
    out, reference = Path(out), Path(reference)
    reference.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in ("results.csv", "maxbatch.csv", "maxbatch_probes.csv", "memory.csv", "activation.csv", "noise.csv",
                 "machine.json", "answer_card.json", "report.html"):
        source = out / name
        if not source.is_file() or (name == "report.html" and source.stat().st_size >= REPORT_MAX_BYTES):
            continue
        shutil.copyfile(source, reference / name)
        copied.append(reference / name)
    # Run directories are not published: strip their local paths from the copied results.
    results = reference / "results.csv"
    if results.is_file():
        table = pd.read_csv(results)
        table["run_dir"] = table["run_id"]
        write_text_atomic(results, table.to_csv(index=False))
    for path in copied:
        path.chmod(0o644)  # atomic writes create owner-only files; these are for everyone
    return copied


def cli(args: Any) -> int:
    """Entry point of `python -m labkit answer` (labkit.cli parses the arguments)."""
    from labkit.launch.environment import check_environment
    from labkit.launch.store import check_output_dir, default_root
    from labkit.runtime.profiles import current_profile

    # Refused at once, before the profile and the devices load and long before the sweep ends (--reference is
    # first written then); the variables before the output directory is made.
    check_environment(os.environ)
    if args.parallel is not None and args.parallel < 1:
        raise ConfigError("parallel", f"--parallel must be at least 1 (timed runs at once), got {args.parallel}; "
                          "leave it out for the most the machine allows")
    for flag in ("out", "reference"):
        if getattr(args, flag, None) is not None:
            check_output_dir(getattr(args, flag), f"--{flag}")
    profile = args.profile or current_profile()
    model, data, loss = (getattr(args, k, None) for k in ("model", "data", "loss"))
    name = with_model(PROFILES[profile], model, data, loss).name
    out = Path(args.out) if args.out else default_root() / f"answer-{name}"
    try:
        report = answer(profile, out, parallel=args.parallel, model=model, data=data, loss=loss)
    except KeyboardInterrupt:
        print(f"\ninterrupted: finished points are kept in {out}; run the same command again to resume",
              file=sys.stderr)
        return 130
    print(f"report: {report}")
    print(f"results: {out / 'results.csv'}")
    if args.reference:
        for path in publish(out, args.reference):
            print(f"published: {path}")
    return strict_exit_code(pd.read_csv(out / "results.csv"), strict=getattr(args, "strict", False))


def report_cli(args: Any) -> int:
    """Entry point of `python -m labkit report DIR`: 0, or 2 naming what is missing (nothing written)."""
    try:
        report = rebuild_report(args.results)
    except (FileNotFoundError, ValueError, KeyError, AttributeError, TypeError) as error:
        # a missing table, or one that is not an answer's (a column missing): nothing was written
        said = str(error) if isinstance(error, (FileNotFoundError, ValueError)) else (
            f"{args.results}: a table is not an answer's ({type(error).__name__}: {error})")
        print(f"error: {said}", file=sys.stderr)
        return 2
    print(f"report: {report}")
    print(f"answer card: {Path(args.results) / 'answer_card.json'}")
    return 0


def strict_exit_code(results: pd.DataFrame, *, strict: bool) -> int:
    """`answer --strict`: 1 when a sweep point did not finish (each is named on stderr), else 0."""
    unfinished = results[results.status != "finished"]
    for row in unfinished.itertuples():
        print(f"not finished: {row.strategy} global batch {row.global_batch}: {row.status}", file=sys.stderr)
    return 1 if strict and len(unfinished) else 0

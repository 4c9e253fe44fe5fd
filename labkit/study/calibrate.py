"""Calibrated on a run: a finished run's measured step, the link fit and the host's costs, for predicting the
same training at another world size, micro-batch or ZeRO stage (`labkit predict --from RUN_DIR`): a run of CPU ranks
on this machine (`calibrated`), and the check of that against 2-rank runs (`cpu_comparison`, data/predict-ci/); a
run on GPUs through the GPU model (`calibrated_gpu`). Every figure it returns is a PREDICTION.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labkit.study import flops
from labkit.study.predict import FittedLinks, ModuleWorkload, comm_time, partition_ranks


@dataclass(frozen=True)
class MeasuredRun:
    """What a finished run measured, per optimizer step (rank 0's steps after the first two, summarised by read_run)."""

    run_dir: str
    config: dict[str, Any]
    forward_s: float
    backward_s: float
    optimizer_s: float
    step_time_s: float
    steps: int
    step_spread_s: float = 0.0  # the steps' median absolute deviation: how much one step varies from the next

    @property
    def world_size(self) -> int:
        return int(self.config["world_size"])

    @property
    def stage(self) -> int | None:
        return None if self.config.get("example") == "pytorch" else int(self.config.get("stage") or 0)

    @property
    def offload(self) -> bool:
        return bool(self.config.get("offload_optimizer"))

    @property
    def threads_per_rank(self) -> int:
        return int(self.config.get("threads_per_rank") or max(1, (os.cpu_count() or 1) // self.world_size))


SKIP_STEPS = 2
# mean: a run's time is its steps x their mean, and a step's mean is the sum of its parts' means (compute, each
# collective), which no other statistic is; median, and p10 (the fastest decile) on a machine other processes load.
STATISTICS = ("mean", "median", "p10")


def read_run(run_dir: str | os.PathLike, statistic: str = "mean") -> MeasuredRun:
    """A finished labkit run directory (config.json + rank0.jsonl with per-step phase times), each phase summarised
    over the steps after the first two by `statistic` (`STATISTICS`)."""
    import json

    from labkit.core.records import read_records

    path = Path(run_dir)
    if not (path / "config.json").exists():
        raise ValueError(f"not a labkit run directory (no config.json): {run_dir}")
    try:
        config = json.loads((path / "config.json").read_text())
    except ValueError as exc:  # malformed JSON, or not text: said with the file, not as a bare parser message
        raise ValueError(f"{path / 'config.json'} does not read as JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path / 'config.json'} is not a run's config (a JSON object), but a "
                         f"{type(config).__name__}")
    missing = [key for key in ("world_size", "micro_batch") if key not in config]  # what calibrating reads first
    if missing:
        raise ValueError(f"{path / 'config.json'} has no {' or '.join(missing)}: not a labkit run's config")
    steps = [r for r in read_records(path / "rank0.jsonl") if r.get("event") == "step" and "forward_s" in r]
    steps = steps[SKIP_STEPS:] if len(steps) > SKIP_STEPS + 2 else steps
    if not steps and config.get("script"):  # a script of yours times its own steps, not labkit's phases
        raise ValueError(f"{run_dir} ran a script of yours ({config['script']}), whose steps have no phase times: "
                         "--from calibrates on a run of labkit's examples (--example)")
    if not steps:
        raise ValueError(f"{run_dir} has no per-step records with phase times (a run with telemetry on is needed)")

    if statistic not in STATISTICS:
        raise ValueError(f"statistic must be one of {STATISTICS}, got {statistic!r}")
    phases = ("forward_s", "backward_s", "optimizer_s", "step_time_s")
    for record in steps:  # a damaged record's text is named with its file, not float()'s bare message
        bad = [key for key in phases if not isinstance(record.get(key) or 0.0, (int, float))]
        if bad:
            raise ValueError(f"{path / 'rank0.jsonl'}: step {record.get('step')}'s {', '.join(bad)} must be numbers "
                             f"of seconds, got {', '.join(repr(record[k]) for k in bad)}")

    def summary(key: str) -> float:
        from labkit.study.comms import summarise

        return summarise([float(r.get(key) or 0.0) for r in steps], statistic)

    times = sorted(float(r.get("step_time_s") or 0.0) for r in steps)
    middle = times[len(times) // 2]
    spread = sorted(abs(t - middle) for t in times)[len(times) // 2]
    return MeasuredRun(str(path), config, summary("forward_s"), summary("backward_s"), summary("optimizer_s"),
                       summary("step_time_s"), len(steps), spread)


def effective_cores(threads_per_rank: int, ranks: int, cores: int) -> float:
    """Cores one CPU rank computes on: its threads, or its share of the machine's cores when ranks x threads
    oversubscribe them (ranks on one machine share its cores: no fudge factor, the share)."""
    return min(float(threads_per_rank), cores / ranks)


@dataclass(frozen=True)
class CpuDevice:
    """This machine's per-thread FLOP/s, memory bandwidth and per-op dispatch cost, measured (for the cost of a
    micro-batch of another size on CPU ranks: a roofline plus one dispatch per op)."""

    flops_per_s: float
    bytes_per_s: float
    op_overhead_s: float

    def seconds(self, ops: list[flops.Op]) -> float:
        return float(sum(max(op.flops / self.flops_per_s, op.bytes / self.bytes_per_s) + self.op_overhead_s
                         for op in ops))


def measure_cpu_device(seconds: float = 0.2) -> CpuDevice:
    import time

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        a @ b
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            a @ b
            n += 1
        flops_per_s = 2 * 512**3 * n / (time.perf_counter() - start)
        big = torch.empty(8 << 20)
        src = torch.randn(8 << 20)
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            big.copy_(src)
            n += 1
        bytes_per_s = 2 * big.numel() * 4 * n / (time.perf_counter() - start)
        tiny = torch.zeros(1)
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            tiny.add_(1.0)
            n += 1
        overhead = (time.perf_counter() - start) / n
    finally:
        torch.set_num_threads(threads)
    return CpuDevice(flops_per_s, bytes_per_s, overhead)


def calibrated(run: MeasuredRun, link_fit: Any, *, world_size: int | None = None, micro_batch: int | None = None,
               stage: int | None = None, cores: int | None = None, threads_per_rank: int | None = None,
               device: CpuDevice | None = None) -> dict[str, Any]:
    """The same training as `run`, PREDICTED at another world size, micro-batch or ZeRO stage on this machine:
    the run's measured compute per micro-step (less the communication it had, predicted), the optimizer's measured
    time over the parameters a rank owns, and DeepSpeed's collectives timed with `link_fit` (a link fit's JSON as
    `link_fits` returns it: a LinkSettings for a link measured at several settings). CPU ranks share the machine's
    cores: each computes on `effective_cores`."""
    from labkit.core.config import RunConfig

    config = RunConfig.from_dict({k: v for k, v in run.config.items() if k in RunConfig.__dataclass_fields__})
    old_n, new_n = run.world_size, world_size or run.world_size
    old_stage = run.stage
    new_stage = old_stage if stage is None else stage
    if new_stage is not None and new_stage == 0 and run.offload:
        raise ValueError("offload needs ZeRO stage >= 1")
    accum = int(run.config.get("grad_accum") or 1)
    old_m, new_m = int(run.config["micro_batch"]), micro_batch or int(run.config["micro_batch"])
    cores = cores or os.cpu_count() or 1
    new_threads = threads_per_rank or (config.threads_per_rank if world_size is None and config.threads_per_rank
                                       else max(1, cores // new_n))
    links_at = _links_model(link_fit)
    precision = run.config.get("precision", "fp32")

    def rows(stage_: int | None, n: int, m_accum: int) -> list[Any]:
        """The run's own config (its ds_config's ZeRO settings, its model's layout) at `n` ranks and `stage_`."""
        from labkit.core.config import without_local_device_checks
        from labkit.study import comms

        if n < 2:
            return []
        values = {**run.config, "world_size": n, "grad_accum": m_accum}
        if stage_ is not None:  # plain PyTorch has none (RunConfig refuses one)
            values["stage"] = stage_
        with without_local_device_checks():
            variant = RunConfig.from_dict({k: v for k, v in values.items() if k in RunConfig.__dataclass_fields__})
        return comms.run_collectives(variant)

    # What the measured run spent communicating (predicted with the same link fit), taken out of its step time (the
    # step, not the sum of its phases: one statistic over whole steps, the same one the prediction is compared with).
    old_rows = rows(old_stage, old_n, accum)
    # A link measured at several settings is read at the run's compute per collective (its step, for a measured
    # N-rank run, which includes the communication: an approximation).
    had = comm_time(old_rows, links_at(run.step_time_s / _calls(old_rows)), old_n, grad_accum=accum,
                    hide_behind={})
    compute_old = max(run.step_time_s - had.total_s, 0.0)
    optimizer_old = max(run.optimizer_s - sum(r["seconds_per_step"] for r in had.rows if r["phase"] == "optimizer"),
                        0.0)
    micro_old = max(compute_old - optimizer_old, 0.0) / accum
    speed = effective_cores(run.threads_per_rank, old_n, cores) / effective_cores(new_threads, new_n, cores)
    scale = 1.0
    work = ModuleWorkload(config)
    new_c = work.census(new_m, precision, cuda=False)
    if new_m != old_m:
        device = device or measure_cpu_device()
        old_c = work.census(old_m, precision, cuda=False)
        scale = device.seconds(new_c.forward + new_c.backward) / device.seconds(old_c.forward + old_c.backward)
    micro_new = micro_old * scale * speed
    optimizer_new = optimizer_old * speed * partition_ranks(old_stage, old_n) / partition_ranks(new_stage, new_n)
    spare = cores > new_n * new_threads
    share = micro_new / 2  # forward ~ 1/3, backward ~ 2/3 of a micro-step; only used when a core is spare
    new_rows = rows(new_stage, new_n, accum)
    compute = accum * micro_new + optimizer_new
    busy = compute / _calls(new_rows)  # the compute between two of its collectives
    comm = comm_time(new_rows, links_at(busy), new_n, grad_accum=accum,
                     hide_behind={"forward": share, "backward": share} if spare else {})
    step = compute + comm.exposed_s
    global_batch = new_m * accum * new_n
    tflops = accum * new_c.flops() / step / 1e12  # per rank; the lab's models recompute nothing
    memory = memory_here(work, {**run.config, "world_size": new_n, "stage": new_stage, "micro_batch": new_m,
                                "threads_per_rank": new_threads}, precision)
    return {"predicted": True, "calibrated_from": run.run_dir, "world_size": new_n, "micro_batch": new_m,
            "grad_accum": accum, "stage": new_stage, "offload_optimizer": run.offload, "threads_per_rank": new_threads,
            "global_batch": global_batch, "step_time_s": step,
            "step_time_s_if_nothing_hides": compute + comm.total_s,
            "samples_per_s": global_batch / step,
            "model_tflops_per_gpu": tflops, "hardware_tflops_per_gpu": tflops, **memory,
            "compute_s": compute, "optimizer_s": optimizer_new, "comm_s": comm.total_s,
            "exposed_comm_s": comm.exposed_s, "offload_s": 0.0, "measured_step_time_s": run.step_time_s,
            "compute_per_collective_s": busy, "collectives": comm.rows}


def ready_record(run_dir: str | os.PathLike) -> dict[str, Any]:
    """Rank 0's `ready` record (its accelerator, optimizer and, from 2026-11-30, device name); {} where none."""
    from labkit.core.records import read_records

    path = Path(run_dir) / "rank0.jsonl"
    return next((r for r in read_records(path) if r.get("event") == "ready"), {}) if path.exists() else {}


def run_strategy(config: dict[str, Any], stage: int | None = None) -> str:
    """The predictor's strategy of a run's config, or DeepSpeed's ZeRO `stage` if given (a plain PyTorch run's too)."""
    if stage is None:
        if config.get("example") == "pytorch":
            return "torch"
        stage = int(config.get("stage") or 0)
    return f"z{stage}" + ("-offload" if config.get("offload_optimizer") else "")


def run_zero(config: dict[str, Any], stage: int | None) -> dict[str, Any]:
    """The `zero_optimization` settings a run's `ds_overrides` gave DeepSpeed, as the predictor takes them at
    `stage` (None: plain PyTorch, which has none): checked there by DeepSpeed's config model and the model's own
    refusals, a ValueError naming the run's setting. The stage and the optimizer's offload are the strategy's: the
    run's config sets them, and overrides that say otherwise are refused (the run did not run as its config says).
    ZeRO-3's own settings are left out at stages 0-2, where DeepSpeed reads them and they change nothing
    (`comms.stage3_only`)."""
    from labkit.study import comms

    given = dict((config.get("ds_overrides") or {}).get("zero_optimization") or {})
    where = "the run's ds_overrides.zero_optimization"
    if "stage" in given and given["stage"] != int(config.get("stage") or 0):
        raise ValueError(f"{where} sets stage {given['stage']} over its config's {config.get('stage')}: --from "
                         "predicts a run as its config says it ran")
    offload = bool(config.get("offload_optimizer"))
    for key in ("offload_optimizer", "cpu_offload"):  # DeepSpeed's name for it and its older one
        value = given.get(key)
        said = value if isinstance(value, bool) else isinstance(value, dict) and value.get("device", "none") != "none"
        if key in given and said != offload:
            raise ValueError(f"{where} turns the optimizer's offload {'on' if said else 'off'} over its config's "
                             f"offload_optimizer={offload}: --from predicts a run as its config says it ran")
    if stage is None:
        return {}
    zero = {k: v for k, v in given.items() if k not in ("stage", "offload_optimizer", "cpu_offload")}
    if stage < 3:
        for key in comms.stage3_only(zero):
            del zero[key]
    try:
        comms.check_zero_settings(stage, zero, offload)
    except ValueError as exc:
        raise ValueError(f"{where} at stage {stage}: {exc}") from None
    return zero


@dataclass(frozen=True)
class GpuCalibration:
    """`gpu_calibration`'s two readings of one run (`predict.Calibration` each): they differ only where the run
    was slower than the model, which one run cannot split into fixed work and a slower device."""

    fixed: Any   # the miss as work that does not grow with the micro-batch (what step_time_s uses)
    grows: Any   # the miss as a device slower than its roofline, growing with the micro-batch
    slower: bool  # the run's micro-step took longer than the model's


def gpu_calibration(run: MeasuredRun, workload: Any, cluster: Any, *, strategy: str, optimizer: str | None,
                    links: Any | None = None, zero: dict[str, Any] | None = None) -> GpuCalibration:
    """What a run on GPUs says the model misses, from its measured phases against the model at the run's own
    config. Per micro-step: its forward + backward, less the communication the model exposes in those phases,
    against the longer of the model's device compute and host work (the micro-step is the longer of the two: the
    host issues the device's work ahead). Per step: its optimizer phase, less the optimizer phase's collectives,
    against the model's optimizer step (+ offload), and its step's time outside the phases (the loop, the next
    batch) added to it.
    - No slower than the model: the device, the host and the optimizer ran faster than modelled, each scaled down;
      the run's own step comes back.
    - Slower, by more than its steps vary (their median absolute deviation; within it, read as no miss): the miss
      is work the model does not count, and one run cannot say which. Read as fixed work (kernel launches and
      Python beyond one launch per op, which docs/predict.md lists as left out): the host's work per micro-step
      becomes the measured micro-step, so a bigger micro-batch costs nothing more until the device's compute passes
      it, and a smaller one no less. Read as a device slower than its roofline: the device's compute x (measured /
      modelled). Both give the run's own step back; at another micro-batch they bracket the truth.
    `zero`: the run's own `zero_optimization` settings (`run_zero`)."""
    from labkit.study import predict as P

    measured_parts = (run.forward_s, run.backward_s, run.optimizer_s, run.step_time_s)
    if not all(math.isfinite(t) and t >= 0 for t in measured_parts):
        raise ValueError(f"{run.run_dir}: its phases and step must be finite times >= 0, got {measured_parts}")
    accum, micro = int(run.config.get("grad_accum") or 1), int(run.config["micro_batch"])
    model = P.predict(workload, cluster, strategy=strategy, micro_batch=micro, grad_accum=accum,
                      precision=run.config.get("precision", "fp32"), optimizer=optimizer, links=links, zero=zero)
    device = model.forward_s + model.backward_s - model.host_bound_s / accum  # the device's own, one micro-step
    host = model.host_overhead_s / accum
    # the optimizer phase's collectives (never overlapped) are timed in the run's optimizer phase, the rest of the
    # exposed communication in its forward and backward
    in_step = sum(r["seconds_per_step"] for r in model.collectives if r["phase"] == "optimizer")
    measured = (run.forward_s + run.backward_s - (model.exposed_comm_s - in_step)) / accum
    if measured <= 0:
        raise ValueError(f"{run.run_dir}: its forward and backward ({run.forward_s + run.backward_s:.3g} s) are no "
                         f"longer than the communication predicted in them: nothing to calibrate the compute on (its "
                         "links faster than the GPU kind's presets? give a fit measured on them, --links)")
    stepped = model.optimizer_s + model.offload_s
    optimizer_phase = max(run.optimizer_s - in_step, 0.0)
    outside = max(0.0, run.step_time_s - run.forward_s - run.backward_s - run.optimizer_s)
    opt: dict[str, Any] = dict(
        optimizer_factor=min(1.0, optimizer_phase / stepped) if stepped > 0 and optimizer_phase > 0 else 1.0,
        optimizer_excess_s=max(0.0, optimizer_phase - stepped) + outside,
        source=f"{run.run_dir} (measured step {run.step_time_s:.4g} s, predicted {model.step_time_s:.4g} s before "
               "calibration)")
    # a miss within the run's own step-to-step variation says nothing: read as no miss (rounding too)
    if measured <= max(device, host) * (1 + 1e-9) + run.step_spread_s / accum:
        measured = min(measured, max(device, host))
        faster = P.Calibration(device_factor=min(1.0, measured / device), host_factor=min(1.0, measured / host)
                               if host > 0 else 1.0, **opt)
        return GpuCalibration(faster, faster, False)
    return GpuCalibration(P.Calibration(host_excess_s=measured - host, **opt),
                          P.Calibration(device_factor=measured / device, **opt), True)


def calibrated_gpu(run: MeasuredRun, *, gpu: str | None = None, world_size: int | None = None,
                   micro_batch: int | None = None, stage: int | None = None,
                   links: Any | None = None) -> dict[str, Any]:
    """The same training as a run on GPUs, PREDICTED at another world size (GPUs of the run's kind in one node),
    micro-batch or ZeRO stage: `predict.predict` with the run's `gpu_calibration` (`step_time_s` the miss read as
    fixed work, `step_time_s_if_the_miss_grows` as a slower device); links from the GPU kind's presets (NVLink or
    PCIe in one node), or `links`, a link fit measured on the GPUs (`predict.FittedLinks`); the ZeRO settings its
    `ds_overrides` gave DeepSpeed (`run_zero`), at both stages. `gpu`: the run's GPU kind where its records do not
    name it (runs before 2026-11-30); where they do, it must be the same kind."""
    from labkit.core.config import RunConfig, without_local_device_checks
    from labkit.runtime.hardware import MAX_GPUS_PER_NODE, Cluster
    from labkit.runtime.hardware import gpu as find_gpu
    from labkit.study import optimizer_bytes
    from labkit.study import predict as P

    ready = ready_record(run.run_dir)
    recorded = ready.get("device_name")
    try:
        kind = find_gpu(str(recorded)) if recorded else None
    except ValueError:
        if not gpu:
            raise ValueError(f"{run.run_dir} ran on {recorded!r}, which no GPU preset is: give the nearest kind with "
                             "--gpu") from None
        kind = None
    if gpu:
        given = find_gpu(gpu)
        if kind is not None and given.name != kind.name:
            raise ValueError(f"{run.run_dir} ran on {recorded} ({kind.name}), not {given.name}: --from predicts the "
                             "run's own GPU kind (predict another from flags: --model, --gpu)")
        kind = given
    if kind is None:
        raise ValueError(f"{run.run_dir} does not name its GPU (a run before 2026-11-30, or a script of yours, whose "
                         "ranks write no ready record): give its kind with --gpu")
    old_n, new_n = run.world_size, world_size or run.world_size
    if max(old_n, new_n) > MAX_GPUS_PER_NODE:
        raise ValueError(f"--from on GPUs predicts one node of up to {MAX_GPUS_PER_NODE} GPUs; for more, predict from "
                         "flags (--gpus-per-node, --nodes, --inter-gbps)")
    with without_local_device_checks():
        config = RunConfig.from_dict({k: v for k, v in run.config.items() if k in RunConfig.__dataclass_fields__})
    work = P.lab_workload(config)
    old, new = run_strategy(run.config), run_strategy(run.config, stage)
    impl = ready.get("optimizer_impl")
    # the ZeRO settings the run's ds_overrides gave DeepSpeed, at each stage (its buckets set its collectives)
    old_zero, new_zero = (run_zero(run.config, P.STRATEGIES[s][0]) for s in (old, new))
    readings = gpu_calibration(run, work, Cluster(gpu=kind, gpus_per_node=old_n), strategy=old, optimizer=impl,
                               links=links, zero=old_zero)
    try:  # the run's optimizer where the new strategy is of its kind (plain or DeepSpeed) and can run it, else its
        optimizer_bytes.basic_optimizer(*P.STRATEGIES[new], impl)  # default (DeepSpeed's FusedAdam)
        new_impl = impl if (old == "torch") == (new == "torch") else None
    except ValueError:
        new_impl = None
    micro = micro_batch or int(run.config["micro_batch"])
    fixed, grows = (P.predict(work, Cluster(gpu=kind, gpus_per_node=new_n), strategy=new, micro_batch=micro,
                              grad_accum=int(run.config.get("grad_accum") or 1),
                              precision=run.config.get("precision", "fp32"), optimizer=new_impl, calibration=c,
                              links=links, zero=new_zero) for c in (readings.fixed, readings.grows))
    out = fixed.to_dict()
    if config.distributed_sampler and not config.sample_with_replacement:  # RunConfig's own rule: each rank's share
        out["max_micro_batch"] = min(out["max_micro_batch"], config.dataset_size // new_n)
    return {**out, "calibrated_from": run.run_dir, "measured_step_time_s": run.step_time_s,
            "step_time_s_if_the_miss_grows": grows.step_time_s, "run_slower_than_model": readings.slower,
            "calibration": dataclasses.asdict(readings.fixed), "stage": P.STRATEGIES[new][0]}


def gpu_comparison(data_root: str | os.PathLike) -> Any:
    """Every finished 1-rank point of the lab's GPU answers under `data_root` (data/reference-*/: machine.json naming
    a GPU with a preset, results.csv or answer-partial/results.csv), its median step PREDICTED from its config alone
    and calibrated on the same strategy's run at another micro-batch where its records are kept (`calibrated_gpu`:
    the miss read as fixed work, and as a slower device), beside the measured one (a DataFrame; None: no such
    point)."""
    import json

    import pandas as pd

    from labkit.runtime.hardware import Cluster, preset_for
    from labkit.runtime.hardware import gpu as find_gpu
    from labkit.study import predict as P

    if not Path(data_root).is_dir():  # a misspelled path read as "no GPU point", then a TypeError on None
        raise ValueError(f"{data_root}: no such directory (the lab's data/, holding reference-*/)")
    rows = []
    for machine_file in sorted(Path(data_root).glob("reference-*/machine.json")):
        machine = json.loads(machine_file.read_text())
        preset = preset_for(machine.get("device", "")) if machine.get("accelerator") == "cuda" else None
        if preset is None:
            continue  # CPU references, GPUs without a preset
        folder = machine_file.parent
        results = next((f for f in (folder / "results.csv", folder / "answer-partial" / "results.csv") if f.exists()),
                       None)
        if results is None:
            continue
        workload, _ = P.answer_workload(folder)
        cluster = Cluster(gpu=find_gpu(preset))
        # One row per training: the LR study's runs at other learning rates time the same step again.
        table = pd.read_csv(results)
        table = table[(table["status"] == "finished") & (table["world_size"] == 1)]
        finished = list(table.drop_duplicates(["strategy", "micro_batch", "grad_accum", "precision"]).itertuples())
        records = results.parent / "run-records"
        for row in finished:
            guess = P.predict(workload, cluster, strategy=row.strategy, micro_batch=int(row.micro_batch),
                              grad_accum=int(row.grad_accum), precision=row.precision)
            other = next((o for o in finished if o.strategy == row.strategy and o.micro_batch != row.micro_batch
                          and o.grad_accum == row.grad_accum and o.precision == row.precision
                          and (records / o.run_id).is_dir()), None)  # the same training at another micro-batch
            both = (calibrated_gpu(read_run(records / other.run_id, "median"), gpu=preset,
                                   micro_batch=int(row.micro_batch)) if other is not None else {})
            measured = float(row.median_step_time_s)
            calibrated = both.get("step_time_s", float("nan"))
            grows = both.get("step_time_s_if_the_miss_grows", float("nan"))
            rows.append({"reference": str(results.parent.relative_to(folder.parent)), "gpu": preset,
                         "strategy": row.strategy, "micro_batch": row.micro_batch, "grad_accum": row.grad_accum,
                         "measured_s": measured, "predicted_s": guess.step_time_s,
                         "error": guess.step_time_s / measured - 1,
                         "calibrated_on_micro_batch": other.micro_batch if other is not None else None,
                         "calibrated_s": calibrated, "calibrated_error": calibrated / measured - 1,
                         "if_the_miss_grows_error": grows / measured - 1})
    return pd.DataFrame(rows) if rows else None


def memory_here(work: ModuleWorkload, values: dict[str, Any], precision: str) -> dict[str, Any]:
    """`device_bytes` (one CPU rank: its base, model states and activations, as labkit's admission estimates a run
    before it starts), `fits` (all the ranks and the launcher, in what this machine could give runs:
    `memory_room_bytes`) and `max_micro_batch` (also within the samples each rank gets), for the run's config at
    `values`. Activations: the admission's count for labkit's MLP, else the census's."""
    import psutil

    from labkit.core.config import RunConfig, without_local_device_checks
    from labkit.launch import admission
    from labkit.study.predict import largest_micro_batch

    with without_local_device_checks():
        config = RunConfig.from_dict({k: v for k, v in values.items() if k in RunConfig.__dataclass_fields__})
    here = admission.Admission.here()
    facts = here.learned.model(config)
    per_sample = facts.activation_bytes_per_sample if facts is not None else None

    def activations(micro: int) -> float:
        if per_sample is not None:
            return per_sample * micro
        return float(work.census(micro, precision, cuda=False).saved_bytes)  # as this CPU runs it

    without = admission.estimate(config, model=admission.ModelFacts(work.n_params, 0.0), is_cpu=True,
                                 rank_base_bytes=here.learned.rank_base_bytes,
                                 launcher_bytes=here.learned.launcher_bytes, cores=here.cores)
    room, _ = admission.room_bytes(vm_total=psutil.virtual_memory().total, limit=admission.memory_limit(),
                                   tree_rss=0)
    per_rank_room = (room - without.launcher_bytes) / config.world_size - without.rank_bytes
    largest = largest_micro_batch(activations, per_rank_room)
    if config.distributed_sampler and not config.sample_with_replacement:
        largest = min(largest, config.dataset_size // config.world_size)  # RunConfig's own rule
    device = without.rank_bytes + activations(config.micro_batch)
    return {"device_bytes": float(device), "fits": device * config.world_size + without.launcher_bytes <= room,
            "max_micro_batch": largest, "memory_room_bytes": float(room)}


def _calls(rows: list[Any]) -> float:
    """Collectives per optimizer step (at least 1, so a run without any divides by 1)."""
    return max(1.0, float(sum(c.per_step for c in rows)))


def _at_settings(fit: Any) -> bool:
    """A link fit's JSON measured at several settings of the compute before each call (its `raw` rows carry
    `busy_s`: comms.measure_training_links)."""
    raw = fit.get("raw") if isinstance(fit, dict) else None
    return raw is not None and len(raw) > 0 and "busy_s" in raw[0]


@dataclass(frozen=True)
class LinkSettings:
    """A link measured at several settings of the compute before each call, fitted once per setting
    (comms.fit_settings): `at(busy_s)` reads it at one run's compute per collective."""

    fits: dict[float, dict[str, Any]]

    @classmethod
    def of(cls, fit: dict[str, Any]) -> LinkSettings:
        from labkit.study import comms

        return cls(comms.fit_settings(fit["raw"], int(fit["world_size"]), str(fit.get("statistic", "mean"))))

    def at(self, busy_s: float) -> FittedLinks:
        from labkit.study import comms

        return FittedLinks({"fits": comms.read_settings(self.fits, busy_s)})


def _links_model(link_fit: Any) -> Any:
    """busy_s -> FittedLinks: a link measured at several settings read at `busy_s` (LinkSettings, from `link_fits`);
    any other fit the same at every setting."""
    if isinstance(link_fit, LinkSettings):
        return link_fit.at
    links = FittedLinks(link_fit)
    return lambda busy_s: links


def link_fits(fit: dict[str, Any], statistic: str) -> dict[str, Any] | LinkSettings:
    """A link fit's JSON (`predict.link_fit_json`) with its calls summarised by `statistic`, the statistic of the runs
    it times: refitted from its timed calls (`raw`) when it kept them (measured at several settings: fitted once per
    setting, a LinkSettings that `calibrated` reads at each run's own), else as it is if it was fitted by that
    statistic; otherwise a ValueError (a fit of the fastest calls after a barrier times the link alone, not the
    link a training step meets, and would predict a mean step far too short)."""
    from labkit.study import comms

    if _at_settings(fit):
        return LinkSettings.of({**fit, "statistic": statistic})
    if fit.get("raw"):
        fits = comms.fit_links(fit["raw"], int(fit["world_size"]), statistic)
        return {**fit, "statistic": statistic,
                "fits": {op: {"alpha_s": f.alpha_s, "beta_s_per_byte": f.beta_s_per_byte} for op, f in fits.items()}}
    measured_by = fit.get("statistic", "fastest")  # files written before the statistic was recorded: the fastest
    if measured_by != statistic:
        raise ValueError(f"this link fit summarises its calls by {measured_by!r} and kept none to refit; the run's "
                         f"steps are summarised by {statistic!r}: measure the link as training meets it "
                         "(leave out --links, or save comms.measure_training_links() as JSON)")
    return fit


def cpu_comparison(data_dir: str | os.PathLike, statistic: str = "mean",
                   links: str | os.PathLike | None = None) -> Any:
    """Every 2-rank point of `data_dir/runs.csv` PREDICTED from the 1-rank run of the same strategy and
    micro-batch, beside the measured 2-rank step time (a DataFrame). The link: `links` (default `links_grid.json`,
    measured at several settings and read at each run's compute per collective, else `links.json`), its timed calls
    fitted by `statistic`, the runs' per-step summary (`STATISTICS`), so both sides are summarised alike."""
    import json

    import pandas as pd

    data = Path(data_dir)
    runs = pd.read_csv(data / "runs.csv")
    if "statistic" in runs:
        if statistic not in set(runs["statistic"]):  # an empty table, and KeyErrors in the cells after it
            raise ValueError(f"{data / 'runs.csv'} has no {statistic!r} rows; it has "
                             f"{', '.join(sorted(set(runs['statistic'])))}")
        runs = runs[runs["statistic"] == statistic]
    links = Path(links) if links else (data / "links_grid.json" if (data / "links_grid.json").exists()
                                        else data / "links.json")
    fit = link_fits(json.loads(links.read_text()), statistic)
    machine = json.loads((data / "machine.json").read_text()) if (data / "machine.json").exists() else {}
    cores = int(machine.get("cpu_cores") or 2)
    rows = []
    for _, two in runs[runs["world_size"] == 2].iterrows():
        one = runs[(runs["world_size"] == 1) & (runs["strategy"] == two["strategy"])
                   & (runs["micro_batch"] == two["micro_batch"])]
        if one.empty:
            continue
        base = one.iloc[0]
        run = MeasuredRun(f"{base['strategy']}-w1-m{base['micro_batch']}", json.loads(base["config"]),
                          float(base["forward_s"]), float(base["backward_s"]), float(base["optimizer_s"]),
                          float(base["step_time_s"]), int(base["steps"]))
        pred = calibrated(run, fit, world_size=2, cores=cores, threads_per_rank=1)
        rows.append({"strategy": two["strategy"], "micro_batch": int(two["micro_batch"]),
                     "measured_1_rank_s": float(base["step_time_s"]), "predicted_2_rank_s": pred["step_time_s"],
                     "measured_2_rank_s": float(two["step_time_s"]),
                     "predicted_exposed_comm_s": pred["exposed_comm_s"],
                     "compute_per_collective_s": pred["compute_per_collective_s"],
                     "error": pred["step_time_s"] / float(two["step_time_s"]) - 1})
    return pd.DataFrame(rows)



# A 1-rank DeepSpeed engine in a child process: a stack of small Linear modules timed at ZeRO-0 and ZeRO-3
# (persistence threshold 0: every module is fetched); the difference per module fetch is the hooks' host cost.
_FETCH_PROBE = """
import json, os, sys, time
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import torch
torch.set_num_threads(1)
import deepspeed
from torch import nn
deepspeed.init_distributed("gloo", verbose=False)
K, x, best = 64, torch.randn(1, 16), {}
for stage in (0, 3):
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(K)])
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
              "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    times = []
    for _ in range(40):
        start = time.perf_counter()
        engine.backward(engine(x).sum())
        times.append(time.perf_counter() - start)
    best[stage] = sorted(times[5:])[len(times[5:]) // 10]
print(json.dumps({"zero3_fetch_s": (best[3] - best[0]) / (2 * K), "modules": K, "zero0_s": best[0],
                  "zero3_s": best[3]}))
"""


def measure_zero3_fetch_s(repeats: int = 3) -> dict[str, Any]:
    """ZeRO-3's host cost per submodule fetch on this machine (the fastest decile of 35 forward + backward passes of
    64 small Linear modules, ZeRO-3 minus ZeRO-0, over 2 fetches per module), in a child process (~20 s each); the
    least disturbed (minimum) of `repeats` probes, since other processes only ever slow it."""
    probes = [_fetch_probe() for _ in range(repeats)]
    best = min(probes, key=lambda p: p["zero3_fetch_s"])
    return {**best, "observations_s": [p["zero3_fetch_s"] for p in probes]}


def _fetch_probe() -> dict[str, Any]:
    import json
    import subprocess
    import sys

    from labkit.launch.launcher import free_port
    from labkit.runtime.ops import interpreter_path

    port = free_port()
    # this interpreter's ninja first: another would rebuild the shm op (ops.interpreter_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": interpreter_path(os.environ.get("PATH"))}
    done = subprocess.run([sys.executable, "-c", _FETCH_PROBE, str(port)], capture_output=True, text=True,
                          timeout=900, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"the ZeRO-3 fetch probe failed:\n{done.stderr[-2000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


# ZeRO-3's host work that grows with the ranks. At 1 rank DeepSpeed gathers nothing (0.19.8,
# partition_parameters.py:1559, `all_gather_coalesced`: every partition world size 1 -> `_no_gather_coalesced`), so a
# 1-rank probe (above, and bench_gpu_constants.py's on a GPU node) misses the gather path: at N ranks each fetch builds
# a flat buffer and N partition views (`_all_gather_dtype`, :1329-1350), launches the all-gather, and on completion
# narrows N partitions per parameter and concatenates them (`AllGatherCoalescedHandle.wait`, :761; on CUDA also a
# `record_stream` per partition, which the CPU accelerator skips). The probe times the main thread's CPU
# (`time.thread_time`: waiting on the other ranks and on gloo's threads costs none) of a forward + backward of
# Linear(64, 64) stacks at two depths, ZeRO-3 minus ZeRO-0, at each world size: the slope is the host work per module
# per micro-step (2 fetches of 2 gathered parameters: stage3_param_persistence_threshold 0). Sharing the cores still
# inflates CPU time (caches, the other ranks' threads), so each step's lower quartile, and per rank the least of
# `repeats` probes.
ZERO3_RANKS_PROBE = """
import json, os, statistics, sys, time
import torch
torch.set_num_threads(1)
from labkit.runtime.ds_import import import_deepspeed
import_deepspeed()
import deepspeed, logging
from deepspeed.utils import logger
from torch import nn
logger.setLevel(logging.WARNING)
deepspeed.init_distributed("gloo", verbose=False)
import torch.distributed as dist
lo, hi, steps = (int(v) for v in sys.argv[1:4])
x, cpu = torch.randn(1, 64), {}
for stage in (0, 3):
    for depth in (lo, hi):
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(depth)])
        config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
                  "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30,
                  "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        times = []
        for _ in range(steps):
            dist.barrier()
            start = time.thread_time()
            engine.backward(engine(x).sum())
            times.append(time.thread_time() - start)
            engine.step()
        kept = sorted(times[steps // 4:])
        cpu[stage, depth] = kept[len(kept) // 4]  # the lower quartile: other processes only ever add CPU time
        del engine, model
slope = [(cpu[s, hi] - cpu[s, lo]) / (hi - lo) for s in (0, 3)]
print(json.dumps({"rank": dist.get_rank(), "per_module_s": slope[1] - slope[0]}))
"""
ZERO3_GATHERED_PER_MODULE = 2  # the probe's Linear: weight and bias, both gathered (threshold 0)
# Of its two fetches per micro-step only the forward's gathers: the probe's model (72 x 4,160 elements) is smaller than
# one prefetch bucket and the reuse distance, so its backward finds the parameters kept (zero3.replay). Until
# 2026-11-28 this was 2, which halved both gather-path figures.
ZERO3_GATHERING_FETCHES_PER_MICRO_STEP = 1


def fit_rank_scaling(per_module_s: dict[int, float]) -> dict[str, float]:
    """ZeRO-3's host work per module per micro-step at each world size -> (the 1-rank figure; the gather path's fixed
    part per fetch that gathers; its part per rank per gathered parameter per such fetch): a least-squares line over
    the world sizes >= 2, its intercept minus the 1-rank figure the fixed part (the probe's module: 1 fetch that
    gathers 2 parameters per micro-step)."""
    if 1 not in per_module_s or sum(1 for n in per_module_s if n >= 2) < 2:
        raise ValueError("need the 1-rank figure and at least two world sizes >= 2")
    many = sorted((n, t) for n, t in per_module_s.items() if n >= 2)
    mean_n = sum(n for n, _ in many) / len(many)
    mean_t = sum(t for _, t in many) / len(many)
    slope = sum((n - mean_n) * (t - mean_t) for n, t in many) / sum((n - mean_n) ** 2 for n, _ in many)
    intercept = mean_t - slope * mean_n
    return {"one_rank_per_module_s": per_module_s[1],
            "per_fetch_s": (intercept - per_module_s[1]) / ZERO3_GATHERING_FETCHES_PER_MICRO_STEP,
            "per_rank_per_param_fetch_s": slope / (ZERO3_GATHERING_FETCHES_PER_MICRO_STEP * ZERO3_GATHERED_PER_MODULE)}


def zero3_rank_probe(world: int, depths: tuple[int, int], steps: int) -> list[float]:
    """ZERO3_RANKS_PROBE on `world` real ranks (gloo, one thread each): every rank's host work per module per
    micro-step, in seconds of its main thread's CPU."""
    import json
    import subprocess
    import sys
    import tempfile

    from labkit.launch.launcher import free_port
    from labkit.runtime.ops import interpreter_path

    port = free_port()  # below the kernel's ephemeral range: no outgoing connection takes it before rank 0 binds
    # each rank's output to a file: a rank blocked on a full pipe would stall every rank at the next barrier
    with tempfile.TemporaryDirectory() as folder:
        logs = [(Path(folder) / f"rank{rank}.out", Path(folder) / f"rank{rank}.err") for rank in range(world)]
        procs = []
        try:
            for rank, (out, err) in enumerate(logs):
                with out.open("w") as stdout, err.open("w") as stderr:
                    procs.append(subprocess.Popen(
                        [sys.executable, "-c", ZERO3_RANKS_PROBE, str(depths[0]), str(depths[1]), str(steps)],
                        stdout=stdout, stderr=stderr, text=True,
                        env={**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
                             "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank),
                             "WORLD_SIZE": str(world),
                             # this interpreter's ninja: another would rebuild the shm op (ops.interpreter_path)
                             "PATH": interpreter_path(os.environ.get("PATH"))}))
            for proc in procs:
                proc.wait(timeout=1800)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        for rank, (proc, (_, err)) in enumerate(zip(procs, logs, strict=True)):
            if proc.returncode:
                raise RuntimeError(f"the ZeRO-3 rank-scaling probe failed at world size {world}, rank {rank}:\n"
                                   f"{err.read_text()[-2000:]}")
        return [float(json.loads(out.read_text().strip().splitlines()[-1])["per_module_s"]) for out, _ in logs]


def measure_zero3_rank_scaling(world_sizes: tuple[int, ...] = (1, 2, 4, 8), depths: tuple[int, int] = (8, 72),
                               steps: int = 48, repeats: int = 2) -> dict[str, Any]:
    """The probe above at each world size (N real processes on gloo), `repeats` times: per rank the least of its
    figures, then the median over the ranks, and the fit (`fit_rank_scaling`). Several ranks share this machine's
    cores: CPU time, not wall time, is what holds."""
    import datetime
    import statistics

    load = list(os.getloadavg())  # before the probe's own ranks add to it
    observed = {world: [zero3_rank_probe(world, depths, steps) for _ in range(repeats)] for world in world_sizes}
    per_rank = {world: [min(values) for values in zip(*probes, strict=True)] for world, probes in observed.items()}
    medians = {world: statistics.median(values) for world, values in per_rank.items()}
    return {"format": "labkit-zero3-ranks/1",
            "source": (f"measured on this lab's CPU machine, {datetime.datetime.now(datetime.UTC):%Y-%m-%d}, "
                       "labkit.study.calibrate.measure_zero3_rank_scaling: main-thread CPU time, gloo; an estimate "
                       "for a GPU node, biased both ways (ranks sharing cores inflate it; the CPU accelerator skips "
                       "CUDA's record_stream per partition)"),
            "load_average_at_start": load, "depths": list(depths), "steps": steps, "repeats": repeats,
            "observed_s": {str(n): v for n, v in observed.items()},
            "per_module_s_by_rank": {str(n): v for n, v in per_rank.items()},
            "per_module_s": {str(n): v for n, v in medians.items()}, **fit_rank_scaling(medians)}


# -- the answer's own ranks way, checked in its report ---------------------------------------------------------------
ANSWER_LINKS = "links.json"  # in an answer's results dir: the link fit its check used (every timed call kept)
CHECK_HEAD = "<section id='predicted-this-machine'><h2>The predictor checked on this machine</h2>"


def no_check_section(why: str) -> str:
    """report.html's "checked on this machine" section when there is no check, saying why."""
    import html

    return CHECK_HEAD + f"<p>No check: {html.escape(why)}.</p></section>"


def answer_pairs(results: Any) -> list[tuple[Any, Any]]:
    """(1-rank row, N-rank row) of an answer's results.csv: the ranks way's points, the same strategy and micro-batch
    at 1 rank and at more, both finished."""
    if "growth" not in results or results.empty:
        return []
    ranks = results[results["growth"].astype(str).str.contains("ranks") & (results["status"] == "finished")]
    pairs = []
    for _, many in ranks[ranks["world_size"] > 1].iterrows():
        one = ranks[(ranks["world_size"] == 1) & (ranks["strategy"] == many["strategy"])
                    & (ranks["micro_batch"] == many["micro_batch"]) & (ranks["grad_accum"] == many["grad_accum"])]
        if not one.empty:
            pairs.append((one.iloc[0], many))
    return pairs


def _run_dir(results_dir: Path, row: Any) -> Path:
    """A results.csv row's run directory: under the results dir's runs/ (where a sweep keeps them), else as recorded
    when that is an absolute path (a relative one would be read against the current directory)."""
    kept = results_dir / "runs" / str(row["run_id"])
    recorded = Path(str(row["run_dir"]))
    return recorded if not kept.is_dir() and recorded.is_absolute() else kept


def answer_links(results_dir: str | os.PathLike, *, remeasure: bool) -> dict[str, Any] | None:
    """The link fit of an answer's check: `links.json` in its results dir, measured here (as training meets the link,
    every call kept) when `remeasure` or missing and the answer has a ranks way to check; None when it has none."""
    import json
    import time

    import pandas as pd

    from labkit.core.files import write_json_atomic
    from labkit.study import comms
    from labkit.study.predict import link_fit_json

    out = Path(results_dir)
    pairs = answer_pairs(pd.read_csv(out / "results.csv")) if (out / "results.csv").is_file() else []
    if not pairs:
        return None
    if (out / ANSWER_LINKS).is_file() and not remeasure:
        return dict(json.loads((out / ANSWER_LINKS).read_text()))
    world_size = max(int(many["world_size"]) for _, many in pairs)
    link = comms.measure_links(world_size=world_size, backend="gloo", busy_s=comms.TRAINING_BUSY_S,
                               reps=comms.TRAINING_REPS, statistic="mean")
    fit = {**link_fit_json(link, raw=True), "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "load_average": list(os.getloadavg())}
    write_json_atomic(out / ANSWER_LINKS, fit)
    return fit


def kept_report_section(results_dir: str | os.PathLike) -> str:
    """`report_section` from what an answer's results dir keeps, measuring nothing (a rebuilt report,
    `labkit.study.answer.rebuild_report`): its runs and its link fit, or why there is no check without them."""
    import json

    import pandas as pd

    out = Path(results_dir)
    pairs = answer_pairs(pd.read_csv(out / "results.csv"))
    if not pairs:
        return report_section(out, None)
    if not any(_run_dir(out, one).is_dir() and _run_dir(out, many).is_dir() for one, many in pairs):
        return no_check_section("the runs of its ranks way are not in this results dir (data/reference-* keeps no "
                                "run directories; data/predict-ci/ holds such a check, docs/predict.md)")
    if not (out / ANSWER_LINKS).is_file():
        return no_check_section(f"no link fit kept ({ANSWER_LINKS}), and a rebuilt report measures nothing: "
                                "`labkit answer --out` this results dir, with the profile and model its "
                                "machine.json names, measures it")
    return report_section(out, dict(json.loads((out / ANSWER_LINKS).read_text())))


def answer_check(results_dir: str | os.PathLike, link_fit: dict[str, Any]) -> Any:
    """The answer's ranks way on this machine: each N-rank point PREDICTED from the 1-rank run of the same strategy
    and micro-batch (`calibrated`, every run summarised by its mean step, `link_fit` refitted by the mean), beside
    the N-rank run's measured mean step (a DataFrame; empty when the answer has no ranks way or its runs are not
    here; a pair whose runs recorded no step time is left out)."""
    import pandas as pd

    out = Path(results_dir)
    fit = link_fits(link_fit, "mean")
    rows = []
    for one, many in answer_pairs(pd.read_csv(out / "results.csv")):
        one_dir, many_dir = _run_dir(out, one), _run_dir(out, many)
        if not (one_dir.is_dir() and many_dir.is_dir()):
            continue
        base, measured = read_run(one_dir, "mean"), read_run(many_dir, "mean")
        if base.step_time_s <= 0 or measured.step_time_s <= 0:
            continue
        pred = calibrated(base, fit, world_size=measured.world_size, threads_per_rank=measured.threads_per_rank)
        rows.append({"strategy": many["strategy"], "micro_batch": int(many["micro_batch"]),
                     "world_size": measured.world_size, "measured_1_rank_s": base.step_time_s,
                     "predicted_s": pred["step_time_s"], "measured_s": measured.step_time_s,
                     "predicted_exposed_comm_s": pred["exposed_comm_s"],
                     "error": pred["step_time_s"] / measured.step_time_s - 1})
    return pd.DataFrame(rows, columns=["strategy", "micro_batch", "world_size", "measured_1_rank_s", "predicted_s",
                                       "measured_s", "predicted_exposed_comm_s", "error"])


def report_section(results_dir: str | os.PathLike, link_fit: dict[str, Any] | None) -> str:
    """report.html's "checked on this machine" section: the answer's N-rank points PREDICTED from its 1-rank runs
    with `link_fit` (`answer_links`; None: the answer has no ranks way) beside what they measured, or why there is
    no such check."""
    import html

    head = (CHECK_HEAD + "<p>Each multi-rank point of the ranks way <b>predicted</b> from the 1-rank run of the "
            "same strategy and micro-batch (<code>labkit predict --from RUN_DIR --world-size N</code>: its measured "
            "compute, DeepSpeed's collectives timed with the link as training meets it, measured here after 2 ms of "
            f"compute, one setting to keep the answer short: <code>{ANSWER_LINKS}</code>), beside what it measured; "
            "every run summarised by its mean step (docs/predict.md).</p>")
    table = answer_check(results_dir, link_fit) if link_fit is not None else None
    if table is None or table.empty:
        why = ("this answer has no ranks way to check" if link_fit is None else
               "the runs of its ranks way are not in this results dir")
        return head + f"<p>No check: {html.escape(why)}.</p></section>"
    lines = ["<table><tr><th>strategy</th><th>micro-batch</th><th>ranks</th><th>1 rank, measured (ms)</th>"
             "<th>predicted (ms)</th><th>measured (ms)</th><th>error</th></tr>"]
    for _, r in table.iterrows():
        lines.append(f"<tr><td>{html.escape(str(r['strategy']))}</td><td>{r['micro_batch']}</td>"
                     f"<td>{r['world_size']}</td><td>{r['measured_1_rank_s'] * 1e3:.2f}</td>"
                     f"<td>predicted {r['predicted_s'] * 1e3:.2f}</td><td>{r['measured_s'] * 1e3:.2f}</td>"
                     f"<td>{r['error']:+.0%}</td></tr>")
    errors = table["error"].abs()
    lines.append(f"</table><p>Median |error| {errors.median():.0%}, max {errors.max():.0%} over {len(table)} "
                 "point(s). <code>benchmarks/bench_predict.py</code> checks every strategy at three micro-batches "
                 "(data/predict-ci/).</p></section>")
    return head + "\n".join(lines)

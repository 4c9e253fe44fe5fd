"""One rank of a lab run. DeepSpeed's launcher starts one of these per GPU (or CPU rank).

labkit builds the launch for you (`labkit.launch.launcher.build_command`; a run's exact command, environment
included, is its `command.txt`); on one node it is, by hand:

    python -m deepspeed.launcher.runner --num_gpus 2 --master_addr 127.0.0.1 --hostfile /dev/null \
        --master_port 29517 --module labkit.rank.guard --run-dir runs/my-run

DeepSpeed's launcher starts `labkit.rank.guard` per rank, which starts this module as
`python -u -m labkit.rank.worker --local_rank=0 --run-dir runs/my-run` and records its exit code. A warm launch
(the default for single-node CPU runs) forks the ranks from a zygote instead and calls `main` with the same
arguments, under that command line as its title (labkit.launch.warm_launch). The run
directory holds `config.json` (a `RunConfig`); this rank appends one JSON record per optimizer step to
`rank<N>.jsonl` and ends with `done`. Example 1 (`pytorch`) trains with a plain PyTorch loop; examples 2 and 3
(`offload`, `zero3`) wrap the same model with `deepspeed.initialize`.

`train` reads top to bottom: data, model and trainer, then the loop. What the loop calls is a unit of its own:
one step (labkit.rank.step_loop), the census and the emulated capacity (labkit.rank.census.RankMemory), the
held-out evaluation (labkit.rank.evaluation), the stop at target (labkit.rank.target), the noise-scale probe
(labkit.rank.noise_probe.NoiseProbe) and the done record with its timing (labkit.rank.done).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch

from labkit.core.config import RunConfig
from labkit.core.failures import is_oom
from labkit.models import builders
from labkit.models.builders import build_dataset, build_model, loss_function, monitor_paths
from labkit.models.data import make_sampler
from labkit.models.mlp import count_parameters
from labkit.rank.batches import device_batches
from labkit.rank.census import RankMemory
from labkit.rank.comms_log import BETWEEN_STEPS, SETUP, CommsLog
from labkit.rank.done import TIMED_FROM_STEP, TimedSteps, done_fields, peak_flops
from labkit.rank.evaluation import Evaluation, hold_out
from labkit.rank.faults import FaultHooks
from labkit.rank.noise_probe import NoiseProbe
from labkit.rank.rendezvous import init_distributed
from labkit.rank.step_clock import StepClock
from labkit.rank.step_loop import train_step
from labkit.rank.target import TargetStop
from labkit.rank.telemetry import RankTelemetry
from labkit.rank.trainers import DeepSpeedTrainer, PlainTrainer
from labkit.runtime.devices import rank_device_name


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--local_rank", type=int, default=0)  # passed by DeepSpeed's launcher
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """One rank, from its argv (`sys.argv[1:]` when None): in a process of its own (`python -m labkit.rank.worker`)
    or called in-process (a forked process running guard -> worker without exec)."""
    args = parse_args(argv)
    config = RunConfig.load(args.run_dir / "config.json")
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    telemetry = RankTelemetry(args.run_dir, rank, per_step=config.telemetry)
    telemetry.start(local_rank=args.local_rank, world_size=world_size)
    faults = FaultHooks(rank)
    # DeepSpeed's comms logger, per section of the run (config.comms_log; a no-op otherwise).
    comms = CommsLog(args.run_dir, rank, enabled=config.comms_log, steady_from=TIMED_FROM_STEP)
    try:
        train(config, run_dir=args.run_dir, local_rank=args.local_rank, rank=rank, world_size=world_size,
              telemetry=telemetry, faults=faults, comms=comms)
    except BaseException as exc:
        # Recorded before the traceback is printed, so the supervisor can name this rank.
        message = str(exc) or type(exc).__name__
        telemetry.event("error", error_type=type(exc).__name__, message=message[:2000],
                        oom=is_oom(type(exc).__name__, message),
                        traceback=traceback.format_exc()[-4000:])
        try:
            comms.write(world_size=world_size, grad_accum=config.grad_accum, failed=True)  # what it had, kept
        except Exception:
            pass  # the error above is the one to report
        telemetry.close()
        raise
    telemetry.close()
    return 0


def train(config: RunConfig, *, run_dir: Path, local_rank: int, rank: int, world_size: int,
          telemetry: RankTelemetry, faults: FaultHooks, comms: CommsLog) -> None:
    """Train one rank of `config`'s run, recording into `run_dir` through `telemetry`."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    faults.at_start()
    accelerator = get_accelerator()
    # The device first: NCCL binds a communicator to the current device when the group is made.
    accelerator.set_device(local_rank)
    # On loopback only for single-node runs, with our own timeout (labkit.rank.rendezvous).
    init_distributed(accelerator.communication_backend_name(), timedelta(seconds=config.startup_timeout_s))
    torch.manual_seed(config.seed)  # every rank builds identical initial weights

    # -- data: RunConfig.data's (inputs, labels) items, held-out ones apart; each rank reads its own shard ---------
    dataset, held_out = hold_out(config, build_dataset(config))
    # distributed_sampler=False keeps the seed text's bug switchable to measure it (every rank reads the whole
    # dataset: an epoch never shrinks).
    sampler, samples_per_epoch = make_sampler(dataset, distributed_sampler=config.distributed_sampler,
                                              world_size=world_size, rank=rank, seed=config.seed,
                                              with_replacement=config.sample_with_replacement)

    # -- model and trainer -------------------------------------------------------------------------------------
    # MFU's numerator: ~6 x params per sample is the MLP's; any other model is measured by DeepSpeed's
    # profiler, before deepspeed.initialize (the profiler patches torch functions that ZeRO-3 also wraps).
    flops = ({"train_flops_per_sample": builders.train_flops_per_sample(config, dataset)}
             if rank == 0 and config.model != "mlp" else {})
    model = build_model(config)  # RunConfig.model: built-in or the learner's import string
    loss_fn = loss_function(config)
    n_params = count_parameters(model)
    optimizer_impl = choose_optimizer_impl(config, accelerator)
    trainer = make_trainer(config, model, loss_fn, optimizer_impl, accelerator=accelerator, local_rank=local_rank,
                           run_dir=run_dir)
    telemetry.begin_step()  # the ready record's device peak: not deepspeed.initialize's transients
    # the device's name: what `labkit predict --from` finds a GPU run's kind by (labkit.study.calibrate)
    telemetry.event("ready", n_params=n_params, accelerator=accelerator._name, optimizer_impl=optimizer_impl, **flops,
                    backend=accelerator.communication_backend_name(),
                    device_name=rank_device_name(accelerator._name, local_rank), **telemetry.memory())
    comms.close(SETUP)

    # -- the loop: no host-device synchronisation per step (labkit.rank.step_clock) ------------------------------
    clock = StepClock(accelerator)
    # Micro-batches gathered, pinned and copied non_blocking, each step's made before its clock starts.
    batches = device_batches(dataset, sampler, config.micro_batch, trainer.device, accelerator)
    evaluate = Evaluation(config, held_out, trainer.device, world_size=world_size,
                          all_reduce=deepspeed.comm.all_reduce)
    stop_at_target = TargetStop(config, world_size=world_size, all_reduce=deepspeed.comm.all_reduce)
    probe_noise = NoiseProbe(config, dataset, rank=rank, make_model=partial(build_model, config), loss_fn=loss_fn)
    memory = RankMemory(budget_bytes=config.device_memory_budget_bytes, rank=rank)
    timed = TimedSteps()
    # telemetry=False is the benchmark's baseline: the same loop, unobserved.
    count_on = config.telemetry or config.device_memory_budget_bytes is not None
    for step in range(1, config.steps + 1):
        faults.at_step(step)
        timed.begin(step)
        measure = count_on and (step <= 2 or step % config.census_every == 0)
        noise = probe_noise(step, trainer)  # before the step's clock: never step time
        t_begin = time.perf_counter()
        if config.telemetry:
            telemetry.begin_step()  # device_peak_bytes in this step's record: this step's own peak
        begin_s = time.perf_counter() - t_begin
        comms.close(BETWEEN_STEPS)  # the previous step's eval and stop-at-target agreement
        census, activation_bytes, census_s = train_step(
            trainer, batches, clock, step=step, grad_accum=config.grad_accum, measure=measure, on_census=memory.check)
        if measure:
            memory.update(census, activation_bytes)
        t_record = time.perf_counter()
        step_loss = clock.end(
            step=step,
            lr=trainer.lr,
            epoch=step * config.micro_batch * config.grad_accum / samples_per_epoch,
            activation_bytes=memory.activation_bytes,
            **noise,
            **memory.census,
            **(telemetry.memory() if config.telemetry else {}),
        )
        comms.close_step(step)  # after the step's clock: the logger's bookkeeping is not the step's
        evaluated = evaluate(step, trainer)  # after the step's clock: evaluation is never step time
        if evaluated:
            clock.annotate(**evaluated)  # into this step's record, still pending
        write_step_records(clock, telemetry, trainer, config.global_batch)
        eval_s = evaluated.get("eval_s", 0.0)
        record_s = time.perf_counter() - t_record - eval_s  # the eval is counted apart
        # Everything labkit adds to a step: census and saved-tensor hooks, memory readings, the record.
        timed.end(step, telemetry_s=begin_s + record_s + census_s, eval_s=eval_s)
        if stop_at_target(step_loss, evaluated):
            break
    accelerator.synchronize()  # once, after the loop: timed_s covers the device's queued work
    write_step_records(clock, telemetry, trainer, config.global_batch, wait=True)

    # -- the done record -------------------------------------------------------------------------------------
    # timed_s and the telemetry thread's CPU time end here: rank 0's peak measurement below is not the run's.
    timing, thread_cpu_s, fsyncs = timed.fields(), telemetry.thread_cpu_s(), telemetry.fsyncs
    peak = (peak_flops(rank_device_name(accelerator._name, local_rank), config.precision, str(trainer.device))
            if rank == 0 else {})
    comms.write(world_size=world_size, grad_accum=config.grad_accum, steps=step)
    telemetry.event("done", **done_fields(
        steps=step, stopped_at_target=stop_at_target.reached, n_params=n_params, optimizer_impl=optimizer_impl,
        census=memory.census, peak=peak, timed=timing, telemetry_thread_cpu_s=thread_cpu_s, fsyncs=fsyncs,
        memory=telemetry.memory()))
    # Leave the process group now: ranks that skip this linger in teardown.
    deepspeed.comm.destroy_process_group()


def choose_optimizer_impl(config: RunConfig, accelerator: Any) -> str:
    """Without an nvcc matching torch's CUDA, DeepSpeed cannot build FusedAdam: torch's Adam instead. CPU Adam
    (offload) needs only a C++ compiler (labkit.runtime.ops)."""
    from labkit.runtime import ops

    return ops.choose_optimizer_impl(
        example=config.example, optimizer=config.optimizer, offload=bool(config.offload_optimizer),
        accelerator=accelerator._name, cuda_ops=accelerator._name == "cuda" and ops.cuda_ops_buildable()[0],
        cpu_ops=ops.host_compiler() is not None)


def make_trainer(config: RunConfig, model: torch.nn.Module, loss_fn: Any, optimizer_impl: str, *, accelerator: Any,
                 local_rank: int, run_dir: Path) -> PlainTrainer | DeepSpeedTrainer:
    """Example 1 (`pytorch`): a plain PyTorch loop on the rank's device; the others: `deepspeed.initialize` with
    the run's DeepSpeed config, its monitors writing into `run_dir`."""
    from labkit.runtime import ops

    if config.example == "pytorch":
        return PlainTrainer(model, config, torch.device(accelerator.device_name(local_rank)), loss_fn)
    return DeepSpeedTrainer(model, config, ops.with_optimizer_impl(
        monitor_paths(config.ds_config(), run_dir), optimizer_impl), loss_fn)


def write_step_records(clock: StepClock, telemetry: RankTelemetry, trainer: PlainTrainer | DeepSpeedTrainer,
                       global_batch: int, *, wait: bool = False) -> None:
    """The records of the steps whose figures are ready (all of them with wait=True, after the loop)."""
    for record in clock.ready(wait=wait):
        # All ranks step in lockstep, each on micro_batch x grad_accum samples.
        samples_per_s = global_batch / record["step_time_s"]
        telemetry.step(**record, samples_per_s=samples_per_s)
        if isinstance(trainer, DeepSpeedTrainer):  # DeepSpeed's monitors, when ds_overrides enable one
            trainer.write_monitor(record["step"], {**record, "samples_per_s": samples_per_s})


if __name__ == "__main__":
    sys.exit(main())

"""One rank of a lab run. DeepSpeed's launcher starts one of these per GPU (or CPU rank).

labkit builds the launch for you (`labkit.launch.launcher.build_command`; a run's exact command, environment
included, is its `command.txt`); on one node it is, by hand:

    python -m deepspeed.launcher.runner --num_gpus 2 --master_addr 127.0.0.1 --hostfile /dev/null \
        --master_port 29517 --module labkit.rank.guard --run-dir runs/my-run

`labkit.rank.guard` starts this module as `python -m labkit.rank.worker --run-dir runs/my-run`
and records its exit code. The run directory holds `config.json` (a `RunConfig`); this
rank appends one JSON record per optimizer step to `rank<N>.jsonl` and ends with `done`.
Example 1 (`pytorch`) trains with a plain PyTorch loop; examples 2 and 3 (`offload`,
`zero3`) wrap the same model with `deepspeed.initialize`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
from torch.utils.data import Subset, default_collate

from labkit.core.config import RunConfig
from labkit.core.failures import is_oom
from labkit.core.schema import device_bytes
from labkit.models import builders
from labkit.models.builders import build_dataset, build_model, loss_function, monitor_paths
from labkit.models.data import make_sampler
from labkit.models.mlp import count_parameters
from labkit.rank.batches import device_batches
from labkit.rank.comms_log import BETWEEN_STEPS, SETUP, CommsLog
from labkit.rank.faults import FaultHooks
from labkit.rank.rendezvous import init_distributed
from labkit.rank.step_clock import StepClock
from labkit.rank.step_loop import train_step
from labkit.rank.telemetry import RankTelemetry
from labkit.rank.trainers import DeepSpeedTrainer, PlainTrainer

EVAL_CHUNK = 1024  # eval forward passes take this many samples at a time (at least a micro-batch)
EVAL_DENSE_MARGIN = 0.1  # evaluate every step once the eval loss is within 10% of the target...
EVAL_LOOKAHEAD = 2.0     # ...or could reach it, falling at twice its recent rate, before the next scheduled eval
TIMED_FROM_STEP = 3  # steps 1-2 pay for lazy allocations; `timed_s` in the done record starts after them

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

    # -- data: each rank must read its own shard --------------------------------------
    dataset = build_dataset(config)  # RunConfig.data (labkit.models.builders): (inputs, labels) items
    held_out = None
    if config.eval_every and not builtin_mlp_data(config):
        # A model's own dataset: its last eval_samples items are held out, never trained on.
        _require_eval_room(config, len(dataset))
        held_out = Subset(dataset, range(len(dataset) - config.eval_samples, len(dataset)))
        dataset = Subset(dataset, range(len(dataset) - config.eval_samples))
    # Each rank must read its own shard; distributed_sampler=False keeps the seed text's bug
    # switchable to measure it (every rank reads the whole dataset: an epoch never shrinks).
    sampler, samples_per_epoch = make_sampler(dataset, distributed_sampler=config.distributed_sampler,
                                              world_size=world_size, rank=rank, seed=config.seed,
                                              with_replacement=config.sample_with_replacement)

    # -- model and trainer -------------------------------------------------------------
    # MFU's numerator: ~6 x params per sample is the MLP's; any other model is measured by DeepSpeed's
    # profiler, before deepspeed.initialize (the profiler patches torch functions that ZeRO-3 also wraps).
    flops = ({"train_flops_per_sample": builders.train_flops_per_sample(config, dataset)}
             if rank == 0 and config.model != "mlp" else {})
    model = build_model(config)  # RunConfig.model: built-in or the learner's import string
    loss_fn = loss_function(config)
    n_params = count_parameters(model)
    from labkit.runtime import ops

    # Without an nvcc matching torch's CUDA, DeepSpeed cannot build FusedAdam: torch's Adam instead. CPU Adam
    # (offload) needs only a C++ compiler (labkit.runtime.ops).
    optimizer_impl = ops.choose_optimizer_impl(
        example=config.example, optimizer=config.optimizer, offload=bool(config.offload_optimizer),
        accelerator=accelerator._name, cuda_ops=accelerator._name == "cuda" and ops.cuda_ops_buildable()[0],
        cpu_ops=ops.host_compiler() is not None)
    trainer: PlainTrainer | DeepSpeedTrainer
    if config.example == "pytorch":
        trainer = PlainTrainer(model, config, torch.device(accelerator.device_name(local_rank)), loss_fn)
    else:
        trainer = DeepSpeedTrainer(model, config, ops.with_optimizer_impl(
            monitor_paths(config.ds_config(), run_dir), optimizer_impl), loss_fn)

    telemetry.begin_step()  # the ready record's device peak: not deepspeed.initialize's transients
    telemetry.event("ready", n_params=n_params, accelerator=accelerator._name, optimizer_impl=optimizer_impl, **flops,
                    backend=accelerator.communication_backend_name(), **telemetry.memory())
    comms.close(SETUP)

    # -- the loop ----------------------------------------------------------------------
    # telemetry=False is the benchmark's baseline: the same loop, unobserved.
    instrument = config.telemetry
    count_on = instrument or config.device_memory_budget_bytes is not None
    # No host-device synchronisation per step: phases are timed with device events (perf_counter on
    # CPU) and each step's record is written once its figures are ready, usually a step later.
    clock = StepClock(accelerator)
    # Micro-batches gathered, pinned and copied non_blocking, each step's made before its clock starts.
    data = device_batches(dataset, sampler, config.micro_batch, trainer.device, accelerator)
    timed_start, timed_steps = 0.0, 0
    census: dict[str, int] = {}
    telemetry_s = 0.0  # timed steps' census, memory readings and records: the instrumentation's own cost
    activation_bytes = 0
    samples_seen = 0
    # Gradient noise scale (labkit.study.noise_scale): every N steps, before the timed step, each
    # rank takes gradients on a fresh sample of micro_batch examples, on an fp32 copy.
    if config.noise_scale_every:
        from labkit.rank.noise_probe import gradient_noise_probe

        probe_rng = torch.Generator().manual_seed(config.seed * 1_000_003 + 7919 + rank)

        def make_model() -> torch.nn.Module:
            return build_model(config)

    def write_ready(wait: bool = False) -> None:
        for record in clock.ready(wait=wait):
            # All ranks step in lockstep, each on micro_batch x grad_accum samples.
            samples_per_s = config.global_batch / record["step_time_s"]
            telemetry.step(**record, samples_per_s=samples_per_s)
            if hasattr(trainer, "write_monitor"):  # DeepSpeed's monitors, when ds_overrides enable one
                trainer.write_monitor(record["step"], {**record, "samples_per_s": samples_per_s})

    # stop_at_target: ranks must stop at the same step, so they agree on the global mean loss
    # (one all_reduce per step, only when asked) over labkit.launch.summary.time_to_target's window.
    # RunConfig checked that stop_at_target comes with a target_loss.
    stop_below = config.target_loss if config.stop_at_target else None
    target_window, stopped_at_target = 5, False
    recent_losses: list[float] = []
    # Held-out eval loss (eval_every > 0): a fixed eval set, every N steps and every step once the
    # loss is near the target, so the first step that meets it is found without a window's lag.
    # It runs outside the step's clock (eval_s is recorded on its own), on every rank.
    eval_timed_s = 0.0
    eval_history: list[tuple[int, float]] = []  # (step, loss) of the last two evals
    if held_out is not None:
        eval_inputs, eval_labels = default_collate([held_out[i] for i in range(len(held_out))])
    elif config.eval_every:
        from labkit.models.data import make_eval_set

        eval_inputs, eval_labels = make_eval_set(config.eval_samples, config.dataset_size, config.input_size,
                                                 config.output_size, config.seed).tensors
    if config.eval_every:  # on the device once: the trainers' forward takes device tensors
        eval_inputs, eval_labels = eval_inputs.to(trainer.device), eval_labels.to(trainer.device)
    for step in range(1, config.steps + 1):
        faults.at_step(step)
        if step == TIMED_FROM_STEP:
            timed_start = time.perf_counter()
        measure = count_on and (step <= 2 or step % config.census_every == 0)
        noise: dict[str, float] = {}
        if config.noise_scale_every and step % config.noise_scale_every == 0:
            picks = torch.randint(len(dataset), (config.micro_batch,), generator=probe_rng)
            probe_inputs, probe_labels = default_collate([dataset[int(i)] for i in picks])
            noise = gradient_noise_probe(make_model, list(trainer.parameters()), probe_inputs, probe_labels,
                                         device=trainer.device, loss_fn=loss_fn)
        t_begin = time.perf_counter()
        if instrument:
            telemetry.begin_step()  # device_peak_bytes in this step's record: this step's own peak
        begin_s = time.perf_counter() - t_begin

        def on_census(states: dict[str, int], saved: int, before: int = activation_bytes) -> None:
            # the activation peak so far, or this step's
            _check_emulated_capacity(config, rank, states, max(before, saved))

        comms.close(BETWEEN_STEPS)  # the previous step's eval and stop-at-target agreement
        step_census, step_activation_bytes, census_s = train_step(
            trainer, data, clock, step=step, grad_accum=config.grad_accum, measure=measure, on_census=on_census)
        if measure:
            census, activation_bytes = step_census, max(activation_bytes, step_activation_bytes)
        samples_seen += config.micro_batch * config.grad_accum
        timed_steps += step >= TIMED_FROM_STEP
        t_record = time.perf_counter()
        step_loss = clock.end(
            step=step,
            lr=trainer.lr,
            epoch=samples_seen / samples_per_epoch,
            activation_bytes=activation_bytes,
            **noise,
            **census,
            **(telemetry.memory() if instrument else {}),
        )
        comms.close_step(step)  # after the step's clock: the logger's bookkeeping is not the step's
        # After the step's clock has stopped: evaluation is never part of the step time.
        evaluated: dict[str, float] = {}
        if config.eval_every and _eval_due(config, step, eval_history):
            t_eval = time.perf_counter()
            eval_loss = trainer.evaluate(eval_inputs, eval_labels, chunk=max(config.micro_batch, EVAL_CHUNK))
            if world_size > 1:  # identical weights give identical losses; the mean keeps ranks in lockstep
                agreed = torch.tensor([eval_loss], dtype=torch.float64, device=trainer.device)
                deepspeed.comm.all_reduce(agreed)
                eval_loss = agreed.item() / world_size
            eval_s = time.perf_counter() - t_eval
            eval_timed_s += eval_s * (step >= TIMED_FROM_STEP)
            evaluated = {"eval_loss": eval_loss, "eval_s": eval_s}
            eval_history = [*eval_history[-1:], (step, eval_loss)]
        if evaluated:
            clock.annotate(**evaluated)  # into this step's record, still pending
        write_ready()
        record_s = time.perf_counter() - t_record - evaluated.get("eval_s", 0.0)  # the eval is counted apart
        # Everything labkit adds to a step: census and saved-tensor hooks, memory readings, the record.
        telemetry_s += (begin_s + record_s + census_s) * (step >= TIMED_FROM_STEP)
        if stop_below is not None and config.eval_every:
            if evaluated and evaluated["eval_loss"] <= stop_below:
                stopped_at_target = True
                break
        elif stop_below is not None:
            agreed = step_loss.to(torch.float64).reshape(1)
            deepspeed.comm.all_reduce(agreed)
            recent_losses = [*recent_losses, agreed.item() / world_size][-target_window:]
            if sum(recent_losses) / len(recent_losses) <= stop_below:
                stopped_at_target = True
                break
    accelerator.synchronize()  # once, after the loop: timed_s covers the device's queued work
    write_ready(wait=True)
    timed = ({"timed_steps": timed_steps, "timed_s": time.perf_counter() - timed_start - eval_timed_s,
              "telemetry_s": telemetry_s, "eval_s": eval_timed_s}
             if timed_steps else {})
    # Outside the loop's own timing: the fsync thread's CPU time (bench_observer_cpu.py reports it).
    timed.update(telemetry_thread_cpu_s=round(telemetry.thread_cpu_s(), 6), fsyncs=telemetry.fsyncs)
    peak: dict[str, object] = {}
    if rank == 0:
        # Achieved FLOP/s means little without the device's peak next to it.
        from labkit.runtime.devices import datasheet_peak_flops, measured_matmul_flops, rank_device_name

        datasheet = datasheet_peak_flops(rank_device_name(accelerator._name, local_rank), config.precision)
        if datasheet:
            peak = {"peak_flops": datasheet, "peak_flops_source": "datasheet"}
        else:
            measured, how = measured_matmul_flops(str(trainer.device), config.precision)
            peak = {"peak_flops": measured, "peak_flops_source": how}
    comms.write(world_size=world_size, grad_accum=config.grad_accum, steps=step)
    telemetry.event("done", steps=step, stopped_at_target=stopped_at_target, n_params=n_params,
                    optimizer_impl=optimizer_impl, **census,
                    **peak, **timed, **telemetry.memory())
    # Leave the process group now: ranks that skip this linger in teardown.
    deepspeed.comm.destroy_process_group()


def builtin_mlp_data(config: RunConfig) -> bool:
    """The lab's MLP on its generated data: its held-out set is generated apart (labkit.models.data.make_eval_set)."""
    return config.model == "mlp" and config.data is None


def _require_eval_room(config: RunConfig, dataset_size: int) -> None:
    if config.eval_samples >= dataset_size // 2:
        raise ValueError(f"eval_samples ({config.eval_samples}) would hold out half or more of the model's "
                         f"{dataset_size}-item dataset; lower eval_samples or set eval_every=0")


def _eval_due(config: RunConfig, step: int, history: list[tuple[int, float]]) -> bool:
    """Every eval_every steps, the last step, and every step once the target is near: the eval
    loss within EVAL_DENSE_MARGIN of it, or able to reach it before the next scheduled eval at
    EVAL_LOOKAHEAD times its recent rate of fall. The first step that meets it is then found to the
    step (unless the loss suddenly falls faster), at big batches (few steps, a fast fall) as at small
    ones. Every rank decides from the same values, so the ranks evaluate and stop together."""
    if step % config.eval_every == 0 or step == config.steps:
        return True
    if config.target_loss is None or not history:
        return False
    last_step, last = history[-1]
    if last <= config.target_loss * (1 + EVAL_DENSE_MARGIN):
        return True
    if len(history) < 2:
        return False
    first_step, first = history[0]
    fall_per_step = max(0.0, (first - last) / (last_step - first_step))
    return last - EVAL_LOOKAHEAD * fall_per_step * config.eval_every <= config.target_loss


def _check_emulated_capacity(config: RunConfig, rank: int, census: dict[str, int], activation_bytes: int) -> None:
    """On CPU, an explicit per-rank budget stands in for a GPU's memory size: the model states a
    GPU would hold (optimizer states and grad partitions that offload keeps on the host left
    out) plus saved activations. Communication buffers (buffer_bytes) and params gathered
    transiently by ZeRO-3 are not counted."""
    budget = config.device_memory_budget_bytes
    if budget is None:
        return
    on_device = int(device_bytes(census, activation_bytes))
    if on_device > budget:
        raise torch.OutOfMemoryError(
            f"emulated device capacity exceeded: rank {rank} needs {on_device} bytes "
            f"(model states + {activation_bytes} activation bytes) but the budget is {budget} bytes")



if __name__ == "__main__":
    sys.exit(main())

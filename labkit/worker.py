"""One rank of a lab run. DeepSpeed's launcher starts one of these per GPU (or CPU rank).

labkit builds the launch for you (see `labkit.launcher.build_command`); by hand it is:

    python -m deepspeed.launcher.runner --num_gpus 2 --master_addr 127.0.0.1 \
        --master_port 29517 --module labkit.rank_guard --run-dir runs/my-run

`labkit.rank_guard` starts this module as `python -m labkit.worker --run-dir runs/my-run`
and records its exit code. The run directory holds `config.json` (a `RunConfig`); this
rank appends one JSON record per optimizer step to `rank<N>.jsonl` and ends with `done`.
Example 1 (`pytorch`) trains with a plain PyTorch loop; examples 2 and 3 (`offload`,
`zero3`) wrap the same model with `deepspeed.initialize`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, default_collate

from labkit.config import RunConfig
from labkit.failures import is_oom
from labkit.faults import FaultHooks
from labkit import builders
from labkit.builders import build_dataset, build_model, loss_function, monitor_paths
from labkit.model import count_parameters
from labkit.rendezvous import init_distributed
from labkit.telemetry import RankTelemetry
from labkit.trainers import DeepSpeedTrainer, PlainTrainer, count_saved_activations

TIMED_FROM_STEP = 3  # steps 1-2 pay for lazy allocations; `timed_s` in the done record starts after them

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--run-dir", required=True, type=Path)
parser.add_argument("--local_rank", type=int, default=0)  # passed by DeepSpeed's launcher
args = parser.parse_args()

config = RunConfig.load(args.run_dir / "config.json")
rank = int(os.environ.get("RANK", "0"))
world_size = int(os.environ.get("WORLD_SIZE", "1"))
telemetry = RankTelemetry(args.run_dir, rank, per_step=config.telemetry)
telemetry.start(local_rank=args.local_rank, world_size=world_size)
faults = FaultHooks(rank)


def train() -> None:
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    faults.at_start()
    accelerator = get_accelerator()
    # The device first: NCCL binds a communicator to the current device when the group is made.
    accelerator.set_device(args.local_rank)
    # On loopback only for single-node runs, with our own timeout (labkit.rendezvous).
    init_distributed(accelerator.communication_backend_name(), timedelta(seconds=config.startup_timeout_s))
    torch.manual_seed(config.seed)  # every rank builds identical initial weights

    # -- data: each rank must read its own shard --------------------------------------
    dataset = build_dataset(config)  # RunConfig.data (labkit.builders): (inputs, labels) items
    if config.distributed_sampler:
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                     seed=config.seed, drop_last=True)
        samples_per_epoch = len(sampler)  # this rank's share: the epoch shrinks with more ranks
    else:
        # The seed text's bug, kept switchable to measure it: every rank shuffles and
        # reads the whole dataset, so an epoch takes as long on 8 ranks as on 1.
        sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(config.seed + rank))
        samples_per_epoch = len(dataset)
    loader = DataLoader(dataset, batch_size=config.micro_batch, sampler=sampler, drop_last=True)

    def batches():
        epoch = 0
        while True:
            if isinstance(sampler, DistributedSampler):
                sampler.set_epoch(epoch)
            yield from loader
            epoch += 1

    # -- model and trainer -------------------------------------------------------------
    # MFU's numerator: ~6 x params per sample is the MLP's; any other model is measured by DeepSpeed's
    # profiler, before deepspeed.initialize (the profiler patches torch functions that ZeRO-3 also wraps).
    flops = ({"train_flops_per_sample": builders.train_flops_per_sample(config, dataset)}
             if rank == 0 and config.model != "mlp" else {})
    model = build_model(config)  # RunConfig.model: built-in or the learner's import string
    loss_fn = loss_function(config)
    n_params = count_parameters(model)
    if config.example == "pytorch":
        trainer = PlainTrainer(model, config, torch.device(accelerator.device_name(args.local_rank)), loss_fn)
    else:
        trainer = DeepSpeedTrainer(model, config, monitor_paths(config.ds_config(), args.run_dir), loss_fn)

    telemetry.event("ready", n_params=n_params, accelerator=accelerator._name, **flops,
                    backend=accelerator.communication_backend_name(), **telemetry.memory())

    # -- the loop ----------------------------------------------------------------------
    # telemetry=False is the benchmark's baseline: the same loop, unobserved.
    instrument = config.telemetry
    count_on = instrument or config.device_memory_budget_bytes is not None
    sync = accelerator.synchronize if instrument else (lambda: None)  # phase times need a drained queue
    data = batches()
    timed_start = timed_steps = 0
    census: dict[str, int] = {}
    telemetry_s = 0.0  # timed steps' census, memory readings and records: the instrumentation's own cost
    activation_bytes = 0
    samples_seen = 0
    # Gradient noise scale (labkit.noise_scale): every N steps, before the timed step, each
    # rank takes gradients on a fresh sample of micro_batch examples, on an fp32 copy.
    if config.noise_scale_every:
        from labkit.noise_scale import gradient_noise_probe

        probe_rng = torch.Generator().manual_seed(config.seed * 1_000_003 + 7919 + rank)

        def make_model() -> torch.nn.Module:
            return build_model(config)
    # stop_at_target: ranks must stop at the same step, so they agree on the global mean loss
    # (one all_reduce per step, only when asked) over labkit.summary.time_to_target's window.
    target_window, recent_losses, stopped_at_target = 5, [], False
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
        if instrument:
            telemetry.begin_step()  # device_peak_bytes in this step's record: this step's own peak
        step_start = time.perf_counter()
        forward_s = backward_s = 0.0
        losses = []
        for micro in range(config.grad_accum):
            inputs, labels = next(data)
            boundary = micro == config.grad_accum - 1
            t0 = time.perf_counter()
            with count_saved_activations() if measure else contextlib.nullcontext([0]) as saved:
                loss = trainer.forward(inputs, labels)
            sync()
            t1 = time.perf_counter()
            trainer.backward(loss)
            sync()
            t2 = time.perf_counter()
            forward_s += t1 - t0
            backward_s += t2 - t1
            losses.append(loss.item())
            activation_bytes = max(activation_bytes, saved[0])
            if boundary and measure:
                t_census = time.perf_counter()
                census = trainer.census()  # at the peak: gradients held, before the step
                telemetry_s += (time.perf_counter() - t_census) * (step >= TIMED_FROM_STEP)
                _check_emulated_capacity(census, activation_bytes)
            t3 = time.perf_counter()
            trainer.step(step, boundary)
            sync()
            optimizer_s = time.perf_counter() - t3
        step_time_s = time.perf_counter() - step_start
        samples_seen += config.micro_batch * config.grad_accum
        timed_steps += step >= TIMED_FROM_STEP
        t_record = time.perf_counter()
        telemetry.step(
            step=step,
            loss=sum(losses) / len(losses),
            lr=trainer.lr,
            step_time_s=step_time_s,
            forward_s=forward_s,
            backward_s=backward_s,
            optimizer_s=optimizer_s,
            # All ranks step in lockstep, each on micro_batch x grad_accum samples.
            samples_per_s=config.global_batch / step_time_s,
            epoch=samples_seen / samples_per_epoch,
            activation_bytes=activation_bytes,
            **noise,
            **census,
            **(telemetry.memory() if instrument else {}),
        )
        telemetry_s += (time.perf_counter() - t_record) * (step >= TIMED_FROM_STEP)
        if hasattr(trainer, "write_monitor"):  # DeepSpeed's monitors, when ds_overrides enable one
            trainer.write_monitor(step, {"loss": sum(losses) / len(losses), "lr": trainer.lr,
                                         "step_time_s": step_time_s, "samples_per_s": config.global_batch / step_time_s,
                                         **census})
        if config.stop_at_target:
            agreed = torch.tensor([sum(losses) / len(losses)], dtype=torch.float64, device=trainer.device)
            deepspeed.comm.all_reduce(agreed)
            recent_losses = (recent_losses + [agreed.item() / world_size])[-target_window:]
            if sum(recent_losses) / len(recent_losses) <= config.target_loss:
                stopped_at_target = True
                break
    timed = ({"timed_steps": timed_steps, "timed_s": time.perf_counter() - timed_start, "telemetry_s": telemetry_s}
             if timed_steps else {})
    peak: dict[str, object] = {}
    if rank == 0:
        # Achieved FLOP/s means little without the device's peak next to it.
        from labkit.devices import detect_devices, measured_matmul_flops

        datasheet = detect_devices().peak_flops(config.precision)
        peak = ({"peak_flops": datasheet, "peak_flops_source": "datasheet"} if datasheet else
                {"peak_flops": measured_matmul_flops(str(trainer.device), config.precision),
                 "peak_flops_source": "measured 1024x1024 matmul"})
    telemetry.event("done", steps=step, stopped_at_target=stopped_at_target, n_params=n_params, **census,
                    **peak, **timed, **telemetry.memory())
    # Leave the process group now: ranks that skip this linger in teardown.
    deepspeed.comm.destroy_process_group()


def _check_emulated_capacity(census: dict[str, int], activation_bytes: int) -> None:
    """On CPU, an explicit per-rank budget stands in for a GPU's memory size: the model states a
    GPU would hold (optimizer states and grad partitions that offload keeps on the host left
    out) plus saved activations. Communication buffers (buffer_bytes) and params gathered
    transiently by ZeRO-3 are not counted."""
    budget = config.device_memory_budget_bytes
    if budget is None:
        return
    on_device = (census.get("param_bytes", 0) + census.get("grad_bytes", 0) + census.get("optim_bytes", 0)
                 + census.get("master_bytes", 0) - census.get("host_optim_bytes", 0)
                 - census.get("host_grad_bytes", 0) + activation_bytes)
    if on_device > budget:
        raise torch.OutOfMemoryError(
            f"emulated device capacity exceeded: rank {rank} needs {on_device} bytes "
            f"(model states + {activation_bytes} activation bytes) but the budget is {budget} bytes")


try:
    train()
except BaseException as exc:
    # Recorded before the traceback is printed, so the supervisor can name this rank.
    message = str(exc) or type(exc).__name__
    telemetry.event("error", error_type=type(exc).__name__, message=message[:2000],
                    oom=is_oom(type(exc).__name__, message),
                    traceback=traceback.format_exc()[-4000:])
    telemetry.close()
    raise
telemetry.close()
sys.exit(0)

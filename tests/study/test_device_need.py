"""What one rank of a lab run needs on its device (`labkit.study.device_need`): the larger of the micro-step's peak
and the optimizer step's, each from labkit.core.memory's rules, with the run's own ZeRO settings."""

from __future__ import annotations

import dataclasses

import pytest

from labkit.core import memory
from labkit.core.config import RunConfig
from labkit.models.builders import param_numels
from labkit.study import device_need as need

OVERHEAD = need.DEVICE_OVERHEAD_BYTES
RUN = dict(hidden=2048, depth=4, micro_batch=8, world_size=2, precision="bf16")


def _states(run: RunConfig, stage: int) -> int:
    numels = param_numels(run)
    persistent = sum(n for n in numels if n <= 100_000) if stage == 3 else 0
    return memory.model_state_bytes(sum(numels), stage, run.world_size, "bf16", bool(run.offload_optimizer),
                                    persistent_params=persistent, optimizer=run.optimizer)["device_bytes"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_step_holds_the_states_stage_3s_bucket_and_the_larger_of_fused_and_torchs_adam(stage):
    run = RunConfig(example="deepspeed", stage=stage, **RUN)
    numels = param_numels(run)
    fused = memory.optimizer_step_bytes(stage, numels, 2, "bf16")
    torch_adam = memory.optimizer_step_bytes(stage, numels, 2, "bf16", optimizer="torch_adam")
    assert torch_adam > fused  # which runs depends on the GPU machine's nvcc, decided in the ranks
    bucket = memory.reduce_bucket_bytes(stage, "bf16") if stage == 3 else 0  # stages 1-2 free theirs
    assert need.optimizer_step_peak_bytes(run) == _states(run, stage) + bucket + torch_adam + OVERHEAD
    sgd = dataclasses.replace(run, optimizer="sgd")  # torch's SGD: no moments, only DeepSpeed's own copies
    assert _states(run, stage) - _states(sgd, stage) == pytest.approx(8 * sum(numels) / 2, abs=8)
    assert need.optimizer_step_peak_bytes(sgd) == _states(sgd, stage) + bucket + fused + OVERHEAD


def test_stage_0_sgd_in_16_bits_runs_under_the_unfused_wrapper():
    run = RunConfig(example="deepspeed", stage=0, optimizer="sgd", **RUN)
    psi = sum(param_numels(run))
    assert need.optimizer_step_peak_bytes(run) == _states(run, 0) + 4 * psi + OVERHEAD  # FusedAdam's would be 8


def test_settings_deepspeed_allows_at_the_runs_stage_only_are_read_at_that_stage():
    # DeepSpeed refuses compute_grad_norm=false at stage 0, which a stageless read of the settings would be
    run = RunConfig(example="deepspeed", stage=2, ds_overrides={"zero_optimization": {"compute_grad_norm": False}},
                    **RUN)
    assert need.predicted_device_bytes(run) >= need.optimizer_step_peak_bytes(run) > OVERHEAD
    assert need.predicted_device_bytes(run) == max(need.micro_step_bytes(run), need.optimizer_step_peak_bytes(run))


def test_an_offloaded_optimizer_steps_on_the_host():
    run = RunConfig(example="offload", stage=2, offload_optimizer=True, **RUN)
    assert need.optimizer_step_peak_bytes(run) == _states(run, 2) + OVERHEAD


def test_the_runs_own_zero_settings_size_the_bucket_and_the_sub_groups():
    base = RunConfig(example="zero3", stage=3, **RUN)
    small = dataclasses.replace(base, ds_overrides={"zero_optimization": {"sub_group_size": 1_000_000,
                                                                          "reduce_bucket_size": 1000}})
    numels = param_numels(base)
    own = [memory.optimizer_step_bytes(3, numels, 2, "bf16", sub_group_size=size, optimizer="torch_adam")
           for size in (memory.DEFAULT_SUB_GROUP_SIZE, 1_000_000)]
    bucket = [memory.reduce_bucket_bytes(3, "bf16", size) for size in (500_000_000, 1000)]
    assert own[1] < own[0] and bucket[1] < bucket[0]
    assert need.optimizer_step_peak_bytes(base) - need.optimizer_step_peak_bytes(small) == (
        own[0] + bucket[0] - own[1] - bucket[1])
    assert need.micro_step_bytes(base) - need.micro_step_bytes(small) == bucket[0] - bucket[1]


def test_the_emulated_capacity_counts_no_optimizer_step(monkeypatch):
    # the CPU's emulated check counts states and activations only (check_emulated_capacity), so the max-batch start
    # ignores the step there even where it would not fit the budget
    from labkit.study.maxbatch import predicted_start

    run = RunConfig(example="deepspeed", stage=0, precision="bf16", hidden=4096, depth=4, micro_batch=1,
                    world_size=1, dataset_size=1 << 20)
    micro, step = need.micro_step_bytes(run) - OVERHEAD, need.optimizer_step_peak_bytes(run) - OVERHEAD
    assert micro < step
    budget = dataclasses.replace(run, device_memory_budget_bytes=(micro + step) // 2)
    assert predicted_start(budget, 1 << 20) > 1

"""The LR schedule as plain functions (labkit.core.schedule): what RunConfig and so the ranks use,
what notebook 04 draws, and what `labkit export` writes as DeepSpeed's own scheduler."""

from __future__ import annotations

import math
import re

import pytest

from labkit import RunConfig
from labkit.core import schedule
from labkit.launch.export import export_ds_config


@pytest.mark.parametrize("fields", [
    dict(lr=2e-3, base_batch=64, lr_scaling="sqrt", warmup_samples=1024, micro_batch=32),
    dict(lr=0.05, base_batch=32, lr_scaling="linear", warmup_steps=3, micro_batch=128),
    dict(lr=1e-3, base_batch=64, lr_scaling="none", micro_batch=16, grad_accum=4),
])
def test_run_config_applies_the_schedule_functions(fields):
    config = RunConfig(example="pytorch", **fields)
    peak = schedule.peak_lr(config.lr, global_batch=config.global_batch, base_batch=config.base_batch,
                            scaling=config.lr_scaling)
    warmup = schedule.warmup_steps_for(config.global_batch, warmup_steps=config.warmup_steps,
                                       warmup_samples=config.warmup_samples)
    assert config.peak_lr == peak and config.warmup_steps_effective == warmup
    assert [config.lr_at(s) for s in range(1, 40)] == [schedule.lr_at(s, peak_lr=peak, warmup_steps=warmup)
                                                       for s in range(1, 40)]


def test_scaling_rules_and_warmup_in_samples():
    assert schedule.peak_lr(0.1, global_batch=128, base_batch=32, scaling="linear") == pytest.approx(0.4)
    assert schedule.peak_lr(0.1, global_batch=128, base_batch=32, scaling="sqrt") == pytest.approx(0.2)
    assert schedule.peak_lr(0.1, global_batch=128, base_batch=32) == 0.1
    with pytest.raises(ValueError, match="scaling must be one of"):
        schedule.peak_lr(0.1, global_batch=128, base_batch=32, scaling="cubic")
    # The same 1024 warmup samples: 32 steps at batch 32, 2 at batch 512; the peak is reached at 1024 samples.
    assert schedule.warmup_steps_for(32, warmup_samples=1024) == 32
    assert schedule.warmup_steps_for(512, warmup_samples=1024) == 2
    for batch in (32, 512):
        curve = schedule.lr_by_samples([0, 1, 1024, 4096], lr=1.0, global_batch=batch, base_batch=batch,
                                       warmup_samples=1024)
        assert curve[0] == curve[1] == pytest.approx(batch / 1024)  # sample 0 and 1: the first step's LR
        assert curve[2:] == [1.0, 1.0]


def test_export_writes_the_warmup_the_ranks_use():
    """`labkit export` turns labkit's rule into DeepSpeed's WarmupLR: with warmup in samples, its
    warmup steps are the ones the ranks count (it wrote 0 warmup steps before)."""
    config = RunConfig(example="deepspeed", micro_batch=32, warmup_samples=256, lr=1e-3)
    params = export_ds_config(config)["scheduler"]["params"]
    assert params["warmup_num_steps"] == math.ceil(256 / 32) == config.warmup_steps_effective
    assert params["warmup_min_lr"] == 0.0 and params["warmup_max_lr"] == config.peak_lr


@pytest.mark.parametrize("call, says", [
    # notebook 04a's cells as typed: each divided by zero, took a square root of a negative, or gave a negative LR
    (lambda: schedule.peak_lr(1e-3, global_batch=0, base_batch=32, scaling="linear"), "global_batch must be"),
    (lambda: schedule.peak_lr(1e-3, global_batch=64, base_batch=0), "base_batch must be a whole number >= 1, got 0"),
    (lambda: schedule.peak_lr(1e-3, global_batch=-64, base_batch=32, scaling="sqrt"), "got -64"),
    (lambda: schedule.peak_lr(-1, global_batch=64, base_batch=32), "lr must be a finite learning rate > 0, got -1"),
    (lambda: schedule.peak_lr(math.nan, global_batch=64, base_batch=32), "lr must be a finite learning rate > 0"),
    (lambda: schedule.warmup_steps_for(0, warmup_samples=1000), "global_batch must be a whole number >= 1, got 0"),
    (lambda: schedule.warmup_steps_for(64, warmup_samples=-1000), "warmup_samples must be a whole number >= 0"),
    (lambda: schedule.lr_at(-5, peak_lr=1e-3, warmup_steps=10), "step must be a whole number >= 1, got -5"),
    (lambda: schedule.lr_at(1, peak_lr=1e-3, warmup_steps=2.5), "warmup_steps must be a whole number >= 0, got 2.5"),
])
def test_the_schedule_refuses_sizes_out_of_range_naming_them(call, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        call()
    assert schedule.lr_at(1, peak_lr=1e-3) == 1e-3 and schedule.warmup_steps_for(64) == 0  # the edges pass

"""RunConfig's fields are the one place their help, group and choices are written: the generic check, the CLI's
flags and the panel's dropdowns all come from them (labkit.core.fields)."""

from __future__ import annotations

import argparse
import re

import pytest

from labkit.cli import build_parser, config_from_args, flag
from labkit.core import schedule
from labkit.core.config import FIELDS, GROUPS, PRESETS, ConfigError, RunConfig

# Every config flag `labkit run` and `labkit export` had before the flags were built from RunConfig: README, docs,
# notebooks and tests spell them so. Field -> flag.
CLI_FLAGS = {
    "example": "--example", "model": "--model", "data": "--data", "loss": "--loss", "stage": "--stage",
    "precision": "--precision", "world_size": "--world-size", "micro_batch": "--micro-batch",
    "grad_accum": "--grad-accum", "train_batch": "--train-batch", "steps": "--steps", "optimizer": "--optimizer",
    "lr": "--lr", "lr_scaling": "--lr-scaling", "base_batch": "--base-batch", "warmup_steps": "--warmup-steps",
    "warmup_samples": "--warmup-samples", "input_size": "--input-size", "hidden": "--hidden", "depth": "--depth",
    "output_size": "--output-size", "dataset_size": "--dataset-size", "seed": "--seed",
    "target_loss": "--target-loss", "eval_every": "--eval-every", "eval_samples": "--eval-samples",
    "threads_per_rank": "--threads-per-rank", "heartbeat_s": "--heartbeat-s",
    "startup_timeout_s": "--startup-timeout-s",
    "device_memory_budget_bytes": "--device-memory-budget-bytes", "census_every": "--census-every",
    "noise_scale_every": "--noise-scale-every", "hostfile": "--hostfile", "offload_optimizer": "--offload-optimizer",
    "distributed_sampler": "--no-distributed-sampler", "stop_at_target": "--stop-at-target",
    "telemetry": "--no-telemetry", "comms_log": "--comms-log", "ds_overrides": "--ds-override",
}
# Fields with a fixed set of values, which the CLI offers as choices and the panel as dropdowns.
CHOICE_FIELDS = ("example", "stage", "precision", "optimizer", "lr_scaling")


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {option: action for action in parser._actions for option in action.option_strings}


def _subparser(name: str) -> argparse.ArgumentParser:
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[name]


def test_every_field_has_help_and_a_group_and_names_only_fields():
    for name, spec in FIELDS.items():
        assert spec.help.strip(), f"{name} has no help"
        assert spec.group in GROUPS, f"{name}'s group {spec.group!r} is not one of {GROUPS}"
        for ref in re.findall(r"`(\w+)`", spec.help):
            assert ref in FIELDS, f"{name}'s help names `{ref}`, which is no field"
    assert {spec.group for spec in FIELDS.values()} == set(GROUPS)  # no group is empty


def test_choices_are_the_ones_the_code_acts_on():
    assert FIELDS["example"].choices == tuple(PRESETS)
    assert FIELDS["lr_scaling"].choices == schedule.SCALINGS
    assert FIELDS["stage"].choices == (0, 1, 2, 3)
    assert [name for name, spec in FIELDS.items() if spec.choices] == sorted(CHOICE_FIELDS, key=list(FIELDS).index)


@pytest.mark.parametrize("command", ["run", "export"])
def test_the_cli_keeps_every_flag_it_had_with_the_fields_choices_and_help(command):
    options = _options(_subparser(command))
    for name, option in CLI_FLAGS.items():
        assert option in options, f"labkit {command} lost {option}"
        action = options[option]
        assert action.dest == name
        assert action.choices == FIELDS[name].choices or (action.choices is None and not FIELDS[name].choices)
        # The field's help, the fields it names written as their flags.
        assert action.help and action.help.startswith(FIELDS[name].describe(lambda ref: CLI_FLAGS.get(ref, ref)))
    # A flag per field the CLI sets, and no other config flag: --script and "--" are script mode's.
    assert {name for name, spec in FIELDS.items() if spec.cli} | {"ds_overrides"} == set(CLI_FLAGS)


def test_each_flag_sets_its_field():
    given = {"model": "gpt", "stage": "2", "precision": "bf16", "world_size": "1", "micro_batch": "8",
             "grad_accum": "2", "train_batch": "16", "steps": "3", "optimizer": "sgd", "lr": "0.01",
             "lr_scaling": "sqrt", "base_batch": "32", "warmup_samples": "64", "input_size": "32", "hidden": "16",
             "depth": "2", "output_size": "256", "dataset_size": "512", "seed": "7", "target_loss": "2.5",
             "eval_every": "5", "eval_samples": "64", "threads_per_rank": "1", "heartbeat_s": "60",
             "startup_timeout_s": "300", "device_memory_budget_bytes": "1000000000", "census_every": "3",
             "noise_scale_every": "4"}
    argv = ["run", "--example", "deepspeed"] + [a for name, value in given.items() for a in (flag(name), value)]
    argv += ["--offload-optimizer", "--no-distributed-sampler", "--stop-at-target", "--no-telemetry", "--comms-log",
             "--ds-override", '{"gradient_clipping": 1.0}']
    config = config_from_args(build_parser().parse_args(argv))
    for name, text in given.items():
        assert getattr(config, name) == FIELDS[name].kind(text) if not FIELDS[name].choices else \
            str(getattr(config, name)) == text, name
    assert (config.offload_optimizer, config.distributed_sampler, config.stop_at_target, config.telemetry,
            config.comms_log) == (True, False, True, False, True)
    assert config.ds_overrides == {"gradient_clipping": 1.0}
    # Nothing given: RunConfig's defaults, not the parser's.
    assert config_from_args(build_parser().parse_args(["run", "--example", "zero3"])) == RunConfig(example="zero3")


def test_the_panels_dropdowns_and_tooltips_come_from_the_fields(tmp_path):
    import ipywidgets as W

    from labkit.ui.panel import PRESET, LabPanel

    panel = LabPanel(root=tmp_path / "runs")
    try:
        dropdowns = {name: c for name, c in panel.controls.items() if isinstance(c, W.Dropdown)}
        assert set(dropdowns) == {"example", "stage", "offload_optimizer", "precision", "lr_scaling"}
        for name, dropdown in dropdowns.items():
            spec = FIELDS[name]
            values = [value for _, value in dropdown.options]
            expected = list(spec.choices or (False, True))  # a switch: off, on
            assert values == ([PRESET, *expected] if spec.optional else expected), name
        for name, control in panel.controls.items():
            assert control.tooltip == FIELDS[name].describe(), name
    finally:
        panel.close()


def _wrong_value(name: str) -> object:
    """A value of the wrong type for every field."""
    return 1.5 if FIELDS[name].kind in (str, list, dict, bool) else "many"


@pytest.mark.parametrize("name", list(FIELDS))
def test_a_value_of_the_wrong_type_is_refused_naming_the_field(name):
    with pytest.raises(ConfigError) as info:
        RunConfig(**{name: _wrong_value(name)})
    assert info.value.field == name and str(info.value).startswith(f"{name}: must be ")


@pytest.mark.parametrize("values,message", [
    ({"hidden": 0}, "hidden: must be a positive integer, got 0"),
    ({"hidden": True}, "hidden: must be a positive integer, got True"),  # a bool is no count
    ({"seed": -1}, "seed: must be a non-negative integer, got -1"),
    ({"lr": float("inf")}, "lr: must be a positive number, got inf"),
    ({"threads_per_rank": 0}, "threads_per_rank: must be a positive integer or None, got 0"),
    ({"stage": True}, "stage: must be one of (0, 1, 2, 3) or None, got True"),
    ({"precision": "fp8"}, "precision: must be one of ('fp32', 'bf16', 'fp16'), got 'fp8'"),
    ({"script_args": ["--steps", 3]}, "script_args: must be a list of strings, got ['--steps', 3]"),
    ({"telemetry": 0}, "telemetry: must be True or False, got 0"),
])
def test_the_annotation_and_bound_say_what_is_wrong(values, message):
    with pytest.raises(ConfigError) as info:
        RunConfig(**values)
    assert str(info.value) == message

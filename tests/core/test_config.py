"""Bad configurations are refused before any process starts, with the field named."""

from __future__ import annotations

import re

import pytest

from labkit.core.config import ConfigError, RunConfig

BAD_CONFIGS = [
    ({"example": "zero3", "world_size": 2, "micro_batch": 64, "train_batch": 64}, "train_batch"),
    ({"micro_batch": 0}, "micro_batch"),
    ({"grad_accum": -1}, "grad_accum"),
    ({"steps": 0}, "steps"),
    ({"stage": 4}, "stage"),
    ({"stage": -1}, "stage"),
    ({"example": "offload", "stage": 0}, "offload_optimizer"),
    ({"example": "zero3", "stage": 0, "offload_optimizer": True}, "offload_optimizer"),
    ({"world_size": 10_000}, "world_size"),
    ({"example": "pytorch", "world_size": 2}, "world_size"),
    ({"example": "pytorch", "stage": 2}, "stage"),
    ({"example": "pytorch", "offload_optimizer": True}, "offload_optimizer"),
    ({"example": "bert"}, "example"),
    ({"precision": "fp8"}, "precision"),
    ({"lr": 0.0}, "lr"),
    ({"lr": float("nan")}, "lr"),
    ({"lr_scaling": "cubic"}, "lr_scaling"),
    ({"optimizer": "lamb"}, "optimizer"),
    ({"hidden": 0}, "hidden"),
    ({"micro_batch": 10_000, "dataset_size": 1024}, "micro_batch"),
    ({"stop_at_target": True}, "stop_at_target"),
    ({"target_loss": -1.0}, "target_loss"),
    ({"heartbeat_s": 0}, "heartbeat_s"),
    ({"device_memory_budget_bytes": 0}, "device_memory_budget_bytes"),
    ({"ds_overrides": {"zero_optimisation": {"stage": 2}}}, "ds_overrides"),
    ({"ds_overrides": {"train_batch_size": 32}}, "ds_overrides"),
    ({"ds_overrides": {"zero_optimization": {"stage3_no_such_knob": 1}}}, "ds_overrides.zero_optimization"),
    ({"hostfile": "/no/such/hostfile"}, "hostfile"),
]


@pytest.mark.parametrize("values,field", BAD_CONFIGS, ids=[f for _, f in BAD_CONFIGS])
def test_bad_config_names_the_field(values, field):
    with pytest.raises(ConfigError) as info:
        RunConfig(**values)
    assert info.value.field == field
    assert str(info.value).startswith(field + ":")


def test_deepspeed_itself_decides_which_top_level_keys_it_reads(tmp_path):
    # Keys DeepSpeed 0.19.8 reads, which no hand-written list of labkit's ever held, pass ...
    RunConfig(example="zero3", ds_overrides={"data_types": {"grad_accum_dtype": "fp32"}, "memory_breakdown": False,
                                             "torch_autocast": {"enabled": False}, "timers": {}, "aio": {},
                                             "checkpoint": {"tag_validation": "Warn"}, "disable_allgather": False})
    # ... a key it never reads would be ignored without a word, so labkit refuses it ...
    with pytest.raises(ConfigError, match=r"never reads \['gradient_cliping'\]"):
        RunConfig(example="zero3", ds_overrides={"gradient_cliping": 1.0})
    # ... and a removed feature gets DeepSpeed's own explanation.
    with pytest.raises(ConfigError, match="Apex AMP integration has been removed"):
        RunConfig(example="zero3", ds_overrides={"amp": {"enabled": True}})
    # The optimizer's name, which the engine checks on every rank after the launch (audit: "Adamm" ran 30 s and
    # failed), is checked here: DeepSpeed's own names and torch.optim's classes pass.
    with pytest.raises(ConfigError, match=r"optimizer type 'Adamm' is not a supported DeepSpeed optimizer"):
        RunConfig(example="zero3", ds_overrides={"optimizer": {"type": "Adamm", "params": {"lr": 1e-3}}})
    for name in ("Adam", "adamw", "SGD", "RMSprop"):
        RunConfig(example="zero3", ds_overrides={"optimizer": {"type": name, "params": {"lr": 1e-3}}})
    # A top-level scalar DeepSpeed takes as given (get_scalar_param), of another kind than its default: refused by
    # the default's kind ("abc" launched, and the ranks failed at `gradient_clipping() > 0.0`).
    with pytest.raises(ConfigError, match=re.escape("gradient_clipping must be a number (DeepSpeed's default: 1.0), "
                                                     "got 'abc'")):
        RunConfig(example="zero3", ds_overrides={"gradient_clipping": "abc"})
    with pytest.raises(ConfigError, match=r"gradient_clipping must be a number .*, got True"):
        RunConfig(example="zero3", ds_overrides={"gradient_clipping": True})
    with pytest.raises(ConfigError, match=r"prescale_gradients must be true or false .*, got 1"):
        RunConfig(example="zero3", ds_overrides={"prescale_gradients": 1})
    RunConfig(example="zero3", ds_overrides={"gradient_clipping": 0, "prescale_gradients": False})  # of its kind
    # Overrides that could not reach anything are refused too.
    with pytest.raises(ConfigError, match="plain PyTorch example has none"):
        RunConfig(example="pytorch", ds_overrides={"gradient_clipping": 1.0})
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    with pytest.raises(ConfigError, match="script builds its own DeepSpeed config"):
        RunConfig(script=str(script), ds_overrides={"gradient_clipping": 1.0})


def test_unknown_key_is_refused():
    with pytest.raises(ConfigError, match="unknown config key"):
        RunConfig.from_dict({"example": "zero3", "micro_batch_size": 32})


def test_presets_correct_the_seed_text():
    offload = RunConfig(example="offload")
    assert offload.stage == 2 and offload.offload_optimizer is True
    assert offload.ds_config()["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    zero3 = RunConfig(example="zero3", world_size=2, micro_batch=64, grad_accum=2)
    ds = zero3.ds_config()
    # train_batch_size = micro x accumulation x world size
    assert ds["train_batch_size"] == 256
    assert ds["train_micro_batch_size_per_gpu"] == 64 and ds["gradient_accumulation_steps"] == 2
    assert "offload_optimizer" not in ds["zero_optimization"]


def test_lr_scaling_rules():
    base = dict(example="zero3", world_size=2, micro_batch=128, base_batch=64, lr=1e-3)
    assert RunConfig(**base, lr_scaling="none").peak_lr == pytest.approx(1e-3)
    assert RunConfig(**base, lr_scaling="linear").peak_lr == pytest.approx(4e-3)
    assert RunConfig(**base, lr_scaling="sqrt").peak_lr == pytest.approx(2e-3)
    warm = RunConfig(**base, lr_scaling="linear", warmup_steps=4)
    assert [round(warm.lr_at(s), 6) for s in (1, 2, 4, 5)] == [1e-3, 2e-3, 4e-3, 4e-3]


def test_round_trip_and_saved_config():
    config = RunConfig(example="offload", world_size=2, steps=3)
    again = RunConfig.from_dict(config.to_dict())
    assert again == config
    saved = RunConfig.from_saved({**config.to_dict(), "world_size": 64})
    assert saved.world_size == 64  # a past run from a bigger machine still loads


def test_hostfile_slots_must_match_world_size(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-a slots=2\nnode-b slots=2  # second box\n")
    assert RunConfig(example="zero3", world_size=4, hostfile=str(hostfile)).world_size == 4
    with pytest.raises(ConfigError) as info:
        RunConfig(example="zero3", world_size=3, hostfile=str(hostfile))
    assert info.value.field == "world_size"
    hostfile.write_text("node-a slots=two\n")
    with pytest.raises(ConfigError, match="hostname slots=N"):
        RunConfig(example="zero3", world_size=2, hostfile=str(hostfile))


@pytest.mark.parametrize("line, said", [
    ("-oProxyCommand=touch_/tmp/pwn slots=2", "line 2 .*begins with '-'"),
    ("node;rm slots=2", "line 2 .*characters no host name"),
    ("node,b slots=2", "line 2 .*characters no host name"),
    ("node-b slots=2abc", r"line 2 .*slots=2abc is not a whole number"),
])
def test_hostfile_refuses_what_deepspeeds_parser_takes_leniently(tmp_path, line, said):
    """DeepSpeed's pattern takes any leading token as the host (an option for ssh and pdsh when it begins with
    '-') and reads `slots=2abc` as 2: refused, naming the line."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"node-a slots=2\n{line}\n")
    with pytest.raises(ConfigError, match=said) as info:
        RunConfig(example="zero3", world_size=4, hostfile=str(hostfile))
    assert info.value.field == "hostfile" and str(hostfile) in str(info.value)


def test_hostfile_that_is_a_directory_is_named_so(tmp_path):
    with pytest.raises(ConfigError, match="is a directory, not a hostfile"):
        RunConfig(example="zero3", world_size=2, hostfile=str(tmp_path))
    # A device or a pipe said "no such file", though it exists.
    with pytest.raises(ConfigError, match="not a regular file: /dev/null"):
        RunConfig(example="zero3", world_size=2, hostfile="/dev/null")
    with pytest.raises(ConfigError, match="no such file: "):
        RunConfig(example="zero3", world_size=2, hostfile=str(tmp_path / "missing"))


def test_hostfile_names_people_use_are_accepted(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the cluster\nnode-a.example.org slots=1\nuser@gpu_2 slots=1 # ssh alias\n"
                        "10.0.0.3 slots=1\n[fe80::1%eth0] slots=1\n"
                        "node-e slots=1# rack A\nnode-f slots=1 max_slots=8\n")  # Open MPI's own key, for mpirun
    assert RunConfig(example="zero3", world_size=6, hostfile=str(hostfile)).world_size == 6

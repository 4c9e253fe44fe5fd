"""The DeepSpeed config a run's ranks pass to `deepspeed.initialize`, built from its `RunConfig`, and its check by
DeepSpeed's own `DeepSpeedConfig` before anything launches (offline: no process group, no device)."""

from __future__ import annotations

from collections.abc import KeysView
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from labkit.core.config import RunConfig

# DeepSpeed's comms logger with every collective profiled (`RunConfig.comms_log`; labkit.rank.comms_log reads it).
COMMS_LOGGER_CONFIG = {"enabled": True, "prof_all": True, "debug": True, "verbose": False}


def build_ds_config(run: RunConfig) -> dict[str, Any]:
    """The DeepSpeed config the ranks pass to `deepspeed.initialize`."""
    if run.example == "pytorch":
        return {}
    zero: dict[str, Any] = {"stage": run.stage}
    if run.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    config: dict[str, Any] = {
        "train_batch_size": run.global_batch,
        "train_micro_batch_size_per_gpu": run.micro_batch,
        "gradient_accumulation_steps": run.grad_accum,
        # weight_decay explicit: without FusedAdam DeepSpeed's "Adam" is torch.optim.AdamW (runtime/engine.py:2382,
        # 0.19.8), whose default is 0.01, while FusedAdam, CPU Adam, torch SGD and the plain loop's Adam use 0.
        "optimizer": {"type": "Adam" if run.optimizer == "adam" else "SGD",
                      "params": {"lr": run.peak_lr, "weight_decay": 0.0}},
        "zero_optimization": zero,
        "bf16": {"enabled": run.precision == "bf16"},
        "fp16": {"enabled": run.precision == "fp16"},
        "steps_per_print": 10**9,  # labkit records its own metrics
        "wall_clock_breakdown": False,
    }
    if run.comms_log:
        config["comms_logger"] = dict(COMMS_LOGGER_CONFIG)
    if run.optimizer == "sgd":
        # DeepSpeed's ZeRO wrappers accept torch SGD only when asked explicitly.
        config["zero_allow_untested_optimizer"] = True
    for key, value in run.ds_overrides.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


class _KeysRead(dict):
    """A ds_config that remembers which top-level keys DeepSpeed's config code looks up (`get`, `[]`,
    `in`, `in .keys()`): a key it never looks up is one DeepSpeed would ignore without a word."""

    def __init__(self, config: dict[str, Any]):
        super().__init__(config)
        self.read: set[str] = set()
        self.defaults: dict[str, Any] = {}  # key -> the default DeepSpeed's `get` gave it (its kind of value)

    def __getitem__(self, key: Any) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self.read.add(key)
        if default is not None:
            self.defaults.setdefault(key, default)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self.read.add(key)  # type: ignore[arg-type]
        return super().__contains__(key)

    def keys(self) -> KeysView[str]:  # type: ignore[override]
        return KeysView(self)  # its `in` goes through __contains__ above

    def __copy__(self) -> _KeysRead:
        return self  # DeepSpeedConfig copies the dict before reading it: keep one record


def mistyped(overrides: dict[str, Any], defaults: dict[str, Any]) -> list[str]:
    """The top-level overrides whose value is not of the kind of DeepSpeed's default for the key (a bool for a
    switch, a number for a number, a string for a string): DeepSpeed's scalar getters take any value
    (`get_scalar_param`, deepspeed/runtime/config_utils.py:193-194, 0.19.8), and a rank fails on it after the launch
    (`"gradient_clipping": "abc"` at `gradient_clipping() > 0.0`) or reads it wrong (`"wall_clock_breakdown":
    "false"` is true). One line per key."""
    said = []
    for key, value in overrides.items():
        default = defaults.get(key)
        if isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, (int, float)):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif isinstance(default, str):
            ok = isinstance(value, str)
        else:  # no default, or a structure: DeepSpeed's own models check those
            continue
        if not ok:
            kind = "true or false" if isinstance(default, bool) else (
                "a number" if isinstance(default, (int, float)) else "a string")
            said.append(f"{key} must be {kind} (DeepSpeed's default: {default!r}), got {value!r}")
    return said


def deepspeed_checked(ds_config: dict[str, Any], world_size: int) -> Any:
    """The whole ds_config parsed and sanity-checked by DeepSpeed's own `DeepSpeedConfig`, as rank 0
    of `world_size` ranks would, before anything launches (no process group, no device).

    `DeepSpeedConfig.__init__` asks torch.distributed for the world size, which does not exist yet
    here; this runs the rest of its __init__ (deepspeed/runtime/config.py, 0.19.8) with the world
    size given: removed keys, every sub-config's pydantic model, the batch triplet, precision.
    The result's `keys_read` are the top-level keys DeepSpeed looked up on the way."""
    from deepspeed.runtime import config as ds

    tracked = _KeysRead(ds_config)
    checked = ds.DeepSpeedConfig.__new__(ds.DeepSpeedConfig)
    checked._param_dict = tracked
    ds._reject_removed_config_keys(tracked)
    checked.global_rank, checked.world_size = 0, world_size
    checked._initialize_params(tracked)
    checked._configure_train_batch_size()
    checked._do_sanity_check()
    checked.keys_read = frozenset(tracked.read)
    checked.key_defaults = dict(tracked.defaults)
    # The optimizer's name is checked by the engine, not the config (deepspeed/runtime/engine.py:2016-2019 and
    # `_is_supported_optimizer`, :1985-1986, 0.19.8): a rank would fail its assertion after the launch.
    name = checked.optimizer_name
    if name is not None and name not in ds.DEEPSPEED_OPTIMIZERS:
        import torch

        if getattr(torch.optim, name, None) is None:
            raise ValueError(f"optimizer type {name!r} is not a supported DeepSpeed optimizer: one of "
                             f"{', '.join(ds.DEEPSPEED_OPTIMIZERS)} or a torch.optim class name")
    return checked

"""Run configuration: one typed dataclass, validated before any process starts.

`RunConfig` describes one training run of the lab (which example, ZeRO stage, batch
triplet, model size, ...). It checks itself in `__post_init__`, so a bad value fails in
the notebook or CLI with a message naming the field, instead of 7-9 s later inside the
ranks (or never: DeepSpeed accepts offload with stage 0 and unknown keys silently).
`RunConfig.ds_config()` produces the DeepSpeed JSON config the ranks use.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from labkit.core import schedule

EXAMPLES = ("pytorch", "deepspeed", "offload", "zero3")
PRECISIONS = ("fp32", "bf16", "fp16")
LR_SCALINGS = schedule.SCALINGS
OPTIMIZERS = ("adam", "sgd")

# The seed text's three examples, corrected, and "deepspeed": DeepSpeed's engine with the
# stage and offload you choose (nothing turned on by default), for runs that are none of the
# three (stage 0-2 without offload, say). Values a preset fills in when the user leaves them unset.
PRESETS: dict[str, dict[str, Any]] = {
    "pytorch": {"stage": None, "offload_optimizer": False},
    "deepspeed": {"stage": 0, "offload_optimizer": False},
    # ZeRO-Offload is its own switch (offload_optimizer), not "stage 1"; the
    # ZeRO-Offload paper paired it with stage 2.
    "offload": {"stage": 2, "offload_optimizer": True},
    "zero3": {"stage": 3, "offload_optimizer": False},
}


def hostfile_slots(path: str | os.PathLike) -> dict[str, int]:
    """Parse a DeepSpeed hostfile ("hostname slots=N" per line, # comments) with DeepSpeed's own
    parser (`deepspeed.launcher.runner.fetch_hostfile`): what labkit checks is what the launcher reads."""
    if not Path(path).is_file():
        raise ConfigError("hostfile", f"no such file: {path}")
    from deepspeed.launcher.runner import fetch_hostfile

    try:
        slots = dict(fetch_hostfile(str(path)) or {})
    except ValueError as exc:
        raise ConfigError("hostfile", f"{path}: {exc} (expected 'hostname slots=N' lines)") from None
    bad = [host for host, count in slots.items() if count <= 0]
    _require(not bad, "hostfile", f"{path}: hosts {bad} have no slots (expected 'hostname slots=N' with N > 0)")
    return slots


# Off while `labkit export` builds a job for a cluster from a login node without its GPUs.
_CHECK_LOCAL_DEVICES: contextvars.ContextVar[bool] = contextvars.ContextVar("labkit_check_local_devices",
                                                                             default=True)


@contextlib.contextmanager
def without_local_device_checks() -> Iterator[None]:
    """Configs built inside are validated like any other, except against this machine's devices
    (rank count, fp16/bf16 support): the cluster's nodes check them when the ranks load config.json."""
    token = _CHECK_LOCAL_DEVICES.set(False)
    try:
        yield
    finally:
        _CHECK_LOCAL_DEVICES.reset(token)


class ConfigError(ValueError):
    """A run configuration that must not be launched. `field` names the culprit."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


def _require(condition: bool, field_name: str, message: str) -> None:
    if not condition:
        raise ConfigError(field_name, message)


def _validation_detail(exc: Exception) -> str:
    """A pydantic ValidationError as "field.path: message; ..." (it names the bad field); else the error's text."""
    errors: list[dict[str, Any]] = getattr(exc, "errors", lambda: [])()
    return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors) or str(exc)


@dataclass(kw_only=True)
class RunConfig:
    example: Literal["pytorch", "deepspeed", "offload", "zero3"] = "zero3"
    # What is trained (labkit.models.builders): a built-in name ("mlp", "gpt") or "package.module:build_model";
    # data/loss: "package.module:callable" import strings (None: the built-in model's dataset / cross-entropy).
    model: str = "mlp"
    data: str | None = None
    loss: str | None = None
    # Script mode (labkit.rank.script): an unmodified DeepSpeed training script run on every rank with these
    # arguments instead of labkit's worker; `steps` is then only the progress bar's length.
    script: str | None = None
    script_args: list[str] = field(default_factory=list)
    stage: int | None = None              # ZeRO stage 0-3; None = the example's preset
    offload_optimizer: bool | None = None  # optimizer state + step on the CPU; None = preset
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    world_size: int = 1                   # ranks (one per GPU; CPU ranks without GPUs)
    micro_batch: int = 64                 # samples per rank per forward/backward
    grad_accum: int = 1                   # micro-batches per optimizer step
    train_batch: int | None = None        # global batch; derived when None, checked when set
    steps: int = 20                       # optimizer steps
    optimizer: Literal["adam", "sgd"] = "adam"
    lr: float = 1e-3                      # learning rate at base_batch
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    base_batch: int = 64                  # global batch that `lr` was tuned for
    warmup_steps: int = 0
    warmup_samples: int = 0               # warmup in samples (same share of the data at every batch); 0 = off
    input_size: int = 100                 # the seed's SimpleModel: 100 -> 500 -> 10
    hidden: int = 500
    depth: int = 1                        # hidden layers of width `hidden`
    output_size: int = 10
    dataset_size: int = 8192
    distributed_sampler: bool = True      # False reproduces the seed's bug: every rank reads all data
    sample_with_replacement: bool = False  # each rank draws its samples at random, with replacement: a micro-batch
    #                                       may exceed the dataset (max-batch probes: memory, not the data, is the cap)
    seed: int = 0
    target_loss: float | None = None      # record the time this loss is first reached
    stop_at_target: bool = False          # end the run once target_loss is reached
    hostfile: str | None = None           # multi-node: DeepSpeed hostfile ("host slots=N" lines)
    heartbeat_s: float = 120.0            # a rank silent this long after its first step is hung
    startup_timeout_s: float = 900.0      # allowance for process start and JIT op builds
    device_memory_budget_bytes: int | None = None  # emulated device capacity (CPU); exceeding it is an OOM
    telemetry: bool = True                # per-step records; False writes only start/done (benchmark)
    comms_log: bool = False               # DeepSpeed's comms logger -> comms_rank<N>.json (labkit.rank.comms_log);
                                          # it synchronizes the GPU after every collective: not for timed runs
    census_every: int = 10                # recount model-state bytes every N steps (they rarely change)
    noise_scale_every: int = 0            # estimate the gradient noise scale every N steps (0 = off)
    eval_every: int = 0                   # held-out eval loss every N steps, every step near the target (0 = off)
    eval_samples: int = 1024              # size of the fixed held-out eval set (labkit.models.data.make_eval_set)
    threads_per_rank: int | None = None   # CPU ranks: OpenMP threads each; None = cores // world_size
    ds_overrides: dict[str, Any] = field(default_factory=dict)
    max_world_size: int | None = None     # devices present; filled by `labkit.runtime.devices` when None

    def __post_init__(self) -> None:
        _require(self.example in EXAMPLES, "example", f"must be one of {EXAMPLES}, got {self.example!r}")
        preset = PRESETS[self.example]
        self._check_builders()
        if self.stage is None:
            self.stage = preset["stage"]
        if self.offload_optimizer is None:
            self.offload_optimizer = preset["offload_optimizer"]
        for name in ("world_size", "micro_batch", "grad_accum", "steps", "base_batch", "input_size",
                     "hidden", "depth", "output_size", "dataset_size", "census_every"):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value > 0, name,
                     f"must be a positive integer, got {value!r}")
        for name in ("warmup_steps", "warmup_samples", "noise_scale_every", "eval_every", "seed"):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value >= 0, name,
                     f"must be a non-negative integer, got {value!r}")
        for name in ("lr", "heartbeat_s", "startup_timeout_s"):
            value = getattr(self, name)
            _require(isinstance(value, (int, float)) and not isinstance(value, bool)
                     and math.isfinite(value) and value > 0, name, f"must be a positive number, got {value!r}")
        _require(isinstance(self.eval_samples, int) and not isinstance(self.eval_samples, bool)
                 and self.eval_samples > 0, "eval_samples", f"must be a positive integer, got {self.eval_samples!r}")
        _require(self.threads_per_rank is None or (isinstance(self.threads_per_rank, int)
                 and not isinstance(self.threads_per_rank, bool) and self.threads_per_rank > 0),
                 "threads_per_rank", f"must be a positive integer or None, got {self.threads_per_rank!r}")
        _require(not (self.warmup_steps and self.warmup_samples), "warmup_samples",
                 f"set warmup_steps ({self.warmup_steps}) or warmup_samples ({self.warmup_samples}), not both")
        _require(self.precision in PRECISIONS, "precision", f"must be one of {PRECISIONS}, got {self.precision!r}")
        _require(self.lr_scaling in LR_SCALINGS, "lr_scaling", f"must be one of {LR_SCALINGS}, got {self.lr_scaling!r}")
        _require(self.optimizer in OPTIMIZERS, "optimizer", f"must be one of {OPTIMIZERS}, got {self.optimizer!r}")

        if self.example == "pytorch":
            _require(self.stage is None, "stage",
                     "the plain PyTorch example has no ZeRO stage; use example='deepspeed', 'offload' or 'zero3'")
            _require(not self.offload_optimizer, "offload_optimizer",
                     "the plain PyTorch example has no DeepSpeed optimizer to offload")
            _require(self.world_size == 1, "world_size",
                     "the plain PyTorch example is a single-process loop; use a DeepSpeed example for several ranks")
            _require(self.precision != "fp16", "precision",
                     "fp16 needs a loss scaler; the plain PyTorch example supports fp32 and bf16")
        else:
            _require(isinstance(self.stage, int) and not isinstance(self.stage, bool) and 0 <= self.stage <= 3,
                     "stage", f"ZeRO stage must be 0, 1, 2 or 3, got {self.stage!r}")
            # Stage 0 has no ZeRO optimizer to move the states and step to the host. DeepSpeed does
            # not refuse the config: it builds CPU Adam over the model's own parameters, which on a
            # GPU asserts at the first step (ops/adam/cpu_adam.py) and on CPU offloads nothing.
            _require(not (self.offload_optimizer and self.stage == 0), "offload_optimizer",
                     "optimizer offload needs ZeRO stage 1, 2 or 3 (stage 0 has no ZeRO optimizer to offload; "
                     "DeepSpeed would start, then CPU Adam would fail at the first step on GPU parameters)")

        _require(isinstance(self.comms_log, bool), "comms_log", f"must be True or False, got {self.comms_log!r}")
        _require(not (self.comms_log and self.script), "comms_log",
                 "script mode runs the learner's script, not labkit's worker: nothing would capture the comms log "
                 "(turn DeepSpeed's comms_logger on in the script's own ds_config)")
        if _CHECK_LOCAL_DEVICES.get():
            self._check_devices()
        derived = self.micro_batch * self.grad_accum * self.world_size
        if self.train_batch is not None:
            _require(self.train_batch == derived, "train_batch",
                     f"train_batch ({self.train_batch}) must equal micro_batch x grad_accum x world_size "
                     f"= {self.micro_batch} x {self.grad_accum} x {self.world_size} = {derived}")
        _require(self.micro_batch <= self.dataset_size // self.world_size or not self.distributed_sampler
                 or self.sample_with_replacement,
                 "micro_batch", f"micro_batch {self.micro_batch} exceeds the {self.dataset_size // self.world_size} "
                 f"samples each of {self.world_size} ranks gets from dataset_size {self.dataset_size}")
        if self.target_loss is not None:
            _require(isinstance(self.target_loss, (int, float)) and self.target_loss > 0, "target_loss",
                     f"must be a positive number, got {self.target_loss!r}")
        _require(not self.stop_at_target or self.target_loss is not None, "stop_at_target", "needs target_loss")
        if self.device_memory_budget_bytes is not None:
            _require(isinstance(self.device_memory_budget_bytes, int) and self.device_memory_budget_bytes > 0,
                     "device_memory_budget_bytes",
                     f"must be a positive integer, got {self.device_memory_budget_bytes!r}")
        if self.hostfile is not None:
            slots = hostfile_slots(self.hostfile)
            _require(self.world_size == sum(slots.values()), "world_size",
                     f"{self.world_size} ranks requested but hostfile {self.hostfile} lists "
                     f"{sum(slots.values())} slots; DeepSpeed's launcher starts one rank per slot")
        self._check_overrides()

    def _check_builders(self) -> None:
        from labkit.core.model_specs import MODELS, check_spec_syntax

        for name in ("model", "data", "loss"):
            problem = check_spec_syntax(name, getattr(self, name), builtin_ok=name == "model")
            _require(problem is None, name, problem or "")
        if self.script is not None:
            _require(isinstance(self.script, str) and Path(self.script).is_file(), "script",
                     f"no such file: {self.script!r}")
            _require(isinstance(self.script_args, list) and all(isinstance(a, str) for a in self.script_args),
                     "script_args", f"must be a list of strings, got {self.script_args!r}")
        _require(self.model in MODELS or self.data is not None, "data",
                 f"model {self.model!r} is an import string: name its dataset too, "
                 "data='package.module:build_dataset'")

    def _check_devices(self) -> None:
        from labkit.runtime.devices import detect_devices

        devices = detect_devices()
        if self.max_world_size is None and self.hostfile is None:
            self.max_world_size = devices.max_ranks
        if self.max_world_size is not None:
            _require(self.world_size <= self.max_world_size, "world_size",
                     f"{self.world_size} ranks requested but this machine has {self.max_world_size} "
                     f"{devices.kind_plural} for ranks")
        if self.precision == "fp16":
            _require(devices.fp16, "precision",
                     f"fp16 is not supported by the {devices.accelerator} accelerator; use bf16 or fp32")
        if self.precision == "bf16":
            _require(devices.bf16, "precision", f"bf16 is not supported by the {devices.accelerator} accelerator")

    def _check_overrides(self) -> None:
        if not self.ds_overrides:
            return
        for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            _require(key not in self.ds_overrides, "ds_overrides",
                     f"{key} is derived from micro_batch, grad_accum and world_size; set those instead")
        _require(self.script is None, "ds_overrides",
                 "a script builds its own DeepSpeed config; labkit's ds_overrides would not reach it")
        _require(self.example != "pytorch", "ds_overrides",
                 "they configure DeepSpeed's engine (monitors included); the plain PyTorch example has none")
        from labkit.runtime.ds_import import import_deepspeed

        import_deepspeed()  # DeepSpeed's first import under one lock: threads importing it at once deadlock
        try:
            from labkit.core.ds_config import deepspeed_checked

            checked = deepspeed_checked(self.ds_config(), self.world_size)
        except Exception as exc:  # pydantic's ValidationError names the bad field
            detail = _validation_detail(exc)
            where = "ds_overrides.zero_optimization" if "DeepSpeedZeroConfig" in str(exc) else "ds_overrides"
            raise ConfigError(where, f"DeepSpeed refuses the config: {detail}") from None
        # DeepSpeed ignores a top-level key it never reads (a typo, a key of another version) without a word.
        unread = sorted(set(self.ds_overrides) - checked.keys_read)
        if unread:
            import deepspeed

            raise ConfigError("ds_overrides", f"DeepSpeed {deepspeed.__version__}'s config never reads {unread}: "
                              "it would ignore them silently")

    # -- derived values ------------------------------------------------------------------
    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.world_size

    # The LR schedule: labkit.core.schedule's functions applied to this run's fields (the
    # trainers write `lr_at(step)` into the optimizer; the lessons draw curves from schedule itself).
    @property
    def peak_lr(self) -> float:
        """The learning rate scaled for the global batch as `lr_scaling` says ("none", "linear" or "sqrt" of
        global_batch / base_batch; labkit.core.schedule.peak_lr)."""
        return schedule.peak_lr(self.lr, global_batch=self.global_batch, base_batch=self.base_batch,
                                scaling=self.lr_scaling)

    @property
    def warmup_steps_effective(self) -> int:
        """Warmup in optimizer steps: `warmup_steps`, or `warmup_samples` over the global batch
        (rounded up), so every batch size warms up over the same number of samples."""
        return schedule.warmup_steps_for(self.global_batch, warmup_steps=self.warmup_steps,
                                         warmup_samples=self.warmup_samples)

    def lr_at(self, step: int) -> float:
        """LR for optimizer step `step` (1-based): linear warmup, then constant."""
        return schedule.lr_at(step, peak_lr=self.peak_lr, warmup_steps=self.warmup_steps_effective)

    def zero_settings(self) -> Any:
        """DeepSpeed's own model (`DeepSpeedZeroConfig`) of the ZeRO settings this run overrides in
        `ds_overrides`, DeepSpeed's defaults elsewhere: e.g. `.param_persistence_threshold`,
        `.max_reuse_distance` (not the stage: a template for many stages has none)."""
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

        return DeepSpeedZeroConfig(**self.ds_overrides.get("zero_optimization", {}))

    def ds_config(self) -> dict[str, Any]:
        """The DeepSpeed config the ranks pass to `deepspeed.initialize` (`labkit.core.ds_config`)."""
        from labkit.core.ds_config import build_ds_config

        return build_ds_config(self)

    # -- (de)serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(unknown[0], f"unknown config key(s) {unknown}; known: {sorted(names)}")
        return cls(**data)

    @classmethod
    def from_saved(cls, data: dict[str, Any]) -> RunConfig:
        """A past run's config as recorded, not re-validated against this machine's devices."""
        config = cls.__new__(cls)
        defaults = {f.name: (f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
                    for f in dataclasses.fields(cls)}
        config.__dict__.update({**defaults, **data})
        return config

    @classmethod
    def load(cls, path: str | os.PathLike) -> RunConfig:
        """A run directory's config.json, as `Run.start()` validated and saved it: not validated again.

        Ranks load it (labkit.rank.worker): validating there would re-probe the devices in every rank (a child
        importing torch and DeepSpeed, a context on GPU 0, refused outright in exclusive-process mode) and
        re-open a hostfile path that may be relative to another machine's directory."""
        data = json.loads(Path(path).read_text())
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(unknown[0], f"unknown config key(s) {unknown} in {path}; known: {sorted(names)}")
        return cls.from_saved(data)

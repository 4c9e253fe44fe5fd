"""Run configuration: one typed dataclass, validated before any process starts.

`RunConfig` describes one training run of the lab (which example, ZeRO stage, batch
triplet, model size, ...). It checks itself in `__post_init__`, so a bad value fails in
the notebook or CLI with a message naming the field, instead of 7-9 s later inside the
ranks (or never: DeepSpeed accepts offload with stage 0 and unknown keys silently).
`RunConfig.ds_config()` produces the DeepSpeed JSON config the ranks use.

Each field is declared once, in its group, with its help text and its choices (`labkit.core.fields`);
`FIELDS` is what the CLI's flags and the panel's dropdowns are built from.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from labkit.core import schedule
from labkit.core.fields import FieldSpec, field_specs, first_problem, setting

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


# What a host name or ssh alias can hold: letters, digits, '.', '_', '-', and ':', '[', ']', '%' for IPv6 addresses,
# '@' for user@host. Never a leading '-': the name reaches ssh and pdsh as an argument, where it would be an option.
_HOST_NAME = re.compile(r"[A-Za-z0-9._:%@\[\]][A-Za-z0-9._:%@\[\]-]*")
_HOSTFILE_LINE = re.compile(r"(\S+)\s+slots=(\S*).*")  # DeepSpeed's pattern, the slots' token whole


def _check_hostfile_lines(path: str | os.PathLike, lines: list[str]) -> None:
    """What DeepSpeed's lenient parser would take but no launcher should: an option-looking or malformed host name,
    `slots=2abc` (DeepSpeed reads 2). ConfigError naming the line. What follows the slots is left (Open MPI reads the
    file itself: `max_slots=8`), as are lines DeepSpeed's pattern does not match (its parser's to refuse)."""
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()  # a comment, after a space or not
        match = _HOSTFILE_LINE.fullmatch(line)
        if not match:
            continue
        host, count = match.groups()
        where = f"{path} line {number} ({line!r})"
        if not _HOST_NAME.fullmatch(host):
            why = "begins with '-' (ssh and pdsh would read it as an option)" if host.startswith("-") \
                else "has characters no host name or ssh alias has"
            raise ConfigError("hostfile", f"{where}: host name {host!r} {why}")
        if not count.isdigit():
            raise ConfigError("hostfile", f"{where}: slots={count} is not a whole number "
                              "(expected 'hostname slots=N')")


def hostfile_slots(path: str | os.PathLike) -> dict[str, int]:
    """Parse a DeepSpeed hostfile ("hostname slots=N" per line, # comments) with DeepSpeed's own
    parser (`deepspeed.launcher.runner.fetch_hostfile`): what labkit checks is what the launcher reads. Host names
    and slot counts DeepSpeed would take leniently are refused first (`_check_hostfile_lines`)."""
    if Path(path).is_dir():
        raise ConfigError("hostfile", f"{path} is a directory, not a hostfile (expected 'hostname slots=N' lines)")
    if not Path(path).is_file():
        what = "not a regular file" if Path(path).exists() else "no such file"  # /dev/null, a pipe
        raise ConfigError("hostfile", f"{what}: {path} (expected a file of 'hostname slots=N' lines)")
    from deepspeed.launcher.runner import fetch_hostfile

    try:
        with open(path) as handle:
            _check_hostfile_lines(path, handle.readlines())
        slots = dict(fetch_hostfile(str(path)) or {})
    except ValueError as exc:  # UnicodeDecodeError too (a binary file); ConfigError is raised as is
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError("hostfile", f"{path}: {exc} (expected 'hostname slots=N' lines)") from None
    except OSError as exc:
        raise ConfigError("hostfile", f"{path} cannot be read: {exc.strerror or exc}") from None
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


# The groups RunConfig's fields come in, as a reader thinks of them; the CLI's --help and the docs show them so.
GROUPS = ("model", "data", "batch", "optimizer and schedule", "strategy", "run control")


@dataclass(kw_only=True)
class RunConfig:
    """One training run. Each field says here, once, what it means (`help`), where it belongs (`group`) and what
    it takes (its annotation: a `Literal` lists the choices; `bound` limits a number). `__post_init__` checks
    every value against its annotation (labkit.core.fields), then the combinations; `labkit.cli` builds its
    flags and `labkit.ui.panel` its dropdowns from the same fields (`FIELDS`)."""

    # -- model: what is trained (labkit.models.builders) -------------------------------------------------
    model: str = setting("mlp", group="model", help=(
        "what to train: 'mlp', 'gpt' (byte-level GPT-2 on Python's source, needs [hf]) or "
        "'package.module:build_model' (build_model(config) -> torch.nn.Module)"))
    loss: str | None = setting(None, group="model", help=(
        "'package.module:loss_fn' (loss_fn(model, inputs, labels) -> scalar tensor); default: cross-entropy"))
    input_size: int = setting(100, group="model", bound="positive",  # the seed's SimpleModel: 100 -> 500 -> 10
                              help="MLP input features; GPT context length in bytes")
    hidden: int = setting(500, group="model", bound="positive", help="MLP width; GPT n_embd")
    depth: int = setting(1, group="model", bound="positive", help="MLP hidden layers; GPT n_layer")
    output_size: int = setting(10, group="model", bound="positive",
                               help="MLP classes (the GPT's vocabulary is always 256 bytes)")
    # Script mode (labkit.rank.script): the CLI's --script and the arguments after "--".
    script: str | None = setting(None, group="model", cli=False, help=(
        "script mode: an unmodified DeepSpeed training script run on every rank, with its own arguments, instead "
        "of labkit's worker; `steps` is then only the progress bar's length"))
    # setting() returns a dataclasses.Field (a fresh list or dict per instance), not a shared default: noqa.
    script_args: list[str] = setting(default_factory=list, group="model", cli=False,  # noqa: RUF009
                                     help="the script's command-line arguments")

    # -- data: what it reads --------------------------------------------------------------------------------
    data: str | None = setting(None, group="data", help=(
        "'package.module:build_dataset' (build_dataset(config) -> Dataset of (inputs, labels)); "
        "default: the built-in model's"))
    dataset_size: int = setting(8192, group="data", bound="positive",
                                help="training samples (GPT: windows of `input_size` bytes)")
    distributed_sampler: bool = setting(True, group="data", help=(
        "each rank reads its own share of the dataset; off reproduces the seed text's bug: every rank reads the "
        "whole dataset"))
    # Max-batch probes (labkit.study.maxbatch): memory, not the data, is the cap.
    sample_with_replacement: bool = setting(False, group="data", cli=False, help=(
        "each rank draws its samples at random, with replacement: a micro-batch may exceed the dataset"))
    seed: int = setting(0, group="data", bound="non-negative",
                        help="initial weights, data order and the built-in datasets")
    eval_samples: int = setting(1024, group="data", bound="positive",
                                help="size of the held-out evaluation set (labkit.models.data.make_eval_set)")

    # -- batch: train_batch_size = micro_batch x grad_accum x world_size ------------------------------------
    world_size: int = setting(1, group="batch", bound="positive", help="ranks: one per GPU, or CPU processes")
    micro_batch: int = setting(64, group="batch", bound="positive", help="samples per rank per forward/backward")
    grad_accum: int = setting(1, group="batch", bound="positive", help="micro-batches per optimizer step")
    train_batch: int | None = setting(None, group="batch", bound="positive", help=(
        "global batch; must equal `micro_batch` x `grad_accum` x `world_size` (derived when unset)"))

    # -- optimizer and schedule (labkit.core.schedule) ------------------------------------------------------
    optimizer: Literal["adam", "sgd"] = setting("adam", group="optimizer and schedule", help="adam or sgd")
    lr: float = setting(1e-3, group="optimizer and schedule", bound="positive",
                        help="learning rate at `base_batch`")
    lr_scaling: Literal["none", "linear", "sqrt"] = setting("none", group="optimizer and schedule", help=(
        "how the LR follows the global batch: none, linear, sqrt (of global batch / `base_batch`)"))
    base_batch: int = setting(64, group="optimizer and schedule", bound="positive",
                              help="the global batch `lr` was tuned for (`lr_scaling` scales from it)")
    warmup_steps: int = setting(0, group="optimizer and schedule", bound="non-negative", help=(
        "linear LR warmup over this many optimizer steps (or `warmup_samples`, not both)"))
    warmup_samples: int = setting(0, group="optimizer and schedule", bound="non-negative", help=(
        "linear LR warmup over this many samples (the same data at every batch size; 0: off)"))

    # -- strategy: how DeepSpeed runs it, and where the ranks run -------------------------------------------
    example: Literal["pytorch", "deepspeed", "offload", "zero3"] = setting("zero3", group="strategy", help=(
        "pytorch: plain PyTorch loop, 1 process; deepspeed: DeepSpeed's engine, give `stage`; "
        "offload: ZeRO-2 + optimizer offload; zero3: ZeRO stage 3"))
    stage: int | None = setting(None, group="strategy", choices=(0, 1, 2, 3), help=(
        "ZeRO stage: 0 none, 1 optimizer states, 2 + gradients, 3 + parameters partitioned "
        "(unset: the example's preset)"))
    offload_optimizer: bool | None = setting(None, group="strategy", help=(
        "optimizer state and step on the CPU (ZeRO stages 1-3; unset: the example's preset)"))
    precision: Literal["fp32", "bf16", "fp16"] = setting("fp32", group="strategy", help=(
        "fp32, bf16 or fp16 (refused before launch where DeepSpeed's accelerator lacks it)"))
    ds_overrides: dict[str, Any] = setting(default_factory=dict, group="strategy", cli=False, help=(  # noqa: RUF009
        'extra DeepSpeed config, e.g. {"gradient_clipping": 1.0} (checked by DeepSpeed\'s own config; '
        "a key it never reads is refused)"))
    hostfile: str | None = setting(None, group="strategy",
                                   help="multi-node: DeepSpeed hostfile ('host slots=N' lines)")
    threads_per_rank: int | None = setting(None, group="strategy", bound="positive",
                                           help="CPU ranks: OpenMP threads each (default: cores / ranks)")
    max_world_size: int | None = setting(None, group="strategy", cli=False, help=(
        "ranks this machine can host (devices present); filled by labkit.runtime.devices when unset"))

    # -- run control: how long, when to stop, what is recorded, when a rank counts as hung ------------------
    steps: int = setting(20, group="run control", bound="positive",
                         help="optimizer steps (script mode: the progress bar's length)")
    target_loss: float | None = setting(None, group="run control", bound="positive", help=(
        "record the time this loss is first reached (on the held-out eval loss with `eval_every`)"))
    stop_at_target: bool = setting(False, group="run control", help="end the run once `target_loss` is reached")
    eval_every: int = setting(0, group="run control", bound="non-negative", help=(
        "evaluate the held-out loss every N steps, every step near the target (0: off)"))
    heartbeat_s: float = setting(120.0, group="run control", bound="positive",
                                 help="a rank silent this long after its first step is reported hung")
    startup_timeout_s: float = setting(900.0, group="run control", bound="positive",
                                       help=("allowance before the first step (process start, distributed "
                                             "init); time waiting on a JIT op build in progress is not counted"))
    device_memory_budget_bytes: int | None = setting(None, group="run control", bound="positive", help=(
        "emulated device capacity per rank (CPU); passing it is an out-of-memory failure"))
    telemetry: bool = setting(True, group="run control", help=(
        "per-step records; off writes only the start and done records (benchmark baseline)"))
    comms_log: bool = setting(False, group="run control", help=(
        "record what DeepSpeed's collectives sent, per rank, into comms_rank<N>.json (DeepSpeed's comms logger, "
        "labkit.rank.comms_log; it makes every collective blocking on a GPU: not for timing)"))
    census_every: int = setting(10, group="run control", bound="positive",
                                help="recount model-state bytes every N steps (they rarely change)")
    noise_scale_every: int = setting(0, group="run control", bound="non-negative",
                                     help="estimate the gradient noise scale every N steps (0: off)")

    def __post_init__(self) -> None:
        wrong = first_problem(self, FIELDS)  # each value against its annotation and bound, in the order above
        if wrong is not None:
            raise ConfigError(*wrong)
        preset = PRESETS[self.example]
        self._check_builders()
        if self.stage is None:
            self.stage = preset["stage"]
        if self.offload_optimizer is None:
            self.offload_optimizer = preset["offload_optimizer"]
        _require(not (self.warmup_steps and self.warmup_samples), "warmup_samples",
                 f"set warmup_steps ({self.warmup_steps}) or warmup_samples ({self.warmup_samples}), not both")

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
            # Stage 0 has no ZeRO optimizer to move the states and step to the host. DeepSpeed does
            # not refuse the config: it builds CPU Adam over the model's own parameters, which on a
            # GPU asserts at the first step (ops/adam/cpu_adam.py) and on CPU offloads nothing.
            _require(not (self.offload_optimizer and self.stage == 0), "offload_optimizer",
                     "optimizer offload needs ZeRO stage 1, 2 or 3 (stage 0 has no ZeRO optimizer to offload; "
                     "DeepSpeed would start, then CPU Adam would fail at the first step on GPU parameters)")

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
        _require(not self.stop_at_target or self.target_loss is not None, "stop_at_target", "needs target_loss")
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
            _require(Path(self.script).is_file(), "script", f"no such file: {self.script!r}")
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
        from labkit.core.ds_config import mistyped

        wrong = mistyped(self.ds_overrides, checked.key_defaults)
        if wrong:
            raise ConfigError("ds_overrides", "; ".join(wrong))

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

    def zero_settings(self, stage: int | None = None) -> Any:
        """DeepSpeed's own model (`DeepSpeedZeroConfig`) of the ZeRO settings this run overrides in
        `ds_overrides`, DeepSpeed's defaults elsewhere: e.g. `.param_persistence_threshold`,
        `.max_reuse_distance`. Without `stage` (a template for many stages has none) DeepSpeed takes stage 0, whose
        defaults and checks differ from other stages' (`overlap_comm`; settings it allows at some stages only)."""
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

        given = self.ds_overrides.get("zero_optimization", {})
        return DeepSpeedZeroConfig(**({"stage": stage, **given} if stage is not None else given))

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


# Every field of RunConfig, its annotation resolved: what the CLI's flags and the panel's dropdowns are built from.
FIELDS: dict[str, FieldSpec] = field_specs(RunConfig)

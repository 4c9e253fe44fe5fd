"""What a rank trains: the model, the dataset and the loss, named by import strings.

`RunConfig.model`, `RunConfig.data` and `RunConfig.loss` are either a built-in name or an
import string "package.module:callable" that every rank imports (the module must be
importable by the ranks: installed, or on PYTHONPATH / in the directory labkit is run from).
The callables' contract:

    build_model(config: RunConfig) -> torch.nn.Module
        Built on the current default device (labkit builds it on the "meta" device to count
        parameter shapes without memory, so use no data-dependent initialisation tricks).
        Every rank calls it after `torch.manual_seed(config.seed)`: identical initial weights.
    build_dataset(config: RunConfig) -> torch.utils.data.Dataset
        Items are (inputs, labels) pairs of tensors; labkit's DataLoader batches them and
        shards the dataset between ranks with a DistributedSampler. Deterministic from config.seed.
    loss_fn(model, inputs, labels) -> scalar tensor        (optional, RunConfig.loss)
        `model` is the DeepSpeed engine (or the plain module for example "pytorch"); the
        default is cross-entropy of model(inputs) (its `.logits` if it has them) against labels,
        both flattened over every leading dimension (classification and language modelling).

Built-in names (`MODELS`): "mlp" (the seed text's SimpleModel on generated data, labkit.models.data)
and "gpt" (a small GPT-2-style causal LM on the Python standard library's source text,
labkit.models.gpt, needs `pip install labkit[hf]`).
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from labkit.core.model_specs import MODELS

if TYPE_CHECKING:
    import torch
    from torch import nn

    from labkit.core.config import RunConfig

def specs(config: RunConfig) -> dict[str, str]:
    """The import strings a rank will use, by RunConfig field (built-in names resolved)."""
    model, data = MODELS.get(config.model, (config.model, None))
    out = {"model": model, "data": config.data or data}
    if config.loss:
        out["loss"] = config.loss
    return {k: v for k, v in out.items() if v}


def resolve(spec: str) -> Callable[..., Any]:
    """Import "package.module:attr.path" and return the object."""
    module_name, _, attr_path = spec.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    return obj


# The child that checks the import strings: imports each one, says which failed and why.
_CHECK_SCRIPT = r"""
import json, sys, traceback
from labkit.models.builders import resolve
bad, files = {}, []
for field, spec in json.loads(sys.argv[1]).items():
    try:
        obj = resolve(spec)
        if not callable(obj):
            bad[field] = f"{spec} is a {type(obj).__name__}, not a callable"
        files.append(getattr(sys.modules.get(spec.split(":")[0]), "__file__", None))
    except BaseException as exc:
        bad[field] = f"cannot import {spec}: {type(exc).__name__}: {exc}"
print(json.dumps({"bad": bad, "files": [f for f in files if f]}))
"""
# Strings that imported cleanly -> their modules' files and modification times: checked again once a
# file changes (a learner editing their module between two launches in one notebook).
_checked: dict[tuple[tuple[str, str], ...], dict[str, int]] = {}


def _mtimes(files: list[str]) -> dict[str, int]:
    import os

    times = {}
    for path in files:
        try:
            times[path] = os.stat(path).st_mtime_ns
        except OSError:
            times[path] = -1
    return times


def _findable(top_level: str, paths: list[str]) -> bool:
    """Whether the child could import a top-level module, as far as this process can tell without running it:
    True when it is built in or already imported, on `paths` (the child's path and this process's), or found by any
    finder of sys.meta_path (an editable install's, an import hook's; the child's site installs the same ones), and
    when a sitecustomize or usercustomize on `paths` could install a finder only the child has."""
    from importlib.machinery import PathFinder

    if top_level in sys.builtin_module_names or top_level in sys.modules:
        return True
    importlib.invalidate_caches()  # a module written a moment ago (a notebook's %%writefile)
    entries = [p or "." for p in paths]
    if PathFinder.find_spec(top_level, entries) is not None:
        return True
    if any(Path(entry, f"{name}.py").exists() for entry in entries for name in ("sitecustomize", "usercustomize")):
        return True
    for finder in sys.meta_path:
        if finder is PathFinder or not hasattr(finder, "find_spec"):
            continue
        try:
            if finder.find_spec(top_level, None) is not None:
                return True
        except Exception:  # a third-party finder that fails here: let the child decide
            return True
    return False


def check_importable(config: RunConfig, *, timeout_s: float = 300.0) -> None:
    """Import every model/data/loss string in a child process, as a rank will (none for the built-in mlp on its own
    data: nothing of the learner's); raise a ConfigError naming the field when one fails. A child, so a broken module
    can neither crash nor pollute this (notebook) process. A set of strings that passed is checked again only once one
    of its modules' files changes."""
    import os

    from labkit.core.config import ConfigError

    if config.model == "mlp" and not config.data and not config.loss:
        return  # the seed text's model on its own generated data: labkit's own modules, nothing of the learner's
    wanted = tuple(sorted(specs(config).items()))
    if wanted in _checked and _mtimes(list(_checked[wanted])) == _checked[wanted]:
        return
    # The ranks' import path: this labkit's package root first (labkit.launch.launcher), then the
    # inherited PYTHONPATH; the working directory, like `python -m` in the ranks.
    package_root = str(Path(__file__).resolve().parents[2])
    pythonpath = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    # A top-level module found nowhere the child could look is refused here, without the child's seconds
    # of importing torch and the other strings' modules.
    for field_name, spec in wanted:
        top = spec.partition(":")[0].split(".")[0]
        if not _findable(top, [os.getcwd(), *pythonpath.split(os.pathsep), *sys.path]):
            raise ConfigError(field_name, f"cannot import {spec}: ModuleNotFoundError: No module named {top!r}")
    env = {**os.environ, "PYTHONPATH": pythonpath}
    done = subprocess.run([sys.executable, "-c", _CHECK_SCRIPT, json.dumps(dict(wanted))], env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    try:
        answer = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise ConfigError("model", f"checking the import strings failed: {done.stderr[-1500:]}") from None
    if answer["bad"]:
        _checked.pop(wanted, None)
        field_name, message = next(iter(answer["bad"].items()))
        raise ConfigError(field_name, message)
    _checked[wanted] = _mtimes(answer["files"])


def on_meta_else_cpu(build_and_count: Callable[[str], Any]) -> Any:
    """`build_and_count("meta")`, or on a real CPU copy where the model cannot run on the meta device: a forward
    that reads a value (Hugging Face's packed-sequence check calls .item()). The lab's models are small."""
    try:
        return build_and_count("meta")
    except RuntimeError as exc:
        if "meta" not in str(exc):
            raise
        return build_and_count("cpu")


# -- what the worker calls -------------------------------------------------------------------
def build_model(config: RunConfig) -> nn.Module:
    model = resolve(specs(config)["model"])(config)
    from torch import nn

    if not isinstance(model, nn.Module):
        raise TypeError(f"model: {specs(config)['model']} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def build_dataset(config: RunConfig) -> Any:
    return resolve(specs(config)["data"])(config)


def loss_function(config: RunConfig) -> Callable[..., torch.Tensor]:
    return resolve(config.loss) if config.loss else default_loss


def default_loss(model: Any, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every position: (..., classes) logits against (...) labels."""
    import torch.nn.functional as F

    output = model(inputs)
    logits = getattr(output, "logits", output)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def monitor_paths(ds_config: dict[str, Any], run_dir: Any) -> dict[str, Any]:
    """DeepSpeed's file monitors (tensorboard, csv_monitor) write into the run directory's
    `monitor/` unless the config names an output_path."""
    out = dict(ds_config)
    for key in ("tensorboard", "csv_monitor"):
        if isinstance(out.get(key), dict) and out[key].get("enabled") and not out[key].get("output_path"):
            out[key] = {**out[key], "output_path": str(Path(run_dir).resolve() / "monitor") + "/"}
    return out


def train_flops_per_sample(config: RunConfig, dataset: Any) -> float:
    """Training FLOPs per sample of any model, from DeepSpeed's flops profiler: one forward of a
    2-sample batch on an fp32 CPU copy, times 3 (backward ~ 2 x forward, Kaplan et al. 2020).
    The RNG is left as it was (every rank must keep drawing the same numbers)."""
    import torch
    from deepspeed.profiling.flops_profiler import FlopsProfiler
    from torch.utils.data import default_collate

    inputs = default_collate([dataset[0], dataset[1]])[0]
    with torch.random.fork_rng(devices=[]):
        model = build_model(config).float()
    profiler = FlopsProfiler(model)
    profiler.start_profile()
    try:
        with torch.no_grad():
            model(inputs)
        forward = profiler.get_total_flops()
    finally:
        profiler.end_profile()
    return 3.0 * forward / inputs.shape[0]


# -- parameter shapes without memory (memory model, census) -----------------------------------
def param_numels(config: RunConfig) -> list[int]:
    """Element counts of the model's parameters in `parameters()` order (shared ones once),
    from the model built on the meta device: real shapes, no memory, no initialisation."""
    import torch

    with torch.device("meta"):
        model = build_model(config)
    return [p.numel() for p in model.parameters()]


def persistent_params(numels: list[int], threshold: int = 100_000) -> int:
    """Elements ZeRO-3 keeps whole on every rank: each parameter with at most `threshold`
    elements (`param_persistence_threshold`, default 1e5; DeepSpeed compares with <=)."""
    return sum(n for n in numels if n <= threshold)


def meta_model(config: RunConfig) -> nn.Module:
    """The model on the meta device, for DeepSpeed's estimators (largest layer)."""
    import torch

    with torch.device("meta"):
        return build_model(config)


# -- the built-in MLP -------------------------------------------------------------------------
def build_mlp(config: RunConfig) -> nn.Module:
    """The seed text's SimpleModel, sized by input_size, hidden, depth, output_size."""
    from labkit.models.mlp import SimpleModel

    return SimpleModel(config.input_size, config.hidden, config.output_size, config.depth)


def build_mlp_dataset(config: RunConfig) -> Any:
    """Generated inputs with teacher-MLP labels (labkit.models.data, data/README.md)."""
    from labkit.models.data import make_dataset

    return make_dataset(config.dataset_size, config.input_size, config.output_size, config.seed)


"""The device memory traffic of one optimizer step per parameter a rank owns, counted on DeepSpeed 0.19.8's own step.

A real 1-rank engine (the CPU accelerator, gloo) takes three steps of a 4-layer 1024 x 1024 model; the third
`engine.step()` runs under a TorchDispatchMode that adds up every aten op's bytes: what it reads (its tensor
arguments, each tensor once however often it is passed), what it writes (its outputs, and the arguments an in-place
op writes, which a `_foreach_*_` returns none of); an allocation moves nothing. The Adam update itself is DeepSpeed's
fused kernel, an extension of its own that no dispatch mode sees; its traffic is added by its source:
`FUSED_ADAM_BYTES_PER_PARAM`. So the figure is what 0.19.8's step does around the kernel (the overflow check, the
gradient norm, the casts to the fp32 partition, the unscale and clip, the copy back to 16 bits), per stage and
precision, at DeepSpeed's defaults (gradient clipping on, 1.0), not a hand count. Stage 0 in bf16 runs
FP16_Optimizer with a bf16 dtype, as in fp16 (engine.py's `_configure_fp16_optimizer` for a fused Adam; its
BF16_Optimizer is for pipeline parallelism or ZeRO-1 with fp32 gradient accumulation). Plain PyTorch (`torch`):
torch.optim.Adam's default step on a GPU (foreach, fp32 parameters), counted the same way, kernel and all.
Each is counted for every basic optimizer a run can step with on the device (`memory.STEP_OPTIMIZERS`, the count's
`optimizer`; `optimizer_class` is what DeepSpeed wrapped it in): DeepSpeed's FusedAdam; torch's Adam
(`"torch_adam": true`, labkit's choice on a GPU without nvcc, labkit.runtime.ops), which DeepSpeed makes
torch.optim.AdamW (engine.py:2380-2382, its `adam_w_mode` default) with foreach as on a GPU, every pass an aten op;
torch's SGD without momentum. All at weight decay 0, as labkit's runs set it (AdamW's decoupled decay would add a
pass, 8 B). Plain PyTorch: torch's Adam or SGD.

    python -m labkit.study.optimizer_bytes --out data/predict-ci/optimizer_bytes.json   # ~4 min on 2 cores
    python -m labkit.study.optimizer_bytes --one STAGE PRECISION [--optimizer NAME]    # one count, printed

`labkit.study.predict` reads the file (`step_bytes`). `--peak STAGE PRECISION SUB_GROUP_SIZE [--world-size N]`
measures what else the step does on the device: the bytes it allocates for itself at its peak (every aten op's new
tensors, each counted until it is freed), per rank, which `labkit.core.memory.optimizer_step_bytes` predicts. With
`--world-size 2` each rank is its own process (`peaks_in_subprocesses`); `--optimizer torch_adam|torch_sgd` runs
torch's Adam or SGD in place of FusedAdam; STAGE `torch` measures torch.optim.Adam's own step, which
`memory.plain_adam_step_bytes` predicts. `--peaks JSON` and `--counts JSON` make several, one after another in one
process (an engine each, each figure of its own third step): the tests' way, one process's imports for many.
Each count runs in a process of its own (`python -m labkit.study.optimizer_bytes --one STAGE PRECISION`), so that no
caller inherits a process group, on DeepSpeed's CPU accelerator even where a GPU is (the count is of aten ops, not
a timing). It runs the same aten ops as CUDA's here
(the norm's fp64 too: both support it; its other accelerator branches pick streams); at 2 ranks the bytes per owned
parameter are the same, plus the updated parameters' all-gather, which the model counts as communication.
ZeRO-Offload's step is the host's, timed apart (`predict._offload_s`).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

FORMAT = "labkit-optimizer-bytes/2"  # /2: a count per basic optimizer (`optimizer`; its wrapper: `optimizer_class`)
STAGES = ("torch", "0", "1", "2", "3")
# The basic optimizers a plain PyTorch loop steps with here (FusedAdam is DeepSpeed's)
PLAIN_OPTIMIZERS = ("torch_adam", "torch_sgd")
PRECISIONS = ("fp16", "bf16", "fp32")
OPTIMIZER_BYTES_JSON = Path(__file__).resolve().parents[2] / "data" / "predict-ci" / "optimizer_bytes.json"
# DeepSpeed's fused Adam (csrc/adam/multi_tensor_adam.cu, AdamFunctor): per fp32 parameter it reads the parameter,
# its gradient, exp_avg and exp_avg_sq (16 B) and writes the parameter, exp_avg and exp_avg_sq (12 B).
FUSED_ADAM_BYTES_PER_PARAM = 28
# In-place ops that write their argument without reading it, and allocations (no kernel)
OVERWRITES = {"aten.copy_", "aten.zero_", "aten.fill_"}
ALLOCATIONS = {"aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided"}
WIDTH, LAYERS = 1024, 4  # 4.2M parameters: the per-tensor scalars (norms, flags) are < 0.01 B per parameter


def default_optimizer(stage: int | str | None) -> str:
    """The basic optimizer a step of `stage` runs unless told otherwise: DeepSpeed's FusedAdam, plain PyTorch's
    torch.optim.Adam (stage None or "torch")."""
    return "torch_adam" if stage in (None, "torch") else "fused_adam"


def basic_optimizer(stage: int | None, offload: bool, optimizer: str | None = None) -> str:
    """The basic optimizer a step of `stage` (None: plain PyTorch) runs, checked, named as a run records its
    `optimizer_impl` (labkit.runtime.ops.OPTIMIZER_IMPLS; None: the default). On the device: DeepSpeed's `fused_adam`
    (its default), `torch_adam` (DeepSpeed's `"torch_adam": true`, labkit's choice on a GPU without nvcc) or
    `torch_sgd` (no momentum: no moments held); plain PyTorch's `torch_adam` (its default) or `torch_sgd`. With the
    optimizer offloaded (stages 1-3) DeepSpeed's CPU Adam steps on the host, `cpu_adam`, the only host step the
    predictor times: torch's Adam or SGD would step there instead (engine.py:2380, checked before the CPU optimizer
    at :2384; labkit's runs do so with SGD, or without a host compiler), and those are refused."""
    from labkit.runtime.ops import OPTIMIZER_IMPLS  # torch-free: `labkit predict` checks its flags with this

    chosen = optimizer or ("cpu_adam" if offload else default_optimizer(stage))
    if chosen not in OPTIMIZER_IMPLS:
        raise ValueError(f"unknown optimizer {chosen!r}; known: {', '.join(OPTIMIZER_IMPLS)}")
    if stage is None and chosen not in PLAIN_OPTIMIZERS:
        raise ValueError(f"plain PyTorch steps with torch's own optimizers ({', '.join(PLAIN_OPTIMIZERS)}); "
                         f"{chosen} is DeepSpeed's")
    if offload and chosen != "cpu_adam":
        raise ValueError(f"with the optimizer offloaded only DeepSpeed's CPU Adam (cpu_adam) is modelled on the "
                         f"host, not {chosen}: drop the optimizer or the offload")
    if not offload and chosen == "cpu_adam":
        raise ValueError("cpu_adam is ZeRO-Offload's host optimizer: it needs the optimizer offloaded (stages 1-3)")
    return chosen


def _tensors(value: Any) -> list[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _nbytes(*values: Any) -> int:
    """The bytes of the tensors in `values`, each counted once (`addcmul_(v, g, g)` reads g once)."""
    seen = {}
    for t in _tensors(list(values)):
        seen[(t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)] = t
    return sum(t.numel() * t.element_size() for t in seen.values())


def _recorder() -> Any:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Traffic(TorchDispatchMode):
        """Bytes read (tensor arguments) and written (outputs, and arguments written in place) per aten op."""

        def __init__(self) -> None:
            super().__init__()
            self.by_op: dict[str, int] = {}

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            schema = func._schema
            if schema.returns and all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
                return out  # a view: no kernel
            name = str(func.overloadpacket)
            if name in ALLOCATIONS:
                return out
            values = dict(zip([a.name for a in schema.arguments], args, strict=False), **kwargs)
            written = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
            read = [v for k, v in values.items() if not (name in OVERWRITES and k in written)]
            returns_written = schema.returns and all(r.alias_info is not None and r.alias_info.is_write
                                                     for r in schema.returns)
            moved = (_nbytes(read) + _nbytes([values.get(k) for k in written])
                     + (0 if returns_written else _nbytes(out)))
            self.by_op[name] = self.by_op.get(name, 0) + moved
            return out

    return Traffic()


def _summary(by_op: dict[str, int], params: int, kernel: int) -> dict[str, Any]:
    around = sum(by_op.values()) / params
    return {"bytes_per_param": round(around + kernel, 3), "aten_bytes_per_param": round(around, 3),
            "kernel_bytes_per_param": kernel,
            "by_op": {k: round(v / params, 3) for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])
                      if v / params >= 1e-3}}


def _engine(stage: int, precision: str, zero: dict[str, Any] | None = None, *, rank: int = 0, world_size: int = 1,
            port: int | None = None, optimizer: str = "fused_adam") -> tuple[Any, Any, Any]:
    """A real DeepSpeed engine of the 4-layer model on the CPU accelerator (gloo), rank `rank` of `world_size` (the
    others started alike with the same `port`), in this process: (engine, model, one micro-batch). `optimizer`
    (memory.STEP_OPTIMIZERS): DeepSpeed's fused Adam, torch's Adam with foreach as on a GPU (DeepSpeed passes
    `foreach` on to it; on CPU tensors torch would pick its per-tensor loop, whose temporaries differ), or torch's
    SGD."""
    import logging

    import torch

    from labkit.launch.launcher import free_port
    from labkit.runtime.ops import DEFAULT_EXTENSIONS_DIR, interpreter_path

    # DeepSpeed's fused Adam from the ops `make ops` built (a JIT build here would take a minute)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port or free_port()), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu",
                      PATH=interpreter_path(os.environ.get("PATH")),
                      TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR") or str(DEFAULT_EXTENSIONS_DIR))
    from labkit.runtime.ds_import import import_deepspeed

    import_deepspeed()
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import logger

    accelerator = get_accelerator()
    if precision == "fp16" and not accelerator.is_fp16_supported():
        # DeepSpeed's CPU accelerator refuses fp16 where oneDNN has no fp16 kernels (a CPU without AVX512-FP16 or
        # AMX: an AMD EPYC without AVX-512, 2026-11-28); torch still runs every fp16 op, and this counts the step's
        # traffic, not its speed
        accelerator.is_fp16_supported = lambda: True

    logger.setLevel(logging.WARNING)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
    # weight_decay 0, as labkit's runs set it (labkit.core.ds_config): torch's AdamW's default 0.01 would add a
    # decay pass, 8 B per parameter, that FusedAdam does inside its one kernel
    basic = {"fused_adam": {"type": "Adam", "params": {"lr": 1e-4, "weight_decay": 0.0}},
             "torch_adam": {"type": "Adam", "params": {"lr": 1e-4, "weight_decay": 0.0, "torch_adam": True,
                                                       "foreach": True}},
             "torch_sgd": {"type": "SGD", "params": {"lr": 1e-4, "weight_decay": 0.0}}}[optimizer]
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2,
                              "zero_optimization": {"stage": stage, **(zero or {})}, "optimizer": basic,
                              "zero_allow_untested_optimizer": optimizer == "torch_sgd"}
    if precision != "fp32":
        # a small initial loss scale: no step of the count may overflow (a skipped step runs no optimizer)
        config[precision] = {"enabled": True, **({"initial_scale_power": 4} if precision == "fp16" else {})}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    return engine, model, torch.randn(2, WIDTH, dtype=dtype)


def _third_step_under(engine: Any, x: Any, mode: Any) -> Any:
    """Three steps of `engine` on the micro-batch `x`, the third `engine.step()` under the dispatch `mode`, returned:
    the first two set the optimizer up (its states, the loss scale)."""
    for step in range(3):
        engine.backward(engine(x).float().pow(2).mean())
        if step < 2:
            engine.step()
            continue
        with mode:
            engine.step()
    if engine.skipped_steps:  # a skipped step runs no optimizer; a skipped first one would move its set-up here
        raise RuntimeError(f"{engine.skipped_steps} of the 3 steps overflowed and were skipped: nothing to count")
    return mode


def count_deepspeed_step(stage: int, precision: str, optimizer: str = "fused_adam") -> dict[str, Any]:
    """One engine.step() of a real 1-rank DeepSpeed engine with the basic `optimizer` (`_engine`), in this process
    (it initialises a gloo group)."""
    engine, model, x = _engine(stage, precision, optimizer=optimizer)
    traffic = _third_step_under(engine, x, _recorder())
    params = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())
    # torch's optimizers run as aten ops, counted; FusedAdam's kernel is added by its source
    kernel = FUSED_ADAM_BYTES_PER_PARAM if optimizer == "fused_adam" else 0
    return {"stage": stage, "precision": precision, "optimizer": optimizer,
            "optimizer_class": type(engine.optimizer).__name__, **_summary(traffic.by_op, params, kernel)}


def _live_bytes() -> Any:
    """A TorchDispatchMode that keeps the bytes of the tensors the ops under it allocate, each until that tensor is
    freed, and their peak (`peak`): views and in-place ops allocate nothing; a storage is counted once. Not a
    caching allocator's max_memory_allocated in general: a storage that outlives its first tensor through a view
    (`_unsafe_view` after a matmul, a view kept under inference_mode) is taken as freed with that tensor; `resize_`,
    kernels' own workspaces, the allocator's block rounding and other threads are not seen; and what was allocated
    before the span and freed inside it is not subtracted. None of those is on the path of DeepSpeed 0.19.8's ZeRO
    step (no resize_, inference_mode or matmul there; a reviewer's measurements of 7 more configurations agreed
    to 40 bytes)."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    class Live(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.live = self.peak = 0
            self.storages: dict[int, int] = {}

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            out = func(*args, **(kwargs or {}))
            if func._schema.returns and all(r.alias_info is not None for r in func._schema.returns):
                return out  # a view, or the argument written in place
            for tensor in _tensors(out):
                key = tensor.untyped_storage().data_ptr()
                if key in self.storages:
                    continue
                self.storages[key] = tensor.untyped_storage().nbytes()
                self.live += self.storages[key]
                self.peak = max(self.peak, self.live)
                weakref.finalize(tensor, self._free, key)
            return out

        def _free(self, key: int) -> None:
            self.live -= self.storages.pop(key, 0)

    return Live()


def peak_deepspeed_step(stage: int, precision: str, sub_group_size: int, rank: int = 0, world_size: int = 1,
                        port: int | None = None, optimizer: str = "fused_adam") -> dict[str, Any]:
    """The bytes the third engine.step() of a real DeepSpeed engine allocates at its peak on rank `rank` of
    `world_size` (each rank a process started alike with the same `port`), with `sub_group_size` and the basic
    `optimizer` (`_engine`)."""
    engine, model, x = _engine(stage, precision, {"sub_group_size": sub_group_size}, rank=rank,
                               world_size=world_size, port=port, optimizer=optimizer)
    live = _third_step_under(engine, x, _live_bytes())
    return {"stage": stage, "precision": precision, "sub_group_size": sub_group_size, "optimizer": optimizer,
            "rank": rank,
            "world_size": world_size, "param_numels": [int(getattr(p, "ds_numel", p.numel()))
                                                       for p in model.parameters()],
            "peak_bytes": live.peak}


def peaks_in_subprocesses(peaks: list[tuple[int, str, int, str]], world_size: int = 1,
                          timeout_s: float = 600) -> list[list[dict[str, Any]]]:
    """`peak_deepspeed_step` for each (stage, precision, sub_group_size, optimizer) of `peaks` on every rank, each
    rank its own process (`--peaks`), one gloo group, measured one after another in it (an engine per measurement;
    each peak is of its own third step, so what the ones before left allocated does not count): per measurement,
    each rank's figure. One set of processes for the lot: each process's imports and process group cost more than
    a measurement."""
    from labkit.launch.launcher import free_port

    port = str(free_port())
    spec = json.dumps([list(peak) for peak in peaks])
    procs = [subprocess.Popen([sys.executable, "-m", "labkit.study.optimizer_bytes", "--peaks", spec,
                               "--world-size", str(world_size), "--rank", str(rank), "--port", port],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
             for rank in range(world_size)]
    per_rank = []
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise RuntimeError(f"measuring the steps' peaks on rank {rank} took over {timeout_s:.0f} s") from None
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or len(lines) != len(peaks):
            for p in procs:
                p.kill()
            raise RuntimeError(f"measuring the steps' peaks on rank {rank} failed (exit {proc.returncode}, "
                               f"{len(lines)} of {len(peaks)} measured): {(err or out).strip()[-1500:]}")
        per_rank.append([dict(json.loads(line)) for line in lines])
    return [[ranks[i] for ranks in per_rank] for i in range(len(peaks))]


def _plain_third_step_under(mode: Any, optimizer_name: str = "torch_adam") -> list[Any]:
    """torch.optim.Adam's default step on a GPU (foreach) over fp32 parameters, the plain PyTorch loop's, or its
    SGD's (no momentum, foreach too): three steps of fresh gradients, the third under `mode`; the parameters."""
    import torch

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(WIDTH, WIDTH)) for _ in range(LAYERS)]
    optimizer = (torch.optim.Adam(params, lr=1e-4, foreach=True) if optimizer_name == "torch_adam"
                 else torch.optim.SGD(params, lr=1e-4, foreach=True))
    for step in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        if step < 2:
            optimizer.step()
            continue
        with mode:
            optimizer.step()
    return params


def count_plain_step(optimizer: str = "torch_adam") -> dict[str, Any]:
    """The traffic of torch.optim.Adam's default step on a GPU (foreach) over fp32 parameters, or SGD's
    (`optimizer` torch_sgd)."""
    traffic = _recorder()
    params = _plain_third_step_under(traffic, optimizer)
    name = "Adam" if optimizer == "torch_adam" else "SGD"
    # foreach: every pass is an aten op, the update included (no kernel of its own to add)
    return {"stage": "torch", "precision": "fp32", "optimizer": optimizer,
            "optimizer_class": f"torch.optim.{name}(foreach=True)",
            **_summary(traffic.by_op, sum(p.numel() for p in params), 0)}


def peak_torch_adam() -> dict[str, Any]:
    """The bytes torch.optim.Adam's default step (foreach) allocates at its peak, which
    `labkit.core.memory.plain_adam_step_bytes` predicts."""
    live = _live_bytes()
    params = _plain_third_step_under(live)
    return {"stage": "torch", "precision": "fp32", "optimizer": "torch.optim.Adam(foreach=True)",
            "param_numels": [p.numel() for p in params], "peak_bytes": live.peak}


def counts_in_subprocess(counts: list[tuple[str, str, str | None]], timeout_s: float = 600) -> list[dict[str, Any]]:
    """Each (stage, precision, optimizer) of `counts` in one child process (its process group and DeepSpeed's state
    die with it), one after another in it (`--counts`: an engine per count, each counting its own third step);
    `optimizer`: the stage's default (`default_optimizer`) where None."""
    spec = [[stage, precision, optimizer or default_optimizer(stage)] for stage, precision, optimizer in counts]
    what = ", ".join(f"stage {stage} {precision} with {optimizer}" for stage, precision, optimizer in spec)
    try:
        done = subprocess.run([sys.executable, "-m", "labkit.study.optimizer_bytes", "--counts", json.dumps(spec)],
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"counting {what} took over {timeout_s:.0f} s: {str(exc.stderr or '')[-1500:]}") from None
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or len(lines) != len(spec):
        raise RuntimeError(f"counting {what} failed (exit {done.returncode}, {len(lines)} of {len(spec)} counted): "
                           f"{(done.stderr or done.stdout).strip()[-1500:]}")
    return [dict(json.loads(line)) for line in lines]


def count_in_subprocess(stage: str, precision: str, timeout_s: float = 300,
                        optimizer: str | None = None) -> dict[str, Any]:
    """One count in a child process of its own (`counts_in_subprocess`)."""
    return counts_in_subprocess([(stage, precision, optimizer)], timeout_s)[0]


def measure() -> dict[str, Any]:
    """Every stage x precision DeepSpeed runs with every basic optimizer (plain PyTorch: fp32 parameters, torch's
    Adam and SGD), each in its own process."""
    from importlib.metadata import version

    from labkit.core.memory import STEP_OPTIMIZERS

    counts = [count_in_subprocess("torch", "fp32", optimizer=name) for name in PLAIN_OPTIMIZERS]
    counts += [count_in_subprocess(stage, precision, optimizer=name) for name in STEP_OPTIMIZERS
               for stage in STAGES[1:] for precision in PRECISIONS]
    return {"format": FORMAT, "deepspeed": version("deepspeed"), "torch": version("torch"),
            "date": time.strftime("%Y-%m-%d %H:%M"), "model": f"{LAYERS} x Linear({WIDTH}, {WIDTH}, bias=False)",
            "source": "python -m labkit.study.optimizer_bytes (its docstring says how it counts)", "counts": counts}


@functools.lru_cache(maxsize=1)
def _table(path: str) -> dict[tuple[str, str, str], float]:
    data = json.loads(Path(path).read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} file (python -m labkit.study.optimizer_bytes --out writes one)")
    return {(str(c["stage"]), str(c["precision"]), str(c["optimizer"])): float(c["bytes_per_param"])
            for c in data["counts"]}


def step_bytes(stage: int | None, precision: str, path: str | os.PathLike | None = None,
               optimizer: str | None = None) -> float:
    """Device bytes moved per owned parameter by one optimizer step of `stage` (None: plain PyTorch, whose
    parameters are fp32 whatever the precision) in `precision` with the basic `optimizer` (None: the stage's
    default, `default_optimizer`): the committed count (module doc)."""
    table = _table(str(path or OPTIMIZER_BYTES_JSON))
    optimizer = optimizer or default_optimizer(stage)
    key = ("torch", "fp32", optimizer) if stage is None else (str(stage), precision, optimizer)
    if key not in table:
        raise ValueError(f"no counted optimizer step for stage {key[0]} in {key[1]} with {optimizer} "
                         f"({path or OPTIMIZER_BYTES_JSON})")
    return table[key]


def _peak(stage: str, precision: str, size: str, optimizer: str | None, rank: int, world_size: int,
          port: int | None) -> dict[str, Any]:
    if stage == "torch":
        return peak_torch_adam()
    return peak_deepspeed_step(int(stage), precision, int(size), rank, world_size, port,
                               optimizer=optimizer or "fused_adam")


def _count(stage: str, precision: str, optimizer: str | None) -> dict[str, Any]:
    optimizer = optimizer or default_optimizer(stage)
    return count_plain_step(optimizer) if stage == "torch" else count_deepspeed_step(int(stage), precision, optimizer)


def _peak_is_valid(stage: str, precision: str, size: str, optimizer: str | None, world_size: int) -> bool:
    from labkit.core.memory import STEP_OPTIMIZERS

    return (stage in STAGES and precision in PRECISIONS and size.isdigit()
            and optimizer in (None, *STEP_OPTIMIZERS)
            and not (stage == "torch" and (precision != "fp32" or world_size != 1
                                           or optimizer not in (None, "torch_adam"))))


def _count_is_valid(stage: str, precision: str, optimizer: str | None) -> bool:
    from labkit.core.memory import STEP_OPTIMIZERS

    optimizer = optimizer or default_optimizer(stage)
    return (stage in STAGES and precision in PRECISIONS and optimizer in STEP_OPTIMIZERS
            and not (stage == "torch" and (precision != "fp32" or optimizer not in PLAIN_OPTIMIZERS)))


def _json_list(parser: argparse.ArgumentParser, option: str, text: str, width: int) -> list[list[str | None]]:
    try:
        items = json.loads(text)
    except json.JSONDecodeError as exc:
        parser.error(f"{option}: not JSON ({exc})")
    if not isinstance(items, list) or not items or not all(isinstance(i, list) and len(i) == width for i in items):
        parser.error(f"{option}: a non-empty JSON list of {width}-item lists")
    return [[None if v is None else str(v) for v in item] for item in items]


def main(argv: list[str] | None = None) -> int:
    from labkit.core import memory

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write every count here as JSON")
    parser.add_argument("--one", nargs=2, metavar=("STAGE", "PRECISION"),
                        help=f"count one step in this process and print it (STAGE of {STAGES}, PRECISION of "
                             f"{PRECISIONS})")
    parser.add_argument("--counts", metavar="JSON",
                        help="several --one counts, one after another in this process, a JSON line each: a list "
                             "of [STAGE, PRECISION, OPTIMIZER or null]")
    parser.add_argument("--peak", nargs=3, metavar=("STAGE", "PRECISION", "SUB_GROUP_SIZE"),
                        help="the bytes one step allocates at its peak, in this process (STAGE 0-3, or torch: "
                             "torch.optim.Adam's): as JSON")
    parser.add_argument("--peaks", metavar="JSON",
                        help="several --peak measurements, one after another in this process, a JSON line each: a "
                             "list of [STAGE, PRECISION, SUB_GROUP_SIZE, OPTIMIZER or null]")
    parser.add_argument("--world-size", type=int, default=1, help="with --peak(s): ranks (each started alike)")
    parser.add_argument("--rank", type=int, default=0, help="with --peak(s): this process's rank")
    parser.add_argument("--port", type=int, help="with --peak(s): the rendezvous port every rank shares")
    parser.add_argument("--optimizer", choices=memory.STEP_OPTIMIZERS,
                        help="the basic optimizer (torch_adam: foreach, as on a GPU); default: DeepSpeed's "
                             "fused_adam, plain PyTorch's (STAGE torch) torch_adam; --peak torch takes torch_adam only")
    args = parser.parse_args(argv)
    peaks = ([[*args.peak, args.optimizer]] if args.peak
             else _json_list(parser, "--peaks", args.peaks, 4) if args.peaks else [])
    if peaks:
        for stage, precision, size, optimizer in peaks:
            if not _peak_is_valid(str(stage), str(precision), str(size), optimizer, args.world_size):
                parser.error(f"--peak STAGE ({', '.join(STAGES)}) PRECISION ({PRECISIONS}) SUB_GROUP_SIZE (elements, "
                             f">= 0) [OPTIMIZER of {memory.STEP_OPTIMIZERS}] (torch: fp32 at one rank, its sub-group "
                             f"size ignored, torch_adam): not {[stage, precision, size, optimizer]}")
        if args.world_size > 1 and args.port is None:
            parser.error("--world-size > 1 needs --port, the same on every rank")
        for stage, precision, size, optimizer in peaks:
            print(json.dumps(_peak(str(stage), str(precision), str(size), optimizer, args.rank, args.world_size,
                                   args.port)), flush=True)
        return 0
    counts = ([[*args.one, args.optimizer]] if args.one
              else _json_list(parser, "--counts", args.counts, 3) if args.counts else [])
    if counts:
        for stage, precision, optimizer in counts:
            if not _count_is_valid(str(stage), str(precision), optimizer):
                parser.error(f"STAGE must be one of {STAGES} and PRECISION one of {PRECISIONS}, OPTIMIZER one of "
                             f"{memory.STEP_OPTIMIZERS} (torch: fp32, the plain loop's parameters, with one of "
                             f"{PLAIN_OPTIMIZERS}): not {[stage, precision, optimizer]}")
        for stage, precision, optimizer in counts:
            print(json.dumps(_count(str(stage), str(precision), optimizer)), flush=True)
        return 0
    if not args.out:
        parser.error("--out, --one, --counts, --peak or --peaks is required")
    result = measure()
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for c in result["counts"]:
        print(f"stage {c['stage']:>5} {c['precision']} {c['optimizer']:>10}: {c['bytes_per_param']:6.1f} B per "
              f"owned parameter ({c['optimizer_class']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

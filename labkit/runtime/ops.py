"""DeepSpeed's JIT ops: build them once, up front (`python -m labkit.runtime.ops [BUILDER ...]`), and decide which
Adam runs.

DeepSpeed compiles cpu_adam, fused_adam and (on CPU) the shared-memory comm op the first
time a run needs them, 30-90 s each. Built here into TORCH_EXTENSIONS_DIR, every later
run (and test) loads them from that cache instead of stalling its first step.

On GPUs, FusedAdam is a CUDA build: it needs an nvcc whose CUDA release matches torch's. Most
pip-based GPU setups have the driver only. There, runs without offload use torch's Adam through
DeepSpeed (`"torch_adam": true`). CPU Adam (ZeRO-Offload's optimizer) is a C++ extension on every
accelerator: DeepSpeed 0.19.8's CUDA accelerator takes `CPUAdamBuilder` from `op_builder/cpu`
(accelerator/cuda_accelerator.py:384-388), a `CppExtension` that g++ builds, so offload runs
DeepSpeed's CPU Adam wherever a C++ compiler is found, nvcc or not. Each run records which
optimizer ran (`optimizer_impl` in its `ready` and `done` records).

TORCH_CUDA_ARCH_LIST: DeepSpeed 0.19.8 parses every entry with int() (op_builder/builder.py:710),
so the arch-specific entries CUDA images set ("9.0a", "10.0f") stop every CUDA op build with
`ValueError: invalid literal for int()`. `deepspeed_arch_list` gives the list with those suffixes
stripped; `make ops` and every GPU run's ranks (labkit.launch.launcher) use that same list, since
the JIT cache key of an op includes its -gencode flags.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_EXTENSIONS_DIR = Path(__file__).resolve().parents[2] / ".cache" / "torch_extensions"


# The builders labkit's runs use, by DeepSpeed's class names.
BUILDERS = ("CPUAdamBuilder", "FusedAdamBuilder", "ShareMemCommBuilder")
# What `optimizer_impl` can say: DeepSpeed's fused CUDA (or CPU) Adam, its CPU Adam for ZeRO-Offload,
# torch's Adam run by DeepSpeed, torch's SGD.
OPTIMIZER_IMPLS = ("fused_adam", "cpu_adam", "torch_adam", "torch_sgd")


def interpreter_path(path: str | None) -> str:
    """`path` (a PATH value) with this interpreter's scripts first, once. DeepSpeed's JIT op loads run `ninja` from
    PATH, and another ninja than the one that built the cache rebuilds the op (a system ninja 1.11 and the venv's
    1.13 each take the other's build for stale: ~20 s per op, and the next process with the other one rebuilds it
    back). Every process that loads DeepSpeed's ops gets this PATH: the ranks (launcher), `make ops`, tests."""
    bin_dir = str(Path(sys.executable).parent)
    return os.pathsep.join([bin_dir] + [p for p in (path or "").split(os.pathsep) if p and p != bin_dir])


def cuda_ops_buildable() -> tuple[bool, str]:
    """Whether DeepSpeed can build its CUDA ops here, by DeepSpeed's own check (an nvcc under CUDA_HOME
    whose release matches torch's CUDA), and why not."""
    try:
        from deepspeed.ops.op_builder.builder import assert_no_cuda_mismatch

        assert_no_cuda_mismatch("labkit")
        return True, "nvcc matches torch's CUDA"
    except Exception as exc:  # MissingCUDAException, CUDAMismatchException, no torch CUDA at all
        return False, f"{type(exc).__name__}: {exc}".strip()


def host_compiler() -> str | None:
    """The C++ compiler torch's CppExtension builds with (torch.utils.cpp_extension: $CXX, else `c++`), or None."""
    return shutil.which(os.environ.get("CXX", "c++"))


def choose_optimizer_impl(*, example: str, optimizer: str, offload: bool, accelerator: str,
                          cuda_ops: bool, cpu_ops: bool = True) -> str:
    """Which optimizer a run's ranks use. Pure: `cuda_ops` is `cuda_ops_buildable()[0]` and `cpu_ops`
    `host_compiler() is not None` on the ranks' host."""
    if optimizer == "sgd":
        return "torch_sgd"
    if example == "pytorch":
        return "torch_adam"  # the plain loop: torch.optim.Adam
    if offload:
        # CPU Adam is a C++ extension on every accelerator (g++, no nvcc); without a compiler: torch's.
        return "cpu_adam" if cpu_ops else "torch_adam"
    if accelerator == "cuda" and not cuda_ops:
        return "torch_adam"  # no nvcc to build FusedAdam: torch's Adam, through DeepSpeed
    return "fused_adam"


def deepspeed_arch_list(value: str | None) -> tuple[str | None, str | None]:
    """(TORCH_CUDA_ARCH_LIST that DeepSpeed 0.19.8 can parse, a note on what changed or None). Pure.

    DeepSpeed sorts the entries by `int()` of each dotted part (op_builder/builder.py:710), so "9.0a" (sm_90a)
    and "10.0f" raise ValueError: the suffix is stripped ("9.0"), "+PTX" kept, duplicates dropped. An unset or
    already parseable list is returned as it is."""
    if value is None or not value.strip():
        return value, None
    entries = [e.strip() for e in value.replace(" ", ";").split(";") if e.strip()]
    fixed: list[str] = []
    for entry in entries:
        base, plus, ptx = entry.partition("+")
        match = re.fullmatch(r"(\d+)\.(\d+)[a-zA-Z]*", base)
        cleaned = f"{match.group(1)}.{match.group(2)}{plus}{ptx}" if match else entry
        if cleaned not in fixed:
            fixed.append(cleaned)
    new = ";".join(fixed)
    if new == ";".join(entries):
        return value, None
    return new, (f"TORCH_CUDA_ARCH_LIST {value!r} -> {new!r}: DeepSpeed 0.19.8 parses each entry with int() "
                 "(op_builder/builder.py:710) and cannot read arch-specific suffixes such as 'a' or 'f'; the ops "
                 "and every run's ranks use this list")


def with_optimizer_impl(ds_config: dict[str, Any], impl: str) -> dict[str, Any]:
    """The DeepSpeed config that makes DeepSpeed run `impl` (a copy; unchanged unless torch_adam is needed)."""
    optimizer = ds_config.get("optimizer") or {}
    if impl != "torch_adam" or optimizer.get("type") != "Adam":
        return ds_config
    config = {**ds_config, "optimizer": {**optimizer, "params": {**optimizer.get("params", {}), "torch_adam": True}}}
    if (ds_config.get("zero_optimization") or {}).get("offload_optimizer"):
        config["zero_force_ds_cpu_optimizer"] = False  # ZeRO-Offload would insist on DeepSpeed's CPU Adam
    return config


def build_all(names: list[str] | None = None) -> list[str]:
    """Build (or load) `names` (default: every one of BUILDERS) one after the other; returns those built. Separate
    processes may build different ops at once (`python -m labkit.runtime.ops CPUAdamBuilder`): each op has its own
    build directory and lock."""
    unknown = sorted(set(names or ()) - set(BUILDERS))
    if unknown:
        raise SystemExit(f"unknown op builder(s) {unknown}: one of {list(BUILDERS)}")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(DEFAULT_EXTENSIONS_DIR))
    os.environ["PATH"] = interpreter_path(os.environ.get("PATH"))  # the venv's ninja, as the ranks use
    from labkit.runtime.ds_import import import_deepspeed

    import_deepspeed()
    from deepspeed.accelerator import get_accelerator

    from labkit.runtime.build_locks import report_stale_locks

    report_stale_locks(os.environ["TORCH_EXTENSIONS_DIR"], clear=True)
    accelerator = get_accelerator()
    names = list(names or BUILDERS)
    if accelerator._name == "cuda":
        arch_list, note = deepspeed_arch_list(os.environ.get("TORCH_CUDA_ARCH_LIST"))
        if note:
            os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list or ""
            print(note)
        buildable, why = cuda_ops_buildable()
        if not buildable:
            print(f"FusedAdam not built ({why}): runs without offload use torch's Adam through DeepSpeed "
                  f"(optimizer_impl=torch_adam). Install a CUDA toolkit matching torch's CUDA for FusedAdam.")
            names = [n for n in names if n != "FusedAdamBuilder"]
        if host_compiler() is None:
            print("CPU Adam not built: no C++ compiler (c++ or $CXX); offload runs use torch's Adam on the host")
            names = [n for n in names if n != "CPUAdamBuilder"]
    built = []
    for name in names:
        builder = accelerator.create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            print(f"{name}: not used by the {accelerator._name} accelerator, skipped")
            continue
        start = time.perf_counter()
        print(f"{name}: building or loading (a first build takes 30-90 s)...", flush=True)
        builder.load(verbose=False)
        print(f"{name}: ready in {time.perf_counter() - start:.1f} s")
        built.append(name)
    return built


if __name__ == "__main__":
    build_all(sys.argv[1:])
    sys.exit(0)

"""DeepSpeed's JIT ops: build them once, up front (`python -m labkit.runtime.ops`), and decide which Adam runs.

DeepSpeed compiles cpu_adam, fused_adam and (on CPU) the shared-memory comm op the first
time a run needs them, 30-90 s each. Built here into TORCH_EXTENSIONS_DIR, every later
run (and test) loads them from that cache instead of stalling its first step.

On GPUs, FusedAdam and CPU Adam are CUDA builds: they need an nvcc whose CUDA release matches
torch's. Most pip-based GPU setups have the driver only. There, runs use torch's Adam through
DeepSpeed (`"torch_adam": true`), and each run records which optimizer ran (`optimizer_impl`
in its `ready` and `done` records); `make ops` skips the CUDA builds instead of failing.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from labkit.launch.launcher import DEFAULT_EXTENSIONS_DIR

# The builders labkit's runs use, by DeepSpeed's class names.
BUILDERS = ("CPUAdamBuilder", "FusedAdamBuilder", "ShareMemCommBuilder")
# What `optimizer_impl` can say: DeepSpeed's fused CUDA (or CPU) Adam, its CPU Adam for ZeRO-Offload,
# torch's Adam run by DeepSpeed, torch's SGD.
OPTIMIZER_IMPLS = ("fused_adam", "cpu_adam", "torch_adam", "torch_sgd")


def cuda_ops_buildable() -> tuple[bool, str]:
    """Whether DeepSpeed can build its CUDA ops here, by DeepSpeed's own check (an nvcc under CUDA_HOME
    whose release matches torch's CUDA), and why not."""
    try:
        from deepspeed.ops.op_builder.builder import assert_no_cuda_mismatch

        assert_no_cuda_mismatch("labkit")
        return True, "nvcc matches torch's CUDA"
    except Exception as exc:  # MissingCUDAException, CUDAMismatchException, no torch CUDA at all
        return False, f"{type(exc).__name__}: {exc}".strip()


def choose_optimizer_impl(*, example: str, optimizer: str, offload: bool, accelerator: str,
                          cuda_ops: bool) -> str:
    """Which optimizer a run's ranks use. Pure: `cuda_ops` is `cuda_ops_buildable()[0]` on the ranks' host."""
    if optimizer == "sgd":
        return "torch_sgd"
    if example == "pytorch":
        return "torch_adam"  # the plain loop: torch.optim.Adam
    if accelerator == "cuda" and not cuda_ops:
        return "torch_adam"  # no nvcc to build FusedAdam / CPU Adam: torch's, through DeepSpeed
    return "cpu_adam" if offload else "fused_adam"


def with_optimizer_impl(ds_config: dict[str, Any], impl: str) -> dict[str, Any]:
    """The DeepSpeed config that makes DeepSpeed run `impl` (a copy; unchanged unless torch_adam is needed)."""
    optimizer = ds_config.get("optimizer") or {}
    if impl != "torch_adam" or optimizer.get("type") != "Adam":
        return ds_config
    config = {**ds_config, "optimizer": {**optimizer, "params": {**optimizer.get("params", {}), "torch_adam": True}}}
    if (ds_config.get("zero_optimization") or {}).get("offload_optimizer"):
        config["zero_force_ds_cpu_optimizer"] = False  # ZeRO-Offload would insist on DeepSpeed's CPU Adam
    return config


def build_all() -> list[str]:
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(DEFAULT_EXTENSIONS_DIR))
    # The venv's ninja, as the runs use (launcher.build_command): another one triggers rebuilds.
    bin_dir = os.path.dirname(sys.executable)
    os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
    from labkit.runtime.ds_import import import_deepspeed

    import_deepspeed()
    from deepspeed.accelerator import get_accelerator

    from labkit.runtime.build_locks import report_stale_locks

    report_stale_locks(os.environ["TORCH_EXTENSIONS_DIR"], clear=True)
    accelerator = get_accelerator()
    if accelerator._name == "cuda":
        buildable, why = cuda_ops_buildable()
        if not buildable:
            print(f"CUDA ops not built ({why}). Runs use torch's Adam through DeepSpeed (optimizer_impl="
                  f"torch_adam in their records). Install a CUDA toolkit matching torch's CUDA for FusedAdam.")
            return []
    built = []
    for name in BUILDERS:
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
    build_all()
    sys.exit(0)

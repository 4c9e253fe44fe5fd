"""What this machine offers for ranks, asked of DeepSpeed's accelerator API (never torch.cuda)."""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from typing import Any

from labkit.runtime.ds_import import import_deepspeed

# Dense peak FLOP/s of common training GPUs (vendor datasheets, tensor-core figures "with sparsity" halved), by
# the precision the run uses. Variants first: a name is matched by all the words of a key, and an "NVIDIA H100
# NVL" or "H100 PCIe" has fewer SMs and lower clocks than the SXM part (NVIDIA H100 datasheet: SXM 1,979 / NVL
# 1,671 / PCIe 1,513 TFLOP/s bf16 with sparsity; FP32 67 / 60 / 51; the H200 NVL has the H100 NVL's figures).
# Unknown devices fall back to a measured matmul peak (`measured_matmul_flops`).
GPU_PEAK_FLOPS: dict[tuple[str, ...], dict[str, float]] = {
    ("H100", "NVL"): {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12},
    ("H100", "PCIe"): {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12},
    ("H200", "NVL"): {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12},
    ("H200",): {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    ("H100",): {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},  # SXM (e.g. "NVIDIA H100 80GB HBM3")
    ("A100",): {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    ("L4",): {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12},
    ("A10G",): {"bf16": 70e12, "fp16": 70e12, "fp32": 31.2e12},
    ("A10",): {"bf16": 125e12, "fp16": 125e12, "fp32": 31.2e12},  # NVIDIA A10 datasheet (labkit.runtime.hardware)
    ("T4",): {"bf16": 0.0, "fp16": 65e12, "fp32": 8.1e12},  # Turing has no bf16 tensor cores
    ("V100",): {"bf16": 0.0, "fp16": 125e12, "fp32": 15.7e12},
}
MATMUL_SIZE_GPU = 8192  # a measured peak needs a matmul big enough to fill the device (2 x 8192^3 = 1.1 TFLOP)
MATMUL_SIZE_CPU = 1024


@dataclass(frozen=True)
class Devices:
    accelerator: str      # DeepSpeed accelerator name: "cuda", "cpu", ...
    device_count: int     # accelerator devices (GPUs); for "cpu" the NUMA nodes DeepSpeed sees
    max_ranks: int        # ranks one machine can host: one per GPU, or one per core on CPU
    backend: str          # communication backend: "nccl", "gloo", ...
    bf16: bool
    fp16: bool
    device_name: str
    total_memory_bytes: int  # per device; host RAM on CPU
    visible_devices_env: str = "CUDA_VISIBLE_DEVICES"  # the accelerator's device-selection variable

    @property
    def is_cpu(self) -> bool:
        return self.accelerator == "cpu"

    @property
    def kind_plural(self) -> str:
        return "CPU cores" if self.is_cpu else f"{self.accelerator} devices"

    def peak_flops(self, precision: str) -> float | None:
        """Datasheet peak for a known GPU, else None (the caller measures a matmul peak)."""
        return datasheet_peak_flops(self.device_name, precision)


def datasheet_peak_flops(device_name: str, precision: str) -> float | None:
    """Datasheet peak of a known GPU by its name, else None."""
    # Whole words only: "L4" must not match an "NVIDIA L40S"; every word of a variant's key ("H100", "NVL").
    words = {w.lower() for w in re.split(r"[^A-Za-z0-9]+", device_name)}
    for key, table in GPU_PEAK_FLOPS.items():
        if all(k.lower() in words for k in key):
            return table.get(precision) or None
    return None


def rank_device_name(accelerator: str, local_rank: int) -> str:
    """The name of a rank's own device, asked in the rank (which already holds its context): ranks never
    run `detect_devices()`, whose probe would open another context, or be refused in exclusive mode."""
    if accelerator == "cpu":
        return _cpu_model()
    import torch

    module = torch.get_device_module(accelerator)
    return module.get_device_name(local_rank) if hasattr(module, "get_device_name") else accelerator


def native_bf16(compute_capability: tuple[int, int] | list[int]) -> bool:
    """Whether a CUDA device computes bf16 natively: Ampere (8.0) and later. torch's `is_bf16_supported()`
    also counts emulation, so it says yes on V100 (7.0) and T4 (7.5), where bf16 runs many times slower."""
    return tuple(compute_capability) >= (8, 0)


@functools.lru_cache(maxsize=1)
def detect_devices() -> Devices:
    import_deepspeed()
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    if accel._name == "cpu":
        return Devices(
            accelerator="cpu",
            device_count=accel.device_count(),
            max_ranks=os.cpu_count() or 1,
            backend=accel.communication_backend_name(),
            bf16=bool(accel.is_bf16_supported()),
            fp16=bool(accel.is_fp16_supported()),
            device_name=_cpu_model(),
            total_memory_bytes=_host_memory(),
            visible_devices_env=accel.visible_devices_envs()[0],
        )
    # GPUs: asked in a child process. Device properties and the bf16 check initialise the device
    # runtime in the asking process, and this one is the Jupyter kernel: it would keep a context
    # (hundreds of MB) on GPU 0 beside rank 0 for the whole session, or be refused outright on
    # GPUs in exclusive-process mode.
    return Devices(**_probe_in_child())


# Runs in a child: everything the lab needs to know about the GPUs, as JSON on stdout.
_PROBE = """
import json
from deepspeed.accelerator import get_accelerator
import torch
accel = get_accelerator()
count = accel.device_count()
module = torch.get_device_module(accel._name)
print(json.dumps({
    "accelerator": accel._name, "device_count": count, "max_ranks": count,
    "backend": accel.communication_backend_name(),
    # CUDA: the compute capability, not is_bf16_supported(), which counts emulation and allocates on GPU 0.
    "compute_capability": list(torch.cuda.get_device_capability(0))
    if accel._name == "cuda" and count and not torch.version.hip else None,
    "bf16": bool(accel.is_bf16_supported()) if accel._name != "cuda" or torch.version.hip else False,
    "fp16": bool(accel.is_fp16_supported()),
    # DeepSpeed's accelerator API has no device-name call; torch's per-backend module does.
    "device_name": module.get_device_name(0) if count and hasattr(module, "get_device_name") else accel._name,
    "total_memory_bytes": int(accel.total_memory(0)) if count else 0,
    "visible_devices_env": accel.visible_devices_envs()[0],
}))
"""


def _probe_in_child() -> dict:
    import json
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise RuntimeError(f"could not query the accelerator's devices:\n{result.stderr[-2000:]}")
    probed = json.loads(result.stdout.strip().splitlines()[-1])
    capability = probed.pop("compute_capability", None)
    if capability is not None:
        probed["bf16"] = native_bf16(capability)
    return probed


def _host_memory() -> int:
    import psutil

    return int(psutil.virtual_memory().total)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU"


def measured_matmul_flops(device: str, dtype_name: str, *, size: int | None = None, accelerator: Any = None,
                          seconds: float = 0.3) -> tuple[float, str]:
    """(dense matmul FLOP/s on `device`, how it was measured): the practical peak where no datasheet figure applies.

    On a GPU an 8192 x 8192 product (a small one leaves most SMs idle and measures launch overhead), timed with
    the accelerator's events over enough products to last ~`seconds` (no host clock around asynchronous work);
    on CPU a 1024 x 1024 one with the host clock (CPU ops are synchronous)."""
    import time

    import torch

    if accelerator is None:
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
    events = not accelerator.is_synchronized_device()
    n = size or (MATMUL_SIZE_GPU if events else MATMUL_SIZE_CPU)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b  # warm-up: kernel selection, clocks up
    if events:
        start, end = accelerator.Event(enable_timing=True), accelerator.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        reps = max(3, min(200, int(seconds * 1000 / max(start.elapsed_time(end), 1e-3))))
        start.record()
        for _ in range(reps):
            a @ b
        end.record()
        end.synchronize()
        elapsed = start.elapsed_time(end) / 1000.0
        how = f"measured {n}x{n} {dtype_name} matmul, {reps} timed with device events"
    else:
        reps, began = 0, time.perf_counter()
        while time.perf_counter() - began < seconds:
            a @ b
            reps += 1
        elapsed = time.perf_counter() - began
        how = f"measured {n}x{n} {dtype_name} matmul"
    return 2 * n**3 * reps / elapsed, how

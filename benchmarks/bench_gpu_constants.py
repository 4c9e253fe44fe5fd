"""The constants labkit's step-time predictor otherwise takes a priori (docs/predict.md), measured on this machine's
GPU: GEMM throughput vs shape per dtype, device memory bandwidth, host <-> device copies, Adam's rate (DeepSpeed's
CPU Adam on the host, torch's fused and foreach AdamW on the GPU), ZeRO-3's per-module host cost on a real 1-rank
DeepSpeed engine, and the kernel launch overhead.

    python benchmarks/bench_gpu_constants.py --out data/reference-h100-80gb/gpu_constants.json

Self-contained (torch, deepspeed, labkit; no network), <= 90 s on one H100 including DeepSpeed's init: every
section checks the time left (`--budget-s`) and records itself as skipped, with the reason, rather than overrun.
Without a CUDA GPU the GPU sections are recorded as skipped and the host ones still run (CPU Adam if its op builds,
ZeRO-3 on gloo, the per-op dispatch cost): that is the path tests/runtime/test_bench_gpu_constants.py runs.
The JSON (format "labkit-gpu-constants/1", with its `source`: "measured on <GPU> in this lab, <date>") is meant to
be read by labkit.runtime.hardware as a GPU preset's measured constants.

What each figure is:
- gemm: `a @ b`, a (M x K) and b (K x N) random, torch's default layout; per shape the median over 7 repeats of CUDA
  event time / calls (enough calls per repeat for ~1 ms, so a small GEMM's figure is its throughput when the queue
  is full). Shapes: squares and the transformer GEMMs of data/published (tokens = micro-batch x sequence; QKV
  (T, 3h, h), MLP up (T, 4h, h) and its weight gradient (4h, h, T), whose K is the tokens). fp32 with TF32 off.
- memory: `dst.copy_(src)` of 1 GiB, 2 bytes moved per byte copied.
- host_copy: 256 MiB each way, pinned and pageable host memory.
- cpu_adam: DeepSpeedCPUAdam.step() (adamw) over fp32 parameters on the host, all the host's threads; the op is
  JIT-built by g++ in a child process started first (skipped if it is not built within --cpu-adam-build-s). Beside
  it, ZeRO-Offload's two host passes over the same number of parameters: the fp32 gradients scaled in place and the
  fp32 parameters copied into a bf16 buffer (labkit.study.predict: CPU_ADAM_BYTES_PER_PARAM's comment).
- gpu_adamw: torch.optim.AdamW(fused=True) and (foreach=True), fp32 parameters on the GPU.
- attention: torch's scaled_dot_product_attention, causal, bf16 (fp16 on a GPU without a bf16 peak), (batch, heads,
  tokens, head dim) over a grid of GPT and LLaMA shapes, the forward and the forward + backward each timed with CUDA
  events under FlashAttention-2 where it runs, else the memory-efficient kernel (`backend` says which); each shape's
  share of the preset's dense peak counts the work as the predictor does (labkit.study.flops.attention_share), and
  the median share is `efficiency` (the best until 2026-11-28, as for the GEMMs), which replaces the preset's
  published or assumed one
  (labkit.runtime.hardware.FUSED_ATTENTION_EFFICIENCY).
- zero3: deepspeed.initialize at 1 rank (nccl on GPU, gloo on CPU), a stack of Linear(64, 64) modules at two depths,
  ZeRO stage 3 (every parameter fetched: persistence threshold 0) and stage 0, micro-steps timed with the device
  synchronized; the per-module cost is the slope over depth of stage 3 minus stage 0 (fixed costs cancel), the
  per-micro-step fixed cost its intercept; a parameter-free module's (ZeRO-3 hooks every module) from a ReLU after
  each Linear at the larger depth.
- launch: the host's time per tiny op (`x.add_(1)` on a 1-element tensor) in a long loop: launch + dispatch.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FORMAT = "labkit-gpu-constants/1"
SECTIONS = ("gemm", "memory", "host_copy", "gpu_adamw", "attention", "launch", "cpu_adam", "zero3")
MiB = 1 << 20


class Clock:
    """The script's time budget: each section asks for what it needs and is skipped when it is not left."""

    def __init__(self, budget_s: float) -> None:
        self.start = time.perf_counter()
        self.budget_s = budget_s

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)


def skipped(reason: str) -> dict[str, Any]:
    return {"skipped": reason}


def gemm_shapes(quick: bool) -> list[tuple[str, int, int, int]]:
    """(label, M, N, K): squares, and per hidden size h and tokens T the transformer's forward GEMMs and the
    weight gradient whose K is the tokens (GPT-2 768 / 1600, the 10B's 4096, GPT-3's 12288; T from micro-batch x
    sequence of data/published: 512 to 8192)."""
    squares = (256, 1024, 4096) if quick else (256, 512, 1024, 2048, 4096, 8192)
    shapes = [(f"square {n}", n, n, n) for n in squares]
    hiddens, tokens = ((768,), (512,)) if quick else ((768, 1600, 4096, 12288), (512, 2048, 8192))
    for h in hiddens:
        for t in tokens:
            shapes += [(f"qkv h={h} T={t}", t, 3 * h, h), (f"mlp-up h={h} T={t}", t, 4 * h, h),
                       (f"mlp-up-wgrad h={h} T={t}", 4 * h, h, t)]
    return shapes


def cuda_time(fn: Callable[[], Any], repeats: int, target_s: float = 1e-3) -> float:
    """Median seconds per call of `fn` on the current CUDA stream (events), over `repeats` repeats of as many
    calls as fill ~`target_s`."""
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    once = max(start.elapsed_time(end) / 1e3, 1e-7)
    calls = max(1, min(200, int(target_s / once)))
    times = []
    for _ in range(repeats):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return float(statistics.median(times))


def measure_gemm(clock: Clock, quick: bool) -> dict[str, Any]:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 is plain FP32, the preset's "fp32" peak
    fp32_max_flops = 5e11  # fp32 shapes above this are left out for time (~10 ms each on an H100)
    out: dict[str, Any] = {"layout": "a @ b, row-major (M x K) @ (K x N)", "tf32": False,
                           "fp32_max_flops_per_gemm": fp32_max_flops}
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
        rows: list[dict[str, Any]] = []
        for label, m, n, k in gemm_shapes(quick):
            flops = 2.0 * m * n * k
            if name == "fp32" and flops > fp32_max_flops:
                continue
            if clock.left() < 45:  # leave time for the host sections and DeepSpeed
                rows.append({"label": label, "m": m, "n": n, "k": k, "skipped": "time budget"})
                continue
            a = torch.randn(m, k, device="cuda", dtype=dtype)
            b = torch.randn(k, n, device="cuda", dtype=dtype)
            seconds = cuda_time(functools.partial(torch.matmul, a, b), repeats=7)
            rows.append({"label": label, "m": m, "n": n, "k": k, "seconds": seconds, "flops_per_s": flops / seconds})
            del a, b
        measured = [r["flops_per_s"] for r in rows if "flops_per_s" in r]
        out[name] = {"shapes": rows, "best_flops_per_s": max(measured) if measured else None}
    torch.cuda.empty_cache()
    return out


def measure_memory(quick: bool) -> dict[str, Any]:
    import torch

    size = (256 if quick else 1024) * MiB
    src = torch.empty(size, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    seconds = cuda_time(functools.partial(dst.copy_, src), repeats=7, target_s=0)
    del src, dst
    torch.cuda.empty_cache()
    return {"op": "dst.copy_(src)", "bytes": size, "seconds": seconds, "copy_bytes_per_s": 2 * size / seconds}


def measure_host_copy(quick: bool) -> dict[str, Any]:
    import torch

    size = (64 if quick else 256) * MiB
    device = torch.empty(size, dtype=torch.uint8, device="cuda")
    out: dict[str, Any] = {"bytes": size}
    for kind in ("pinned", "pageable"):
        host = torch.empty(size, dtype=torch.uint8, pin_memory=kind == "pinned")
        host.fill_(1)  # touch every page: a first-touch page fault is not a copy
        h2d = cuda_time(functools.partial(device.copy_, host, non_blocking=True), repeats=5, target_s=0)
        d2h = cuda_time(functools.partial(host.copy_, device, non_blocking=True), repeats=5, target_s=0)
        out[f"{kind}_h2d_bytes_per_s"] = size / h2d
        out[f"{kind}_d2h_bytes_per_s"] = size / d2h
        del host
    del device
    torch.cuda.empty_cache()
    return out


def adam_params(n: int, tensors: int, device: str) -> list[Any]:
    import torch

    params = []
    for _ in range(tensors):
        p = torch.nn.Parameter(torch.randn(n // tensors, device=device))
        p.grad = torch.randn_like(p)
        params.append(p)
    return params


def measure_gpu_adamw(quick: bool) -> dict[str, Any]:
    import torch

    n, tensors = (4_000_000, 40) if quick else (100_000_000, 200)
    out: dict[str, Any] = {"params": n, "tensors": tensors, "dtype": "fp32",
                           "note": "AdamW reads parameter, gradient, two moments and writes three: 28 bytes/param"}
    for impl in ("fused", "foreach"):
        params = adam_params(n, tensors, "cuda")
        opt = torch.optim.AdamW(params, lr=1e-3, fused=impl == "fused", foreach=impl == "foreach")
        seconds = cuda_time(opt.step, repeats=5, target_s=0)
        out[f"{impl}_s_per_param"] = seconds / n
        out[f"{impl}_bytes_per_s"] = 28 * n / seconds
        del opt, params
    torch.cuda.empty_cache()
    return out


def attention_shapes(quick: bool) -> list[tuple[int, int, int, int]]:
    """(batch, heads, tokens, head dim): GPT-2 small's heads at 1k tokens, GPT-3 and LLaMA 7B's at 2k-8k."""
    if quick:
        return [(2, 4, 256, 64)]
    return [(8, 12, 1024, 64), (4, 32, 2048, 128), (2, 32, 4096, 128), (1, 32, 8192, 128)]


def measure_attention(clock: Clock, quick: bool) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from labkit.runtime import hardware
    from labkit.study import flops

    preset = hardware.preset_for(torch.cuda.get_device_name())
    gpu = hardware.GPUS[preset] if preset else None
    # bf16 where the GPU has a bf16 peak, else fp16 (Volta and Turing)
    name = "bf16" if gpu is None or gpu.peak_flops.get("bf16") else "fp16"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[name]
    peak = gpu.peak(name) if gpu else None
    rows: list[dict[str, Any]] = []
    for batch, heads, tokens, dim in attention_shapes(quick):
        row: dict[str, Any] = {"batch": batch, "heads": heads, "tokens": tokens, "dim": dim, "causal": True}
        if clock.left() < 45:  # leave time for the host sections and DeepSpeed
            rows.append({**row, "skipped": "time budget"})
            continue
        q, k, v = (torch.randn(batch, heads, tokens, dim, device="cuda", dtype=dtype, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn_like(q)

        def forward(q: Any = q, k: Any = k, v: Any = v) -> Any:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def both(q: Any = q, k: Any = k, v: Any = v, grad: Any = grad) -> Any:
            # autograd.grad, not backward: no accumulation into .grad, which would add three copies per call
            return torch.autograd.grad(forward(), (q, k, v), grad)

        # the fused kernel torch prefers where it runs (FlashAttention-2 on Ampere and later), else the
        # memory-efficient one: which ran is recorded
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            try:
                with sdpa_kernel(backend):
                    with torch.no_grad():
                        row["forward_s"] = cuda_time(forward, repeats=7)
                    row["forward_backward_s"] = cuda_time(both, repeats=7)
                row["backend"] = backend.name
                break
            except RuntimeError as exc:  # "No available kernel": this backend cannot run this shape here
                row[f"{backend.name}_unavailable"] = str(exc).splitlines()[0][:200]
        if "forward_backward_s" in row and peak:
            row["share_of_peak"] = flops.attention_share(batch * heads, tokens, dim, row["forward_backward_s"], peak)
        rows.append(row)
        del q, k, v, grad
    torch.cuda.empty_cache()
    shares = [r["share_of_peak"] for r in rows if "share_of_peak" in r]
    return {"op": f"F.scaled_dot_product_attention(q, k, v, is_causal=True), {name}", "dtype": name,
            "preset": preset, "peak_flops_per_s": peak, "shapes": rows,
            "efficiency": statistics.median(shares) if shares else None}  # the typical shape, as for the GEMMs


def measure_launch(cuda: bool, quick: bool) -> dict[str, Any]:
    import torch

    x = torch.zeros(1, device="cuda" if cuda else "cpu")
    calls = 2000 if quick else 20000
    for _ in range(100):
        x.add_(1)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            x.add_(1)
        sync()
        times.append((time.perf_counter() - start) / calls)
    return {"op": "x.add_(1), x of 1 element", "device": "cuda" if cuda else "cpu", "calls": calls,
            "launch_s": min(times)}


def extensions_env() -> dict[str, str]:
    """The environment DeepSpeed's JIT ops build and load in, as labkit's runs use it (labkit.runtime.ops)."""
    from labkit.runtime.ops import DEFAULT_EXTENSIONS_DIR, deepspeed_arch_list

    env = {"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(DEFAULT_EXTENSIONS_DIR)),
           "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])}
    arch, _ = deepspeed_arch_list(os.environ.get("TORCH_CUDA_ARCH_LIST"))
    if arch:
        env["TORCH_CUDA_ARCH_LIST"] = arch
    return env


_BUILD_CPU_ADAM = ("from deepspeed.accelerator import get_accelerator; "
                   "get_accelerator().create_op_builder('CPUAdamBuilder').load(verbose=False)")


def start_cpu_adam_build() -> subprocess.Popen[str] | str:
    """A child process that builds (or loads from the JIT cache) DeepSpeed's cpu_adam op, started first so that g++
    runs while the GPU sections run; or why not."""
    from labkit.runtime.ops import host_compiler

    if host_compiler() is None:
        return "no C++ compiler (c++ or $CXX): DeepSpeed's CPU Adam cannot be built"
    return subprocess.Popen([sys.executable, "-c", _BUILD_CPU_ADAM], env={**os.environ, **extensions_env()},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_cpu_adam_build(build: subprocess.Popen[str] | str, timeout_s: float) -> str | None:
    """None once the op is built, else why it is not."""
    if isinstance(build, str):
        return build
    try:
        log, _ = build.communicate(timeout=max(timeout_s, 0.1))
    except subprocess.TimeoutExpired:
        # The build's whole process group (python, ninja, g++), then the lock file it leaves: torch's build lock
        # would otherwise make every later run needing cpu_adam wait forever (labkit.runtime.build_locks).
        try:
            os.killpg(build.pid, signal.SIGKILL)
        except ProcessLookupError:  # it finished meanwhile
            pass
        build.communicate()
        from labkit.runtime.build_locks import report_stale_locks

        report_stale_locks(extensions_env()["TORCH_EXTENSIONS_DIR"], clear=True)
        return f"cpu_adam op not built within {timeout_s:.0f} s (--cpu-adam-build-s)"
    if build.returncode != 0:
        return f"cpu_adam op build failed: {log[-500:]}"
    return None


def measure_cpu_adam(quick: bool) -> dict[str, Any]:
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    n, tensors = (1_000_000, 10) if quick else (20_000_000, 40)
    params = adam_params(n, tensors, "cpu")
    opt = DeepSpeedCPUAdam(params, lr=1e-3, adamw_mode=True)
    opt.step()
    repeats = 3 if quick else 5
    seconds = host_median(opt.step, repeats)
    # ZeRO-Offload's two passes beside CPU Adam over the same fp32 partition (stage_1_and_2.py, 0.19.8): the
    # gradients scaled in place by a 0-d tensor (unscale_and_clip_grads, :3216) and the updated fp32 partition
    # copied into a 16-bit buffer (:3095; pinned there where a GPU is, pageable here: the copy is on the host alone)
    grad = torch.randn(n)
    scale = torch.tensor(1.5)
    fp32, bit16 = torch.randn(n), torch.empty(n, dtype=torch.bfloat16)
    unscale = host_median(lambda: grad.mul_(1.0 / scale), repeats)
    to_bit16 = host_median(lambda: bit16.copy_(fp32), repeats)
    return {"params": n, "tensors": tensors, "dtype": "fp32", "threads": torch.get_num_threads(),
            "cpu_cores": os.cpu_count(), "s_per_param": seconds / n, "bytes_per_s": 28 * n / seconds,
            "unscale_s_per_param": unscale / n, "to_bit16_s_per_param": to_bit16 / n,
            "note": "DeepSpeedCPUAdam (adamw_mode), 28 bytes/param as gpu_adamw; unscale: fp32 grad.mul_(1 / a 0-d "
                    "tensor), 8 bytes/param; to_bit16: bf16 buffer.copy_(fp32), 6 bytes/param"}


def host_median(fn: Callable[[], Any], repeats: int) -> float:
    """The median wall time of `repeats` calls of a host-only `fn`."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(statistics.median(times))


def measure_zero3(cuda: bool, quick: bool, clock: Clock) -> dict[str, Any]:
    """ZeRO-3's host cost per module at 1 rank: stage 3 minus stage 0, per module (the slope over two depths) and
    per micro-step (the intercept), forward + backward and the optimizer step, each timed with the device
    synchronized."""
    import logging

    import torch
    from torch import nn

    from labkit.launch.launcher import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    from labkit.runtime.ds_import import import_deepspeed

    import_deepspeed()
    import deepspeed
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    deepspeed.init_distributed("nccl" if cuda else "gloo", verbose=False)
    device = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    depths, steps, width = ((4, 12), 12, 64) if quick else ((16, 80), 30, 64)
    x = torch.randn(1, width, device=device)
    timings: dict[str, dict[str, float]] = {}
    lo, hi = depths
    # (stage, Linear modules, a parameter-free ReLU after each): ZeRO-3 hooks every submodule, with or without
    # parameters (deepspeed/runtime/zero/parameter_offload.py:_register_deepspeed_module, 0.19.8)
    for stage, depth, relu in [(s, d, r) for s in (0, 3) for d, r in ((lo, False), (hi, False), (hi, True))]:
        if clock.left() < 4:
            return skipped(f"time budget (done: {sorted(timings)})")
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()] if relu else [nn.Linear(width, width)]
        model = nn.Sequential(*layers)
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "SGD", "params": {"lr": 1e-3}}, "zero_allow_untested_optimizer": True,
                  "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                  "steps_per_print": 1 << 30}
        started = time.perf_counter()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        init_s = time.perf_counter() - started
        micro, step = [], []
        for _ in range(steps):
            sync()
            t0 = time.perf_counter()
            engine.backward(engine(x).sum())
            sync()
            t1 = time.perf_counter()
            engine.step()
            sync()
            micro.append(t1 - t0)
            step.append(time.perf_counter() - t1)
        keep = max(1, steps // 4)  # the first quarter warms up
        timings[f"stage{stage}_depth{depth}" + ("_relu" if relu else "")] = {
            "micro_step_s": float(statistics.median(micro[keep:])),
            "optimizer_step_s": float(statistics.median(step[keep:])), "init_s": init_s}
        del engine, model

    def slope(stage: int, key: str) -> float:
        return (timings[f"stage{stage}_depth{hi}"][key] - timings[f"stage{stage}_depth{lo}"][key]) / (hi - lo)

    def intercept(stage: int, key: str) -> float:
        return timings[f"stage{stage}_depth{lo}"][key] - lo * slope(stage, key)

    per_module = slope(3, "micro_step_s") - slope(0, "micro_step_s")

    def relu_cost(stage: int) -> float:
        return (timings[f"stage{stage}_depth{hi}_relu"]["micro_step_s"] - timings[f"stage{stage}_depth{hi}"][
            "micro_step_s"]) / hi

    return {"backend": "nccl" if cuda else "gloo", "module": f"nn.Linear({width}, {width})", "depths": list(depths),
            "micro_steps": steps, "timings": timings,
            "per_module_per_micro_step_s": per_module,
            "fetch_s": per_module / 2,  # fetched before its forward and before its backward: labkit's zero3_fetch_s
            "per_micro_step_s": intercept(3, "micro_step_s") - intercept(0, "micro_step_s"),
            "step_per_module_s": slope(3, "optimizer_step_s") - slope(0, "optimizer_step_s"),
            "step_fixed_s": intercept(3, "optimizer_step_s") - intercept(0, "optimizer_step_s"),
            "per_paramless_module_per_micro_step_s": relu_cost(3) - relu_cost(0)}


def device_info(cuda: bool) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"cuda": cuda, "cpu": platform.processor() or platform.machine(),
                            "cpu_cores": os.cpu_count()}
    try:
        model = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
        info["cpu"] = model[0] if model else info["cpu"]
    except OSError:
        pass
    if cuda:
        props = torch.cuda.get_device_properties(0)
        info.update(name=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                    memory_bytes=props.total_memory)
    else:
        info["name"] = f"CPU ({info['cpu']})"
    return info


def software() -> dict[str, Any]:
    import torch

    versions = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        from importlib.metadata import version

        versions["deepspeed"] = version("deepspeed")
    except Exception:  # not installed: the zero3 and cpu_adam sections say so
        versions["deepspeed"] = None
    return versions


def run_section(result: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]]) -> None:
    """One section into `result[name]`, its wall time beside it; a failure is recorded with its cause, and the
    other sections still run (the GPU time is too short to lose to one section)."""
    started = time.perf_counter()
    try:
        result[name] = fn()
    except Exception as exc:
        result[name] = skipped(f"failed: {type(exc).__name__}: {str(exc)[:400]}")
    result[name]["wall_s"] = round(time.perf_counter() - started, 3)
    print(f"[{time.perf_counter() - T0:5.1f} s] {name}: "
          f"{result[name].get('skipped', 'done')} ({result[name]['wall_s']:.1f} s)", flush=True)


T0 = time.perf_counter()


def measure(budget_s: float, quick: bool, cpu_adam_build_s: float, only: tuple[str, ...] = SECTIONS) -> dict[str, Any]:
    import torch

    os.environ.update(extensions_env())  # DeepSpeedCPUAdam loads the op the child process built
    clock = Clock(budget_s)
    build = start_cpu_adam_build() if "cpu_adam" in only else "not asked for"
    cuda = torch.cuda.is_available()
    info = device_info(cuda)
    date = time.strftime("%Y-%m-%d")
    result: dict[str, Any] = {
        "format": FORMAT, "source": f"measured on {info['name']} in this lab, {date}, "
                                    f"benchmarks/bench_gpu_constants.py", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": info, "software": software(), "budget_s": budget_s, "quick": quick,
        "load_average": list(os.getloadavg())}
    no_gpu = skipped("no CUDA GPU")
    gpu_sections: dict[str, Callable[[], dict[str, Any]]] = {
        "gemm": lambda: measure_gemm(clock, quick), "memory": lambda: measure_memory(quick),
        "host_copy": lambda: measure_host_copy(quick), "gpu_adamw": lambda: measure_gpu_adamw(quick),
        "attention": lambda: measure_attention(clock, quick)}
    for name, fn in gpu_sections.items():
        if name in only:
            run_section(result, name, fn if cuda else (lambda: dict(no_gpu)))
    if "cpu_adam" in only:  # host-bound sections after the build: g++ would disturb them
        why = wait_cpu_adam_build(build, min(cpu_adam_build_s, clock.left() - 25))
        run_section(result, "cpu_adam", (lambda: skipped(why)) if why else (lambda: measure_cpu_adam(quick)))
    if "launch" in only:
        run_section(result, "launch", lambda: measure_launch(cuda, quick))
    if "zero3" in only:
        run_section(result, "zero3", lambda: measure_zero3(cuda, quick, clock))
    result["wall_s"] = round(time.perf_counter() - clock.start, 2)
    return result


def model_gemm_efficiency(result: dict[str, Any]) -> list[tuple[str, str]]:
    """What the predictor will take from this grid once committed (labkit.runtime.hardware.typical_gemm_efficiency:
    the median rate per SM of the GEMMs `calibrates` keeps), for a GPU with a preset."""
    from labkit.runtime import hardware

    preset = hardware.preset_for(str(result["device"].get("name"))) if result["device"].get("cuda") else None
    if preset is None:
        return []
    measured = hardware.measured_from(result, "this run")
    shares = hardware.typical_gemm_efficiency(hardware.GPUS[preset], measured.gemm_shapes, measured.gemm_flops_per_s)
    return [(f"GEMM {dtype}, the model's efficiency", f"{share:.3f} of {preset}'s peak (median rate per SM)")
            for dtype, share in shares.items()]


def table(result: dict[str, Any]) -> list[tuple[str, str]]:
    """The figures a reader wants first, as (what, value) rows."""
    rows: list[tuple[str, str]] = [("device", str(result["device"].get("name")))]

    def add(what: str, section: str, key: str, scale: float, unit: str) -> None:
        value = result.get(section, {}).get(key)
        if isinstance(value, int | float):
            rows.append((what, f"{value * scale:.4g} {unit}"))
        elif "skipped" in result.get(section, {}):
            rows.append((what, f"skipped: {result[section]['skipped'][:70]}"))

    for dtype in ("bf16", "fp16", "fp32"):
        best = (result.get("gemm", {}).get(dtype) or {}).get("best_flops_per_s")
        rows.append((f"GEMM {dtype}, best", f"{best / 1e12:.1f} TFLOP/s" if best else "skipped"))
    rows += model_gemm_efficiency(result)
    add("device memory copy", "memory", "copy_bytes_per_s", 1e-9, "GB/s")
    add("pinned host -> device", "host_copy", "pinned_h2d_bytes_per_s", 1e-9, "GB/s")
    add("pinned device -> host", "host_copy", "pinned_d2h_bytes_per_s", 1e-9, "GB/s")
    add("pageable host -> device", "host_copy", "pageable_h2d_bytes_per_s", 1e-9, "GB/s")
    add("pageable device -> host", "host_copy", "pageable_d2h_bytes_per_s", 1e-9, "GB/s")
    add("AdamW fused (GPU)", "gpu_adamw", "fused_s_per_param", 1e12, "ps/param")
    add("AdamW foreach (GPU)", "gpu_adamw", "foreach_s_per_param", 1e12, "ps/param")
    add("fused attention (SDPA), median share of peak", "attention", "efficiency", 1, "")
    add("DeepSpeed CPU Adam (host)", "cpu_adam", "s_per_param", 1e9, "ns/param")
    add("offload's unscale pass (host)", "cpu_adam", "unscale_s_per_param", 1e9, "ns/param")
    add("offload's copy to 16 bits (host)", "cpu_adam", "to_bit16_s_per_param", 1e9, "ns/param")
    add("launch + dispatch per op", "launch", "launch_s", 1e6, "us")
    add("ZeRO-3 per module per micro-step", "zero3", "per_module_per_micro_step_s", 1e6, "us")
    add("ZeRO-3 fixed per micro-step", "zero3", "per_micro_step_s", 1e3, "ms")
    add("ZeRO-3 per parameter-free module", "zero3", "per_paramless_module_per_micro_step_s", 1e6, "us")
    add("ZeRO-3 step per module", "zero3", "step_per_module_s", 1e6, "us")
    rows.append(("wall time", f"{result['wall_s']:.1f} s (budget {result['budget_s']:.0f} s)"))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="where to write the JSON")
    parser.add_argument("--budget-s", type=float, default=80.0, help="the whole script's time budget")
    parser.add_argument("--cpu-adam-build-s", type=float, default=60.0,
                        help="how long to wait for the cpu_adam op's build (or its load, seconds, when built before)")
    parser.add_argument("--quick", action="store_true", help="small sizes (the test's CPU path)")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {SECTIONS}")
    args = parser.parse_args(argv)
    only = tuple(s for s in args.only.split(",") if s)
    unknown = [s for s in only if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; known: {', '.join(SECTIONS)}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = measure(args.budget_s, args.quick, args.cpu_adam_build_s, only)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwritten: {out}")
    rows = table(result)
    width = max(len(what) for what, _ in rows)
    for what, value in rows:
        print(f"{what:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

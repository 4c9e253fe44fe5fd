"""Hardware presets for predicting a step on GPUs this machine does not have: GPU kinds, links inside a
node, node networks, and a cluster made of them.

Every figure comes from the vendor's datasheet (cited beside it), but a card's memory, which is what CUDA reports
for it (MEMORY_TOTALS, cited beside each). Peaks are DENSE tensor-core figures
(no 2:4 sparsity); `fp32` is the plain (non-TF32) FP32 peak, what an fp32 run gets without TF32. Link
bandwidths are per GPU and per direction (what a ring sends through), not the "bidirectional" totals
datasheets headline. The share of a peak that real kernels reach is, per GPU kind and per link kind, either a
published measurement (cited), a measurement of this lab (`benchmarks/bench_gpu_constants.py`, loaded from
data/reference-*/gpu_constants.json by `load_measured`, its source line kept), or an assumption said to be one.
Nothing here is fitted to any published point.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labkit.runtime.arguments import whole_number

GB = 1e9
GiB = 2**30
REPO = Path(__file__).resolve().parents[2]

# A kernel's share of the datasheet peak where no measurement of that GPU kind is loaded. ASSUMPTIONS, global:
# no published GEMM measurement of A100, L4 or A10G, and no streaming-bandwidth measurement of any of these GPU kinds,
# with its setup was found and verified for this model (docs/predict.md; V100 SXM and T4 GEMMs are Baidu DeepBench's,
# data/published/gemm/); bench_gpu_constants.py measures both on a GPU the lab has.
GEMM_EFFICIENCY = 0.8    # a large cuBLAS GEMM's share of the dense tensor-core peak (full waves, big K)
MEMORY_EFFICIENCY = 0.8  # a streaming element-wise kernel's share of the datasheet memory bandwidth
# The GEMM roofline (flops.op_seconds) runs 128 x 128 output tiles in waves over the SMs at one rate per SM: a GPU
# kind's GEMM efficiency is that rate's share of the peak. From a grid of measured GEMMs (this lab's or published) it
# is the MEDIAN rate the grid's GEMMs imply, over those the roofline describes (`calibrates`): M and N of at least
# one tile each, at least one tile per SM (else narrower tiles or split K: gemm_tiles, gemm_split_k), at least
# GEMM_CALIBRATION_MIN_S (shorter ones are launch-bound), on the tensor cores. Until 2026-11-28 it was the grid's best
# GEMM, an extreme the model then reached on every shape: 95-97% of DeepBench's V100 GEMMs in that range ran slower
# than predicted, by 9% (fp16) and 7% (fp32) at the median (docs/predict.md).
GEMM_TILE = 128               # cuBLAS's typical 128 x 128 output tile (NVIDIA DU-09799-001, section 2.3)
# ... and the narrowest of the guide's typical tiles (its section 2.3 lists 256 x 128 down to 64 x 64, as recalled
# from its web edition: not re-read from here, 2026-11-28; cuBLASLt's cublasLtMatmulTile_t has tiles down to 8 x 8,
# nvmath-python's binding docs): an output side of 64 or less runs a 64-wide tile, not a 128-wide one, so a GEMM
# with few tokens or a narrow layer is not charged 128 (a 16-wide output is still charged 64: 2-4x slow, the check).
GEMM_NARROW_TILE = 64
# A GEMM whose output has fewer tiles than the GPU has SMs may split K over the idle ones (split-K: cuBLASLt's
# CUBLASLT_ALGO_CONFIG_SPLITK_NUM, CUTLASS's GemmSplitKParallel), each split at least one tile of K deep, adding its
# fp32 partial outputs (written, then read by the reduction: SPLIT_K_PARTIAL_BYTES per element per split); the
# roofline takes the split only where it is faster than none.
SPLIT_K_PARTIAL_BYTES = 2 * 4
GEMM_CALIBRATION_MIN_S = 1e-4
ASSUMED = "assumed (no measurement of this GPU kind loaded): GEMM 0.8 of peak, memory 0.8 of datasheet bandwidth"
# A fused attention kernel's (torch's scaled_dot_product_attention on a GPU) share of the dense fp16/bf16 peak, per
# GPU generation, for the FLOPs it executes counted as FlashAttention's benchmarks count them (flops.attention_work:
# causal half, backward 2.5x). Published where found, else assumed:
# * Ampere (A100; A10G, the same generation, assumed alike): 0.50, the low end of FlashAttention-2's "50-73% of the
#   theoretical maximum FLOPs/s on A100" (Dao, arXiv:2307.08691, abstract), over its grid of lengths, taken for
#   forward + backward (the abstract gives no split);
# * Hopper (H100): 0.35, "FlashAttention-2 achieving only 35% utilization on the H100 GPU" (Shah et al.,
#   FlashAttention-3, arXiv:2407.08608, abstract): SDPA's flash backend (a cuDNN backend, where torch picks it, or
#   FlashAttention-3 run faster there);
# * Ada (L4): 0.50, ASSUMED as Ampere's (FlashAttention-2 runs there; no published share found);
# * Volta and Turing (V100, T4): 0.25, ASSUMED: FlashAttention-2 does not run there and torch runs its
#   memory-efficient kernel; the low end of the first FlashAttention's "25-40%" on A100 (the FlashAttention-2
#   abstract), no measurement on these GPUs found.
FUSED_ATTENTION_EFFICIENCY = {"ampere": 0.50, "hopper": 0.35, "ada": 0.50, "volta": 0.25, "turing": 0.25}


@dataclass(frozen=True, kw_only=True)
class GPU:
    name: str
    peak_flops: dict[str, float]        # dense FLOP/s by precision: "fp16", "bf16", "fp32"
    memory_bytes: float                 # device memory as CUDA reports it (torch's total_memory): MEMORY_TOTALS
    memory_bytes_per_s: float           # HBM/GDDR bandwidth
    sms: int                            # streaming multiprocessors (GEMM wave quantization, flops.py)
    nvlink: str | None                  # its NVLink generation (the `nvswitch` link of its generation)
    host_link: str                      # PCIe generation to the host (offload traffic)
    source: str
    # Volta/Turing (the cuBLAS 10 era): fp16 GEMMs use tensor cores only when K and the leading dimensions are
    # multiples of 8, else the CUDA cores (on_tensor_cores has the sources);
    # Ampere and later use tensor cores for any shape (cuBLAS >= 11).
    tensor_core_alignment: int = 1
    # A fused attention kernel's share of the dense tensor-core peak, published or assumed, by its GPU generation
    # (FUSED_ATTENTION_EFFICIENCY has the sources); a measurement replaces it (`attention_efficiency`)
    attention_share: float
    # What this lab measured on this GPU kind (bench_gpu_constants.py), if loaded: its efficiencies replace the
    # assumed ones, and its host figures (launch, ZeRO-3 hooks, CPU Adam, pinned copies) are the node's host.
    measured: Measured | None = field(default=None, compare=False)

    def gemm_efficiency(self, precision: str) -> float:
        """The GEMM roofline's rate per SM as a share of the dense peak: the median a grid of measured GEMMs implies
        (this lab's, or a published one, data/published/gemm/: `typical_gemm_efficiency`), else the assumption."""
        dtype = "fp16" if precision == "mixed" else precision
        measured = self.measured.gemm_efficiency.get(dtype) if self.measured else None
        return measured if measured else GEMM_EFFICIENCY

    @property
    def usable_memory_bytes(self) -> float:
        """What a training process can allocate: CUDA's total less the CUDA context (CUDA_CONTEXT_BYTES)."""
        return self.memory_bytes - CUDA_CONTEXT_BYTES

    @property
    def memory_source(self) -> str:
        return (f"{self.usable_memory_bytes / GiB:.2f} GiB usable: {self.memory_bytes / GiB:.2f} GiB as CUDA reports "
                f"the card (hardware.MEMORY_TOTALS) less {CUDA_CONTEXT_BYTES / GiB:.2f} GiB of CUDA context")

    @property
    def memory_efficiency(self) -> float:
        copy = self.measured.memory_bytes_per_s if self.measured else None
        return copy / self.memory_bytes_per_s if copy else MEMORY_EFFICIENCY

    @property
    def attention_efficiency(self) -> float:
        measured = self.measured.attention_efficiency if self.measured else None
        return measured or self.attention_share

    @property
    def constants_source(self) -> str:
        if not self.measured:
            return ASSUMED
        shares = []
        for dtype, share in sorted(self.measured.gemm_efficiency.items()):
            used = sum(calibrates(self, dtype, shape) for shape in self.measured.gemm_shapes.get(dtype, []))
            how = f"the median rate per SM over {used} GEMM{'s' if used > 1 else ''}" if used else "its best GEMM"
            shares.append(f"{dtype} {share:.3f} ({how})")
        if not shares:
            return self.measured.source
        return f"{self.measured.source}; GEMM efficiency, of the peak: {', '.join(shares)}"

    def peak(self, precision: str) -> float:
        dtype = "fp16" if precision == "mixed" else precision
        value = self.peak_flops.get(dtype, 0.0)
        if not value:
            raise ValueError(f"{self.name} has no {dtype} tensor-core peak (datasheet); use "
                             f"{', '.join(k for k, v in self.peak_flops.items() if v)}")
        return value

    def cuda_core_peak(self, precision: str) -> float:
        """What a GEMM gets without tensor cores: the FP32 CUDA-core peak (fp16 math on Volta/Turing CUDA cores
        runs at twice it; fp16 GEMMs accumulate in fp32, so the fp32 figure is the honest bound)."""
        return self.peak_flops["fp32"]


_V100_SXM2 = "NVIDIA Tesla V100 datasheet (2020, SXM2): 125 TFLOPS tensor, 15.7 FP32, 900 GB/s HBM2, 80 SMs, " \
             "NVLink 300 GB/s (6 links x 25 GB/s per direction)"
_V100_PCIE = "NVIDIA Tesla V100 datasheet (2020, PCIe): 112 TFLOPS tensor, 14 FP32, 900 GB/s HBM2, 80 SMs"
_A100 = "NVIDIA A100 Tensor Core GPU datasheet (2021): 312 TFLOPS BF16/FP16 dense, 19.5 FP32, 108 SMs; " \
        "40GB 1,555 GB/s; 80GB SXM 2,039 GB/s, 80GB PCIe 1,935 GB/s; NVLink 600 GB/s (12 links x 25 GB/s per direction)"
_H100 = "NVIDIA H100 Tensor Core GPU datasheet (2023): SXM 989 TFLOPS BF16/FP16 dense (1,979 sparse), 67 FP32, " \
        "3.35 TB/s, 132 SMs, NVLink 900 GB/s (18 links x 25 GB/s per direction); PCIe 756 dense (1,513 sparse), " \
        "51 FP32, 2.0 TB/s, 114 SMs"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet (2024): SXM 1,979 TFLOPS BF16/FP16 with sparsity (989 dense), " \
        "67 FP32, 141 GB HBM3e, 4.8 TB/s, NVLink 900 GB/s, PCIe Gen5; the H100's GH100 die (132 SMs, the H100 SXM's)"
_A10 = "NVIDIA A10 Tensor Core GPU datasheet (2021): 125 TFLOPS BF16/FP16 dense (250 sparse), 31.2 FP32, " \
       "24 GB GDDR6, 600 GB/s, 288 tensor cores (72 SMs of 4), PCIe Gen4"
_L4 = "NVIDIA L4 datasheet (2023): 121 TFLOPS BF16/FP16 dense (242 sparse), 30.3 FP32, 24 GB, 300 GB/s, 58 SMs, PCIe 4"
_T4 = "NVIDIA T4 datasheet (2019): 65 TFLOPS FP16 mixed, 8.1 FP32, 16 GB, 320 GB/s, 40 SMs, PCIe 3 (no bf16)"
_A10G = "AWS G5 (A10G, 24 GB, 600 GB/s, 80 SMs, PCIe 4): AWS publishes no dense tensor peak; 70 TFLOPS BF16/FP16 " \
        "dense and 31.2 FP32 as labkit.runtime.devices has used (NVIDIA's A10 datasheet: 125 dense, 31.2 FP32; " \
        "the A10G is a lower-clocked cloud variant): the least certain preset here"

# Device memory as CUDA reports it (cudaDeviceProp.totalGlobalMem: torch's `get_device_properties().total_memory`,
# the "total capacity" of its out-of-memory message, deviceQuery's "Total amount of global memory"), not the
# datasheet's "80GB": the driver reserves a few hundred MiB of the card (nvidia-smi -q's "Reserved"; 454-763 MiB on
# the cards below), so "80GB" of HBM is 79.1-79.3 GiB to CUDA, and a T4's "16 GB" of GDDR6 14.6-14.8 GiB. The figure
# moves by up to ~1% with the driver (quoted where sources differ); each is the card's own where a source names the
# card, else borrowed as said. Found 2026-11-29 (docs/predict.md, "Memory").
MEMORY_TOTALS = {
    # "Tesla V100-SXM2-32GB", CUDA driver 11.2: "32510 MBytes (34089730048 bytes)", deviceQuery in
    # infn-esc/esc21@51fbdebd658086a5e7ce833196cb954b81d37deb parallelism/alpaka.md (31.72-31.75 GiB on other drivers)
    "V100-32GB": 34089730048,
    # a 16 GB V100: "(GPU 0; 15.78 GiB total capacity; ...)", github.com/kchengiva/Shift-GCN/issues/34
    "V100-16GB": 15.78 * GiB,
    # "NVIDIA A100-SXM4-40GB", driver 12.2: "40339 MBytes (42298834944 bytes)", deviceQuery in
    # github.com/bottlerocket-os/bottlerocket/pull/3873
    "A100-40GB": 42298834944,
    # "NVIDIA A100-SXM4-80GB", driver 555.42.02: "81158 MBytes (85100068864 bytes)", nvidia-smi "81920MiB",
    # "Reserved : 763 MiB": thamada/nvidia-smi@b09ef139265ffc7e3c78006346981de8e4d70499 gls/A100SXMx4_deviceQuery.py
    # and gls/A100SXMx4_smi.py (84987740160 bytes under driver 12.2)
    "A100-80GB": 85100068864,
    # "NVIDIA A100 80GB PCIe", driver 12.3: "Total global mem: 81049 MB", github.com/ekondis/mixbench/issues/47
    "A100-80GB-PCIE": 81049 * 2**20,
    # "NVIDIA H100 80GB HBM3": 85017493504 bytes measured in this lab (data/reference-h100-80gb/gpu_constants.json,
    # torch 2.11, driver 580); 79.11-79.20 GiB on drivers 535-565 (vllm-project/vllm#27508; thamada/nvidia-smi)
    "H100-SXM": 85017493504,
    # "NVIDIA L4", driver 550.90.07: "22478 MBytes (23570219008 bytes)", nvidia-smi "23034MiB", "Reserved : 556 MiB":
    # thamada/nvidia-smi@b09ef139265ffc7e3c78006346981de8e4d70499 gls/L4_deviceQuery.py and gls/L4_smi.py
    "L4": 23570219008,
    # "on Google Colab with T4 GPU ... GPU 0 has a total capacity of 14.75 GiB", github.com/hpcaitech/Open-Sora/
    # issues/697 (14.57 GiB under driver 12.5)
    "T4": 14.75 * GiB,
    # "I'm using an A10G with 24 GB VRAM ... (GPU 0; 22.49 GiB total capacity ...)", github.com/AUTOMATIC1111/
    # stable-diffusion-webui/issues/1259 (2022; newer drivers reserve ~0.5 GiB of it, as the A10's 21.99-22.07)
    "A10G": 22.49 * GiB,
    # "GPU 5 has a total capacity of 139.80 GiB" on 8 x H200, and the same figure in other public H200 logs (found
    # by text search, their repositories not resolved; nvidia-smi "143771MiB"): the least certain citation here
    "H200-SXM": 139.80 * GiB,
}
# No source naming the card was resolved for these; each borrows its twin's (the same memory, another board). The
# A10's own deviceQuery logs (found by text search, unresolved) print 21.99-22.07 GiB under drivers 12.2-12.8: the
# A10G's 22.49, from a 2022 driver, is ~0.5 GiB high for a current one (docs/predict.md, "Memory").
MEMORY_TOTALS.update({"V100-16GB-PCIE": MEMORY_TOTALS["V100-16GB"], "V100-32GB-PCIE": MEMORY_TOTALS["V100-32GB"],
                      "A100-40GB-PCIE": MEMORY_TOTALS["A100-40GB"], "H100-PCIE": MEMORY_TOTALS["H100-SXM"],
                      "A10": MEMORY_TOTALS["A10G"]})
# What a CUDA process holds outside PyTorch's allocator (the CUDA context: kernels' code, driver state), which a
# prediction's tensors cannot use: 0.58 GiB, measured in this lab on the H100 (torch 2.11, CUDA 13) at a 1-rank
# run's out-of-memory error, "this process has 40.76 GiB memory in use ... 40.17 GiB is allocated by PyTorch, and
# 10.66 MiB is reserved by PyTorch but unallocated" (data/reference-h100-80gb/check.log). One GPU kind's, borrowed
# by every kind; NCCL's buffers and the allocator's fragmentation are not in it (docs/predict.md, "Memory").
CUDA_CONTEXT_BYTES = 0.58 * GiB

GPUS: dict[str, GPU] = {g.name: g for g in (
    GPU(name="V100-16GB", peak_flops={"fp16": 125e12, "bf16": 0.0, "fp32": 15.7e12},
        memory_bytes=MEMORY_TOTALS["V100-16GB"], memory_bytes_per_s=900 * GB, sms=80, nvlink="nvlink2",
        host_link="pcie3", source=_V100_SXM2, tensor_core_alignment=8,
        attention_share=FUSED_ATTENTION_EFFICIENCY["volta"]),
    GPU(name="V100-32GB", peak_flops={"fp16": 125e12, "bf16": 0.0, "fp32": 15.7e12},
        memory_bytes=MEMORY_TOTALS["V100-32GB"], memory_bytes_per_s=900 * GB, sms=80, nvlink="nvlink2",
        host_link="pcie3", source=_V100_SXM2, tensor_core_alignment=8,
        attention_share=FUSED_ATTENTION_EFFICIENCY["volta"]),
    GPU(name="V100-16GB-PCIE", peak_flops={"fp16": 112e12, "bf16": 0.0, "fp32": 14e12},
        memory_bytes=MEMORY_TOTALS["V100-16GB-PCIE"], memory_bytes_per_s=900 * GB, sms=80, nvlink=None,
        host_link="pcie3", source=_V100_PCIE, tensor_core_alignment=8,
        attention_share=FUSED_ATTENTION_EFFICIENCY["volta"]),
    GPU(name="V100-32GB-PCIE", peak_flops={"fp16": 112e12, "bf16": 0.0, "fp32": 14e12},
        memory_bytes=MEMORY_TOTALS["V100-32GB-PCIE"], memory_bytes_per_s=900 * GB, sms=80, nvlink=None,
        host_link="pcie3", source=_V100_PCIE, tensor_core_alignment=8,
        attention_share=FUSED_ATTENTION_EFFICIENCY["volta"]),
    GPU(name="A100-40GB", peak_flops={"fp16": 312e12, "bf16": 312e12, "fp32": 19.5e12},
        memory_bytes=MEMORY_TOTALS["A100-40GB"], memory_bytes_per_s=1555 * GB, sms=108, nvlink="nvlink3",
        host_link="pcie4", source=_A100, attention_share=FUSED_ATTENTION_EFFICIENCY["ampere"]),
    GPU(name="A100-80GB", peak_flops={"fp16": 312e12, "bf16": 312e12, "fp32": 19.5e12},
        memory_bytes=MEMORY_TOTALS["A100-80GB"], memory_bytes_per_s=2039 * GB, sms=108, nvlink="nvlink3",
        host_link="pcie4", source=_A100, attention_share=FUSED_ATTENTION_EFFICIENCY["ampere"]),
    GPU(name="A100-40GB-PCIE", peak_flops={"fp16": 312e12, "bf16": 312e12, "fp32": 19.5e12},
        memory_bytes=MEMORY_TOTALS["A100-40GB-PCIE"], memory_bytes_per_s=1555 * GB, sms=108, nvlink=None,
        host_link="pcie4", source=_A100, attention_share=FUSED_ATTENTION_EFFICIENCY["ampere"]),
    GPU(name="A100-80GB-PCIE", peak_flops={"fp16": 312e12, "bf16": 312e12, "fp32": 19.5e12},
        memory_bytes=MEMORY_TOTALS["A100-80GB-PCIE"], memory_bytes_per_s=1935 * GB, sms=108, nvlink=None,
        host_link="pcie4", source=_A100, attention_share=FUSED_ATTENTION_EFFICIENCY["ampere"]),
    GPU(name="H100-SXM", peak_flops={"fp16": 989e12, "bf16": 989e12, "fp32": 67e12},
        memory_bytes=MEMORY_TOTALS["H100-SXM"], memory_bytes_per_s=3350 * GB, sms=132, nvlink="nvlink4",
        host_link="pcie5", source=_H100, attention_share=FUSED_ATTENTION_EFFICIENCY["hopper"]),
    GPU(name="H100-PCIE", peak_flops={"fp16": 756e12, "bf16": 756e12, "fp32": 51e12},
        memory_bytes=MEMORY_TOTALS["H100-PCIE"], memory_bytes_per_s=2000 * GB, sms=114, nvlink=None, host_link="pcie5",
        source=_H100, attention_share=FUSED_ATTENTION_EFFICIENCY["hopper"]),
    GPU(name="H200-SXM", peak_flops={"fp16": 989e12, "bf16": 989e12, "fp32": 67e12},
        memory_bytes=MEMORY_TOTALS["H200-SXM"], memory_bytes_per_s=4800 * GB, sms=132, nvlink="nvlink4",
        host_link="pcie5", source=_H200, attention_share=FUSED_ATTENTION_EFFICIENCY["hopper"]),
    GPU(name="L4", peak_flops={"fp16": 121e12, "bf16": 121e12, "fp32": 30.3e12}, memory_bytes=MEMORY_TOTALS["L4"],
        memory_bytes_per_s=300 * GB, sms=58, nvlink=None, host_link="pcie4", source=_L4,
        attention_share=FUSED_ATTENTION_EFFICIENCY["ada"]),
    GPU(name="T4", peak_flops={"fp16": 65e12, "bf16": 0.0, "fp32": 8.1e12}, memory_bytes=MEMORY_TOTALS["T4"],
        memory_bytes_per_s=320 * GB, sms=40, nvlink=None, host_link="pcie3", source=_T4, tensor_core_alignment=8,
        attention_share=FUSED_ATTENTION_EFFICIENCY["turing"]),
    GPU(name="A10G", peak_flops={"fp16": 70e12, "bf16": 70e12, "fp32": 31.2e12}, memory_bytes=MEMORY_TOTALS["A10G"],
        memory_bytes_per_s=600 * GB, sms=80, nvlink=None, host_link="pcie4", source=_A10G,
        attention_share=FUSED_ATTENTION_EFFICIENCY["ampere"]),
    GPU(name="A10", peak_flops={"fp16": 125e12, "bf16": 125e12, "fp32": 31.2e12}, memory_bytes=MEMORY_TOTALS["A10"],
        memory_bytes_per_s=600 * GB, sms=72, nvlink=None, host_link="pcie4", source=_A10,
        attention_share=FUSED_ATTENTION_EFFICIENCY["ampere"]),
)}
# Where a part comes as SXM and PCIe, the plain name is the SXM part (the naming).
ALIASES = {"V100": "V100-32GB", "A100": "A100-80GB", "H100": "H100-SXM", "H200": "H200-SXM",
           "V100-32GB-SXM2": "V100-32GB", "A100-80GB-SXM4": "A100-80GB", "A100-40GB-SXM4": "A100-40GB"}


# -- constants this lab measured on a GPU kind ---------------------------------------------------------------------
MEASURED_FORMAT = "labkit-gpu-constants/1"  # what benchmarks/bench_gpu_constants.py writes
MEASURED_FILES = "data/reference-*/gpu_constants.json"
PUBLISHED_GEMM_FORMAT = "labkit-published-gemm/1"  # what data/published/gemm/from_deepbench.py writes
PUBLISHED_GEMM_FILES = "data/published/gemm/*.json"


@dataclass(frozen=True, kw_only=True)
class Measured:
    """benchmarks/bench_gpu_constants.py's figures for one GPU kind and its node's host (None: not measured)."""

    source: str                       # "measured on <GPU> in this lab, <date>, benchmarks/bench_gpu_constants.py"
    device_name: str                  # torch.cuda.get_device_name, as measured
    gemm_flops_per_s: dict[str, float]  # the best GEMM of the grid, per dtype (bf16, fp16, fp32 without TF32)
    gemm_shapes: dict[str, list[dict[str, Any]]]  # every GEMM of the grid: label, m, n, k, seconds
    memory_bytes_per_s: float | None  # a large device copy, bytes read + written per second
    pinned_h2d_bytes_per_s: float | None
    pinned_d2h_bytes_per_s: float | None
    cpu_adam_s_per_param: float | None  # DeepSpeedCPUAdam.step on the host, all its threads
    launch_s: float | None            # the host's time to issue one small op (dispatch + launch)
    zero3_per_module_s: float | None  # ZeRO-3's hooks per module per micro-step (fetch before forward and backward)
    zero3_per_micro_step_s: float | None  # ZeRO-3's fixed host cost per micro-step (may read < 0: noise, use 0)
    zero3_per_paramless_module_s: float | None = None  # per module without parameters (ZeRO-3 hooks it too)
    # ZeRO-Offload's two host passes beside CPU Adam, per parameter, all the host's threads: the fp32 gradients scaled
    # in place, and fp32 parameters copied into a bf16 buffer
    offload_unscale_s_per_param: float | None = None
    offload_to_bit16_s_per_param: float | None = None
    # torch's scaled_dot_product_attention, forward + backward, causal: the median share of the dense 16-bit peak over
    # its grid, counted as flops.attention_work counts the work (what the model divides by it)
    attention_efficiency: float | None = None
    # the GEMM efficiency per dtype on the GPU kind it is attached to (`with_measured`: it depends on the SMs and peak)
    gemm_efficiency: dict[str, float] = field(default_factory=dict, compare=False)


def _tile_side(size: int) -> int:
    return GEMM_NARROW_TILE if size <= GEMM_NARROW_TILE else GEMM_TILE


def gemm_tiles(batch: int, m: int, n: int) -> int:
    """The output tiles of a (batch x) m x n GEMM: GEMM_TILE a side, GEMM_NARROW_TILE on a side of that or less."""
    return batch * math.ceil(m / _tile_side(m)) * math.ceil(n / _tile_side(n))


def gemm_split_k(kind: GPU, batch: int, m: int, n: int, k: int) -> int:
    """Into how many slices of K a GEMM can split: as many as its output tiles leave SMs idle (1 where they fill
    the SMs), each at least GEMM_TILE deep; 1 for an empty output. `flops.op_seconds` takes it only where it is
    faster than no split, its fp32 partial outputs counted (cuBLAS's heuristics choose between such kernels)."""
    tiles = gemm_tiles(batch, m, n)
    return max(1, min(kind.sms // tiles, k // GEMM_TILE)) if tiles else 1


def gemm_sm_flops(kind: GPU, batch: int, m: int, n: int, k: int, split: int = 1) -> float:
    """The FLOPs each SM runs for a (batch x) m x n x k GEMM in the roofline: its waves of output tiles over the GPU
    kind's SMs, 2 x tile x k each (tile and wave quantization: NVIDIA's Matrix Multiplication Background User's
    Guide, DU-09799-001, ch. 2-3), with K in `split` slices over more SMs (`gemm_split_k`). The GEMM's time is
    this over a rate per SM."""
    waves = math.ceil(gemm_tiles(batch, m, n) * split / kind.sms)
    return waves * 2.0 * _tile_side(m) * _tile_side(n) * math.ceil(k / split)


def on_tensor_cores(gemm: tuple[int, int, int, int], blas: tuple[int, ...] | None, align: int) -> bool:
    """Whether cuBLAS runs an fp16 GEMM (batch, M, N, K) on tensor cores where it needs aligned sizes (Volta/Turing,
    cuBLAS 10): k and every leading dimension of its call (`blas`: m, k, lda, ldb, ldc, then a batched GEMM's
    strides between matrices) multiples of `align` (8) and m of half that, as NVIDIA's "Programming Tensor Cores in
    CUDA 9" (2017) writes its cublasGemmEx call; Baidu DeepBench's harness pads exactly those (M and K for NN and TN,
    M and N for NT: code/nvidia/gemm_bench.cu), and its V100 and T4 runs with N = 9,124 or 8,457 went at tensor-core
    speed. A batched GEMM's matrices must start aligned too (the same post: 16-byte pointers), so its batch strides
    count as leading dimensions. Without the call's view, all of M, N and K. `align` 1: any shape (cuBLAS >= 11)."""
    if align == 1:
        return True
    if blas is None:
        return all(d % align == 0 for d in gemm[1:])
    m, k, *leading = blas
    return m % max(1, align // 2) == 0 and all(d % align == 0 for d in (k, *leading))


def grid_blas(shape: dict[str, Any]) -> tuple[int, ...] | None:
    """A published grid's GEMM as its harness called cuBLAS (column-major; `a_t`, `b_t`: A and B transposed), as
    (m, k, lda, ldb, ldc); None where the grid does not say (this lab's: torch's own call)."""
    if "a_t" not in shape:
        return None
    m, n, k = int(shape["m"]), int(shape["n"]), int(shape["k"])
    return (m, k, k if shape["a_t"] else m, n if shape["b_t"] else k, m)


def calibrates(kind: GPU, dtype: str, shape: dict[str, Any]) -> bool:
    """Whether a grid's GEMM is one the roofline describes, and so one `typical_gemm_efficiency` takes its median
    over: M and N of at least GEMM_TILE (a narrower output runs narrower tiles), at least one tile per SM
    (fewer, and cuBLAS splits K), at least GEMM_CALIBRATION_MIN_S (shorter, launch-bound), and on the tensor cores
    by `on_tensor_cores` (a 16-bit GEMM; fp32 runs on the CUDA cores). Pure."""
    m, n, k = int(shape["m"]), int(shape["n"]), int(shape["k"])
    tiles = gemm_tiles(1, m, n)
    tensor = dtype == "fp32" or on_tensor_cores((1, m, n, k), grid_blas(shape), kind.tensor_core_alignment)
    return min(m, n) >= GEMM_TILE and tiles >= kind.sms and float(shape["seconds"]) >= GEMM_CALIBRATION_MIN_S and tensor


def typical_gemm_efficiency(kind: GPU, shapes: dict[str, list[dict[str, Any]]],
                            best: dict[str, float]) -> dict[str, float]:
    """Per dtype, the median over the grid's GEMMs the roofline describes (`calibrates`) of the rate per SM each one
    implies (`gemm_sm_flops` over its measured time, / the peak per SM); a dtype with none such: its
    best GEMM's share of the peak (`best`, FLOP/s). `shapes`: per dtype, the grid's GEMMs (m, n, k, seconds, and a
    published grid's a_t, b_t), as `Measured.gemm_shapes`. Pure."""
    out: dict[str, float] = {}
    for dtype, rows in shapes.items():
        if not kind.peak_flops.get(dtype):
            continue  # a dtype the GPU kind has no peak for (bf16 on a V100): nothing to share
        implied = [gemm_sm_flops(kind, 1, int(s["m"]), int(s["n"]), int(s["k"])) / s["seconds"]
                   for s in rows if calibrates(kind, dtype, s)]  # per SM
        rate = statistics.median(implied) * kind.sms if implied else best.get(dtype)
        if rate:
            out[dtype] = rate / kind.peak(dtype)
    return out


def _number(section: dict[str, Any], key: str) -> float | None:
    value = section.get(key)
    return float(value) if isinstance(value, int | float) else None


def load_measured(path: str | Path) -> Measured:
    """The JSON bench_gpu_constants.py wrote, as `Measured` (`measured_from`)."""
    return measured_from(json.loads(Path(path).read_text()), str(path))


def measured_from(data: dict[str, Any], where: str) -> Measured:
    """bench_gpu_constants.py's result (`where` names it in errors) as `Measured`; a ValueError if it is not one, or
    was measured without a GPU (its GPU sections skipped)."""
    if data.get("format") != MEASURED_FORMAT:
        raise ValueError(f"{where}: not a {MEASURED_FORMAT} file (benchmarks/bench_gpu_constants.py writes one)")
    device = data.get("device") or {}
    if not device.get("cuda"):
        raise ValueError(f"{where}: measured without a CUDA GPU ({device.get('name')}): it has no GPU constants")
    gemm = data.get("gemm") or {}
    best = {dtype: float(gemm[dtype]["best_flops_per_s"]) for dtype in ("bf16", "fp16", "fp32")
            if isinstance(gemm.get(dtype), dict) and gemm[dtype].get("best_flops_per_s")}
    shapes = {dtype: [row for row in gemm[dtype]["shapes"] if "seconds" in row] for dtype in best}
    copy, adam, zero3 = data.get("host_copy") or {}, data.get("cpu_adam") or {}, data.get("zero3") or {}
    return Measured(source=str(data["source"]), device_name=str(device.get("name")), gemm_flops_per_s=best,
                    gemm_shapes=shapes, memory_bytes_per_s=_number(data.get("memory") or {}, "copy_bytes_per_s"),
                    pinned_h2d_bytes_per_s=_number(copy, "pinned_h2d_bytes_per_s"),
                    pinned_d2h_bytes_per_s=_number(copy, "pinned_d2h_bytes_per_s"),
                    cpu_adam_s_per_param=_number(adam, "s_per_param"),
                    launch_s=_number(data.get("launch") or {}, "launch_s"),
                    zero3_per_module_s=_number(zero3, "per_module_per_micro_step_s"),
                    zero3_per_micro_step_s=_number(zero3, "per_micro_step_s"),
                    zero3_per_paramless_module_s=_number(zero3, "per_paramless_module_per_micro_step_s"),
                    offload_unscale_s_per_param=_number(adam, "unscale_s_per_param"),
                    offload_to_bit16_s_per_param=_number(adam, "to_bit16_s_per_param"),
                    attention_efficiency=_number(data.get("attention") or {}, "efficiency"))


def load_published_gemm(path: str | Path) -> tuple[list[str], Measured]:
    """A published GEMM grid (data/published/gemm/*.json) as (the presets it describes, `Measured` with only its
    GEMMs): once attached to a preset (`with_measured`), the median rate per SM of each dtype's GEMMs becomes that GPU
    kind's GEMM efficiency (`typical_gemm_efficiency`), as for a grid this lab measured, and every shape a check of
    the roofline (flops.gemm_check). Shapes run padded (DeepBench pads fp16 dimensions to
    multiples of 8) are timed at the padded size. Memory bandwidth and the host's figures stay unmeasured."""
    data = json.loads(Path(path).read_text())
    if data.get("format") != PUBLISHED_GEMM_FORMAT:
        raise ValueError(f"{path}: not a {PUBLISHED_GEMM_FORMAT} file")
    shapes: dict[str, list[dict[str, Any]]] = {}
    best: dict[str, float] = {}
    for dtype, rows in data["shapes"].items():
        shapes[dtype] = [{"label": row["label"], "m": row["padded"][0], "n": row["padded"][1], "k": row["padded"][2],
                          "a_t": bool(row["a_t"]), "b_t": bool(row["b_t"]), "seconds": row["ms"] / 1e3}
                         for row in rows]
        best[dtype] = max(2.0 * r["m"] * r["n"] * r["k"] / r["seconds"] for r in shapes[dtype])
    source = f"{data['source']}; memory bandwidth: 0.8 of the datasheet's, assumed"
    measured = Measured(source=source, device_name=str(data["gpu"]), gemm_flops_per_s=best, gemm_shapes=shapes,
                        memory_bytes_per_s=None, pinned_h2d_bytes_per_s=None, pinned_d2h_bytes_per_s=None,
                        cpu_adam_s_per_param=None, launch_s=None, zero3_per_module_s=None, zero3_per_micro_step_s=None)
    presets = [str(name) for name in data["presets"]]
    unknown = [name for name in presets if name not in GPUS]
    if unknown:
        raise ValueError(f"{path}: unknown presets {unknown}")
    return presets, measured


def preset_for(device_name: str) -> str | None:
    """The preset a CUDA device name is ("NVIDIA H100 80GB HBM3" -> "H100-SXM", "NVIDIA A100-SXM4-40GB" ->
    "A100-40GB", "Tesla V100-PCIE-16GB" -> "V100-16GB-PCIE", "NVIDIA H200" -> "H200-SXM"), or None for a GPU
    without one (the H100 NVL and H200 NVL, bridged PCIe cards of other clocks; the GH200 superchip). Pure."""
    name = device_name.lower()
    pcie = "pcie" in name
    memory = re.search(r"(\d+)\s*gb", name)
    if re.search(r"(?<![a-z])gh\d", name):
        return None  # a Grace Hopper superchip ("NVIDIA GH200 480GB": 96 GB of HBM3), not an H100 or H200 board
    if "h100" in name:
        return None if "nvl" in name else ("H100-PCIE" if pcie else "H100-SXM")
    if "h200" in name:
        return None if "nvl" in name or pcie else "H200-SXM"
    for kind, default in (("a100", "80"), ("v100", "32")):
        if kind in name:
            gb = memory.group(1) if memory else default
            preset = f"{kind.upper()}-{gb}GB" + ("-PCIE" if pcie else "")
            return preset if preset in GPUS else None
    for kind in ("A10G", "A10", "L4", "T4"):  # a word each: "a10" is not in "a10g" or "a100"
        if re.search(rf"\b{kind.lower()}\b", name):
            return kind
    return None


def with_measured(kind: GPU, measured: Measured) -> GPU:
    shares = typical_gemm_efficiency(kind, measured.gemm_shapes, measured.gemm_flops_per_s)
    measured = dataclasses.replace(measured, gemm_efficiency=shares)
    return dataclasses.replace(kind, measured=measured)


def _attach_measured() -> None:
    """Every published GEMM grid (data/published/gemm/) onto the presets it names, then every
    data/reference-*/gpu_constants.json of this repository onto the preset of the GPU it was measured on (this lab's
    measurement replaces a published grid)."""
    import warnings

    for path in sorted(REPO.glob(PUBLISHED_GEMM_FILES)):
        try:
            presets, published = load_published_gemm(path)
        except (ValueError, KeyError, OSError) as exc:
            warnings.warn(f"{path}: not loaded as a published GEMM grid: {exc}", stacklevel=2)
            continue
        for name in presets:
            GPUS[name] = with_measured(GPUS[name], published)
    for path in sorted(REPO.glob(MEASURED_FILES)):
        try:
            measured = load_measured(path)
        except (ValueError, KeyError, OSError) as exc:
            warnings.warn(f"{path}: not loaded as measured GPU constants: {exc}", stacklevel=2)
            continue
        preset = preset_for(measured.device_name)
        if preset is not None:
            GPUS[preset] = with_measured(GPUS[preset], measured)


_attach_measured()


@dataclass(frozen=True, kw_only=True)
class Link:
    name: str
    bytes_per_s: float      # per GPU, per direction
    latency_s: float        # per ring step (alpha)
    efficiency: float       # achievable fraction of bytes_per_s for large messages
    source: str


# Per-direction bandwidth per GPU. NVSwitch gives every GPU its full NVLink bandwidth to any other: `nvswitch`
# resolves to the NVLink generation of the GPU (DGX-2: V100 + NVSwitch gen 1, DGX A100: gen 2, DGX H100: gen 3).
# Latencies: NCCL's own tuning model for a ring with its Simple protocol (NVIDIA/nccl@5067397, src/graph/tuning.cc,
# ncclTunerConstantsDefaults): 8.4 us per collective, 3.4 us per NVLink ring step, 5.7 per PCIe step, 14 per
# network step.
# Efficiency: the NCCL bus bandwidth (nccl-tests' PERFORMANCE.md: the figure comparable to a link's peak) of a
# large collective as a share of the wire, per link kind, from published nccl-tests figures where found:
# * NVLink 3 (A100 / A800 on NVSwitch): 0.80. NVIDIA's NCCL developer (NVIDIA/nccl#412, sjeaugey, 2023-04-24):
#   "~160GB/s intra-node" all-reduce busbw on 8 A800 (8 NVLinks: 200 GB/s per direction); a user's 8 x A100-SXM
#   node: 232.54 GB/s of 300 (NVIDIA/nccl-tests#175, 2023-10-29), 0.78;
# * NVLink 2 and 4, PCIe: 0.80, ASSUMED (no ring busbw with its setup verified here: H100 nodes report 480 GB/s
#   with NVLink SHARP, NVIDIA/nccl-tests#309, an in-switch reduction this ring model does not describe);
# * InfiniBand: NETWORK_EFFICIENCY 0.96, NVIDIA's NCCL developers: "On an Nvidia DGX-A100 system we have
#   8x200Gbit/s IB cards and we measure 192GB/s AllReduce BusBW" (NVIDIA/nccl#812, AddyLaddy, 2023-03-31);
#   "24GB/s inter-node" for one HDR 200G NIC (NVIDIA/nccl#412); "12.2 GB/s (for a 100Gbps card) is as good as you
#   can get", DGX-1 "48 GB/s because we have 4 IB adapters" (NVIDIA/nccl-tests#29, sjeaugey, 2019-12-06).
_PCIE = "PCI-SIG: PCIe 3.0 8 GT/s x16 = 15.75 GB/s per direction, 4.0 = 31.5, 5.0 = 63 (128b/130b encoding)"
LINK_EFFICIENCY = 0.8       # the assumed share (NVLink 2 and 4, PCIe)
NVLINK3_EFFICIENCY = 0.8    # published (above)
NETWORK_EFFICIENCY = 0.96   # published (above)
LINKS: dict[str, Link] = {link.name: link for link in (
    Link(name="nvlink2", bytes_per_s=150 * GB, latency_s=3.4e-6, efficiency=LINK_EFFICIENCY, source=_V100_SXM2),
    Link(name="nvlink3", bytes_per_s=300 * GB, latency_s=3.4e-6, efficiency=NVLINK3_EFFICIENCY, source=_A100),
    Link(name="nvlink4", bytes_per_s=450 * GB, latency_s=3.4e-6, efficiency=LINK_EFFICIENCY, source=_H100),
    Link(name="pcie3", bytes_per_s=15.75 * GB, latency_s=5.7e-6, efficiency=LINK_EFFICIENCY, source=_PCIE),
    Link(name="pcie4", bytes_per_s=31.5 * GB, latency_s=5.7e-6, efficiency=LINK_EFFICIENCY, source=_PCIE),
    Link(name="pcie5", bytes_per_s=63 * GB, latency_s=5.7e-6, efficiency=LINK_EFFICIENCY, source=_PCIE),
)}
INTRA_LINKS = (*LINKS, "nvswitch", "auto")

# The node's network, total Gb/s (a node with 8 HDR NICs: 8 x 200 = 1600). Named examples of one NIC each.
NETWORK_GBPS = {"ib-edr": 100, "ib-hdr": 200, "ib-ndr": 400, "eth-25": 25, "eth-100": 100}
NETWORK_LATENCY_S = 14e-6      # one inter-node ring step (tuning.cc, NET / Ring / Simple)
COLLECTIVE_LATENCY_S = 8.4e-6  # every collective's base (tuning.cc, baseLatencies Ring / Simple)
# "Inter-node rings still have to launch nsteps * net overhead" (tuning.cc, ncclTopoTuneModel): in a ring that spans
# nodes every step, inside a node too, costs at least the network's post overhead, x3 with the Simple protocol.
# getNetOverhead (tuning.cc): 1 us on an Intel x86 host, 2 us on an AMD one, 1 us otherwise.
NET_OVERHEAD_S = {"intel": 1e-6, "amd": 2e-6, "other": 1e-6}
SIMPLE_NET_OVERHEAD_FACTOR = 3
HOST_CPUS = (*NET_OVERHEAD_S, "auto")
# The host CPU of each GPU kind's reference node (`auto`), per NVIDIA's datasheets: DGX-1 (2 x Intel Xeon E5-2698 v4)
# and DGX-2 (2 x Intel Xeon Platinum 8168) for V100 SXM; DGX A100 (2 x AMD EPYC 7742); DGX H100 (2 x Intel Xeon
# Platinum 8480C) and DGX H200 (the same two Xeons). PCIe cards have no reference node: NCCL's default.
NODE_CPU = {"V100-16GB": "intel", "V100-32GB": "intel", "A100-40GB": "amd", "A100-80GB": "amd", "H100-SXM": "intel",
            "H200-SXM": "intel"}


def gpu(name: str) -> GPU:
    """The preset named `name` (case-insensitive; SXM is the default where both exist), or the one a device name as
    torch and nvidia-smi print it is ("NVIDIA A100-SXM4-40GB", "Tesla T4": `preset_for`), else a ValueError naming
    every known one."""
    key = {k.lower(): k for k in (*GPUS, *ALIASES)}.get(name.lower()) or preset_for(name)
    if key is None:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")
    return GPUS[ALIASES.get(key, key)]


# An NVLink bridge joins two PCIe cards at 600 GB/s, 300 per direction: NVLink 3's figure. The A100 PCIe's (its
# datasheet, _A100: "NVIDIA NVLink Bridge for 2 GPUs: 600 GB/s") and the H100 PCIe's (NVIDIA H100 datasheet, PCIe:
# "NVLink: 600GB/s", a 2-way bridge; slower than the SXM part's NVLink 4, so `nvlink4` is refused there).
NVLINK_BRIDGE = {"A100-40GB-PCIE": "nvlink3", "A100-80GB-PCIE": "nvlink3", "H100-PCIE": "nvlink3"}


def links_for(gpu_kind: GPU, gpus_per_node: int = 1) -> list[str]:
    """The links a node of `gpus_per_node` such GPUs can have: its own NVLink (and NVSwitch) on an SXM part, a
    bridge on a pair of bridgeable PCIe cards, and its PCIe generation or an older one (an older slot)."""
    names = [gpu_kind.nvlink, "nvswitch"] if gpu_kind.nvlink else []
    if gpu_kind.name in NVLINK_BRIDGE and gpus_per_node == 2:
        names.append(NVLINK_BRIDGE[gpu_kind.name])
    generations = ("pcie3", "pcie4", "pcie5")
    return [*names, *generations[:generations.index(gpu_kind.host_link) + 1]]


def auto_intra(gpu_kind: GPU) -> str:
    """The link `auto` names inside a node: NVSwitch where the GPU has NVLink, else its PCIe generation."""
    return "nvswitch" if gpu_kind.nvlink else gpu_kind.host_link


def intra_link(name: str, gpu_kind: GPU, gpus_per_node: int = 1) -> Link:
    """The link inside a node; `nvswitch` is the NVLink of the GPU's own generation; `auto` that where the GPU has
    NVLink, else its PCIe generation. A link the GPU cannot have (NVLink 4 on a V100, NVLink on a T4) is refused."""
    if name == "auto":
        name = auto_intra(gpu_kind)
    if name not in INTRA_LINKS:
        raise ValueError(f"unknown link {name!r}; known: {', '.join(INTRA_LINKS)}")
    allowed = links_for(gpu_kind, gpus_per_node)
    if name not in allowed:
        raise ValueError(f"{gpu_kind.name} cannot have {name} in a node of {gpus_per_node} GPU(s); its links: "
                         f"{', '.join(allowed)}")
    return LINKS[gpu_kind.nvlink if name == "nvswitch" and gpu_kind.nvlink else name]


# The most GPUs one node of these presets holds: 16 (NVIDIA DGX-2 and HGX-2, 16 V100 over NVSwitch; HGX A100 16-GPU);
# DGX A100 and H100 hold 8. More in one node is a typo (1000 "GPUs per node"), not a machine.
MAX_GPUS_PER_NODE = 16
# The most nodes a cluster may have: 65,536 (over a million GPUs at 16 per node). The largest GPU clusters reported
# by 2025 hold ~10^5 GPUs; a million nodes is a typo, and the prediction's time grows with the ranks.
MAX_NODES = 65_536
# A node's network, where it has one: from 0.1 Gb/s (100 Mb/s Ethernet, the slowest link anyone trains over) to
# 100,000 Gb/s (15x the fastest node networks of 2025, 8 x 800 Gb/s NICs). Outside that it is a typo or a unit slip
# (bits per second for Gb/s), and its prediction (10^298 s per step at 1e-300 Gb/s) would be read as an answer.
MIN_INTER_GBPS, MAX_INTER_GBPS = 0.1, 100_000.0


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """GPUs per node x GPU kind + the link inside a node + the node's network (total Gb/s)."""

    gpu: GPU
    gpus_per_node: int = 1
    nodes: int = 1
    intra: str = "auto"
    inter_gbps: float = 0.0
    host_cpu: str = "auto"  # the nodes' CPU vendor (intel, amd, other): NCCL's network overhead; auto: NODE_CPU

    def __post_init__(self) -> None:
        # A notebook cell's values as typed: a GPU's name for its preset, 2.5 or True GPUs, "4" nodes
        if not isinstance(self.gpu, GPU):
            raise ValueError(f"gpu must be a GPU preset (hardware.gpu(name)), got {self.gpu!r}")
        for name in ("gpus_per_node", "nodes"):
            whole_number(name, getattr(self, name))
        if isinstance(self.inter_gbps, bool) or not isinstance(self.inter_gbps, numbers.Real):
            raise ValueError(f"inter_gbps must be a number of Gb/s, got {self.inter_gbps!r}")
        # link and CPU names in any case, as GPU names are ("NVSwitch" in a source's table, --intra NVLINK3)
        if not isinstance(self.intra, str) or not isinstance(self.host_cpu, str):
            raise ValueError(f"intra and host_cpu are names, got {self.intra!r} and {self.host_cpu!r}")
        object.__setattr__(self, "intra", self.intra.strip().lower())
        object.__setattr__(self, "host_cpu", self.host_cpu.strip().lower())
        if self.gpus_per_node < 1 or self.nodes < 1:
            raise ValueError("gpus_per_node and nodes must be >= 1")
        if self.nodes > MAX_NODES:
            raise ValueError(f"{self.nodes:,} nodes: at most {MAX_NODES:,} (over a million GPUs at {MAX_GPUS_PER_NODE} "
                             "per node, ten times the largest clusters reported)")
        if self.gpus_per_node > MAX_GPUS_PER_NODE:
            raise ValueError(f"{self.gpus_per_node} GPUs per node: the largest node is {MAX_GPUS_PER_NODE} GPUs "
                             "(DGX-2, HGX A100 16-GPU); more GPUs are more --nodes")
        if not math.isfinite(self.inter_gbps) or self.inter_gbps < 0:
            raise ValueError(f"the node's network bandwidth (inter_gbps; --inter-gbps on the command line) must be "
                             f"a finite bandwidth >= 0 Gb/s, got {self.inter_gbps}")
        if self.inter_gbps > 0 and not MIN_INTER_GBPS <= self.inter_gbps <= MAX_INTER_GBPS:
            raise ValueError(f"the node's network bandwidth (inter_gbps; --inter-gbps on the command line) is in Gb/s, "
                             f"from {MIN_INTER_GBPS:g} ({MIN_INTER_GBPS * 1000:g} Mb/s) to {MAX_INTER_GBPS:,.0f} "
                             f"({MAX_INTER_GBPS / 1000:g} Tb/s), or 0 for one node; got {self.inter_gbps:g}")
        if self.nodes > 1 and self.inter_gbps <= 0:
            raise ValueError("several nodes need the node's network bandwidth in Gb/s (inter_gbps; --inter-gbps on "
                             "the command line)")
        intra_link(self.intra, self.gpu, self.gpus_per_node)  # validates the name and that the GPU can have it
        if self.host_cpu not in HOST_CPUS:
            raise ValueError(f"unknown host CPU {self.host_cpu!r}; known: {', '.join(HOST_CPUS)}")

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    def link(self) -> Link:
        return intra_link(self.intra, self.gpu, self.gpus_per_node)

    def bus_bytes_per_s(self, ranks: int | None = None) -> float:
        """The bus bandwidth a ring over `ranks` GPUs (default: all) gets: inside one node, the intra link;
        across nodes, the slowest of the intra link (where a node has 2 GPUs or more), the node's whole network
        (a ring of NCCL's per NIC: every node sends the full ring volume through its NICs together, so the node's
        total is the limit) and its GPUs' own PCIe links together, which every byte to or from the NICs crosses
        (GPUDirect RDMA: a GPU's x16 link to its NIC; one A100 feeds at most 25 GB/s into any network)."""
        ranks = self.world_size if ranks is None else ranks
        link = self.link()
        intra = link.bytes_per_s * link.efficiency
        if ranks <= self.gpus_per_node or self.nodes == 1:
            return intra
        pcie = self.host_link()
        to_nics = min(self.inter_gbps / 8 * GB * NETWORK_EFFICIENCY,
                      self.gpus_per_node * pcie.bytes_per_s * pcie.efficiency)
        return to_nics if self.gpus_per_node == 1 else min(intra, to_nics)

    def ring_latency_s(self, op: str, ranks: int | None = None) -> float:
        """NCCL's latency of one ring collective (tuning.cc): base + intra-node steps x the link's step latency +
        inter-node steps x the network's (a ring crosses each node boundary once per pass; all-reduce passes twice).
        In a ring across nodes an intra-node step costs at least the host's network overhead x 3 (NET_OVERHEAD_S)."""
        ranks = self.world_size if ranks is None else ranks
        passes = 2 if op == "all_reduce" else 1
        nodes = min(self.nodes, -(-ranks // self.gpus_per_node))
        inter = passes * (nodes - 1)
        intra = passes * (ranks - 1) - inter
        step = self.link().latency_s
        if nodes > 1:
            step = max(step, SIMPLE_NET_OVERHEAD_FACTOR * NET_OVERHEAD_S[self.node_cpu()])
        return COLLECTIVE_LATENCY_S + intra * step + inter * NETWORK_LATENCY_S

    def node_cpu(self) -> str:
        """The nodes' CPU vendor: `host_cpu`, or for `auto` the GPU kind's reference node (NODE_CPU), else other."""
        return NODE_CPU.get(self.gpu.name, "other") if self.host_cpu == "auto" else self.host_cpu

    def host_link(self) -> Link:
        return LINKS[self.gpu.host_link]

    def host_to_device_bytes_per_s(self) -> float:
        """Pinned host -> device copies: measured on this GPU kind if loaded, else its PCIe link x efficiency."""
        measured = self.gpu.measured.pinned_h2d_bytes_per_s if self.gpu.measured else None
        link = self.host_link()
        return measured or link.bytes_per_s * link.efficiency

    def device_to_host_bytes_per_s(self) -> float:
        measured = self.gpu.measured.pinned_d2h_bytes_per_s if self.gpu.measured else None
        link = self.host_link()
        return measured or link.bytes_per_s * link.efficiency

    def describe(self) -> str:
        """What was predicted for, saying which links carry nothing (one GPU: no link; one node: no network)."""
        if self.nodes > 1:
            net = f", {self.nodes} nodes over {self.inter_gbps:g} Gb/s each ({self.node_cpu()} hosts)"
        else:
            net = f", one node: its {self.inter_gbps:g} Gb/s network unused" if self.inter_gbps > 0 else ""
        if self.gpus_per_node == 1:
            link = "one GPU: no link inside the node" if self.intra == "auto" else f"{self.intra} unused: one GPU"
        else:
            link = self.intra if self.intra != "auto" else f"{self.intra_name()}, auto"
        return f"{self.gpus_per_node} x {self.gpu.name} per node ({link}){net}"

    def intra_name(self) -> str:
        """The link inside a node by its INTRA_LINKS name, `auto` resolved as `intra_link` resolves it."""
        return auto_intra(self.gpu) if self.intra == "auto" else self.intra

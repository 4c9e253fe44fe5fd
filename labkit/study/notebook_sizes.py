"""Every notebook's sizes, per profile (`ci`, `workshop`, `full`: labkit.runtime.profiles), in one place.

Each notebook's parameters cell reads its own: `SIZES = notebook_sizes.sizes_for("01")`, a dict keyed by
profile, so `SIZES[profile]` works after papermill's `-p profile ...` too. Values that depend on the machine
are resolved for its devices there:

- `world_size="all"`: one rank per device; an int is capped at the devices present;
- `precision="half"`: bf16 where the GPU computes it natively (compute capability 8.0+), else fp16 (a T4),
  fp32 on CPU; `"bf16_or_fp32"` for the plain PyTorch loop, which has no loss scaler for fp16.

`notebook_configs` builds the runs a notebook launches from its sizes (the same fields its cells pass to
`RunConfig`), and `labkit.study.device_need.predicted_device_bytes` what one rank of such a run holds
(labkit.core.memory's model states, DeepSpeed's reduce bucket, the MLP's activations and a working margin, or the
optimizer step's peak where that is larger):
tests/study/test_notebook_sizes.py
checks every notebook's runs for every profile against stand-in GPUs of 16, 24 and 80 GB, with and without
bf16, on 1, 4 and 8 GPUs.

A notebook's script runs (`labkit run --script` of notebooks/examples/) are modelled by the labkit run that
trains the same model (`labkit.study.examples.script_twin`). A notebook added later gets its sizes here
("06": {"ci": ..., "workshop": ..., "full": ...}) and its runs in `notebook_configs`, and the test checks them too.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from labkit.core.config import RunConfig
from labkit.runtime.devices import Devices
from labkit.runtime.profiles import PROFILE_NAMES

NOTEBOOKS: dict[str, dict[str, dict[str, Any]]] = {
    "00": {
        # one CPU rank, three steps of a small model: a smoke test of the whole chain.
        "ci": dict(example="zero3", world_size=1, micro_batch=16, hidden=256, depth=1, steps=3, dataset_size=512),
        # every GPU, a model that is still quick.
        "workshop": dict(example="zero3", world_size="all", micro_batch=64, hidden=1024, depth=2, steps=10),
        "full": dict(example="zero3", world_size="all", micro_batch=64, hidden=4096, depth=2, steps=10),
    },
    "01": {
        # a 1.2M-parameter MLP on one CPU process, three micro-batches that fit the emulated capacity.
        "ci": dict(hidden=1024, depth=2, steps=4, micro_batches=[64, 256, 1024],
                   emulated_capacity_bytes=40 * 2**20),  # EMULATED device capacity (CPU has none per rank)
        # a 3.3M-parameter MLP (53 MB of fp32 model states): activations dominate, so the boundary the notebook
        # predicts is a micro-batch of ~0.9M on 16 GB and ~4.7M on 80 GB, and the 1.5x overshoot runs out of
        # memory in its first forward. Its measured micro-batches need 1.1 GB at most.
        "workshop": dict(hidden=1024, depth=4, steps=4, micro_batches=[4096, 16384, 65536],
                         emulated_capacity_bytes=None),  # None: the GPU's own memory is the limit
        # a ~0.8B-parameter MLP: ~13 GB of fp32 model states (16 bytes per parameter); micro-batches that fit 80 GB.
        "full": dict(hidden=16384, depth=4, steps=4, micro_batches=[1024, 4096, 16384],
                     emulated_capacity_bytes=None),
    },
    "02": {
        # a 1.2M-parameter MLP, fp32, one CPU process.
        "ci": dict(hidden=1024, depth=2, micro_batch=64, steps=6, precision="fp32"),
        # a 118M-parameter MLP in half precision on one GPU: 1.9 GB of model states at stage 0, 1.4 GB of them
        # the optimizer's, which offload moves to the host.
        "workshop": dict(hidden=4096, depth=8, micro_batch=64, steps=10, precision="half"),
        # a ~200M-parameter MLP: the optimizer states are GBs.
        "full": dict(hidden=8192, depth=4, micro_batch=64, steps=10, precision="half"),
    },
    "03": {
        # a 1.2M-parameter MLP, fp32, on 1 and 2 CPU ranks; Example 3's script runs 2 x timing_steps steps
        # at its config's micro-batch (64) on each world size.
        "ci": dict(hidden=1024, depth=2, micro_batch=32, steps=6, dataset_size=2048, precision="fp32",
                   world_sizes=[1, 2], timing_steps=8),
        # a 118M-parameter MLP in half precision on up to 4 GPUs (sizes above the GPU count are skipped):
        # 1.9 GB of states and DeepSpeed's 1 GB reduce bucket on one 16 GB rank.
        "workshop": dict(hidden=4096, depth=8, micro_batch=64, steps=10, dataset_size=16384, precision="half",
                         world_sizes=[1, 2, 4], timing_steps=20),
        # a ~470M-parameter MLP on up to 8 GPUs.
        "full": dict(hidden=8192, depth=8, micro_batch=64, steps=10, dataset_size=65536, precision="half",
                     world_sizes=[1, 2, 4, 8], timing_steps=20),
    },
    "03a": {
        # 03's ci model on 1 and 2 CPU ranks: its two partitioned modules are what the comms log reads.
        "ci": dict(hidden=1024, depth=2, micro_batch=32, steps=6, dataset_size=2048, precision="fp32",
                   world_sizes=[1, 2]),
        # 03's workshop model (118M parameters) on up to 4 GPUs: seven 32 MiB hidden layers in half precision,
        # so DeepSpeed's default reuse distance keeps ~0.2 GB more gathered at the peak than 0 does.
        "workshop": dict(hidden=4096, depth=8, micro_batch=64, steps=10, dataset_size=16384, precision="half",
                         world_sizes=[1, 2, 4]),
        # a ~470M-parameter MLP on up to 8 GPUs: just below the ~0.5B where the default stops keeping the
        # first layer gathered (0.75 GiB more at the peak than reuse distance 0).
        "full": dict(hidden=8192, depth=8, micro_batch=64, steps=10, dataset_size=65536, precision="half",
                     world_sizes=[1, 2, 4, 8]),
    },
    "03b": {
        # a 1.2M-parameter MLP (100 -> 1024 -> 1024 -> 10), fp32, 2 CPU ranks, 2 micro-batches per step; the
        # link fit from 1 KiB to 16 MiB, the prediction up to 64 ranks. Every section needs 2+ ranks except
        # the formulas of sections 1 and 4 (one GPU: computed for 2 ranks, nothing launched).
        "ci": dict(hidden=1024, depth=2, micro_batch=32, grad_accum=2, steps=5, dataset_size=2048, precision="fp32",
                   world_size=2, timing_steps=12, link_sizes=[4**k * 1024 for k in range(8)], predict_up_to=64),
        # 03's workshop model (118M parameters, 0.24 GB of half-precision gradients) on up to 4 GPUs: messages
        # up to 256 MiB for the link fit, so its bandwidth term is measured at the model's own gradient size.
        "workshop": dict(hidden=4096, depth=8, micro_batch=16, grad_accum=2, steps=6, dataset_size=16384,
                         precision="half", world_size=4, timing_steps=20,
                         link_sizes=[4**k * 1024 for k in range(10)], predict_up_to=64),
        # a ~470M-parameter MLP on up to 8 GPUs (NCCL), messages up to 256 MiB for the link fit.
        "full": dict(hidden=8192, depth=8, micro_batch=16, grad_accum=2, steps=6, dataset_size=65536,
                     precision="half", world_size=8, timing_steps=20, link_sizes=[4**k * 1024 for k in range(10)],
                     predict_up_to=512),
    },
    "04a": {
        # The LR lessons' five runs (lessons.sgd_scaling_configs, lessons.warmup_configs), one rank each, stage 0, with
        # the settings lessons.LR_LESSONS measured for this model: a 94k-parameter MLP, seconds on any device, so the
        # same in every profile (04 itself reads results and launches nothing).
        "ci": dict(lesson_model="mlp"),
        "workshop": dict(lesson_model="mlp"),
        "full": dict(lesson_model="mlp"),
    },
    "05": {
        # a few seconds of training on 2 CPU ranks (process start and DeepSpeed init dominate).
        "ci": dict(example="zero3", world_size=2, micro_batch=32, steps=20, hidden=256, depth=1, dataset_size=2048),
        # every GPU, a model big enough for ZeRO's savings to show.
        "workshop": dict(example="zero3", world_size="all", micro_batch=64, steps=200, hidden=4096, depth=4,
                         precision="half"),
        "full": dict(example="zero3", world_size="all", micro_batch=64, steps=200, hidden=4096, depth=4,
                     precision="half"),
    },
}
# The share of a device a notebook's run may plan for.
FIT_MARGIN = 0.8


def precision_for(spec: str, devices: Devices) -> str:
    """A precision spec of NOTEBOOKS resolved for `devices` (module doc)."""
    if spec == "half":
        if devices.is_cpu:
            return "fp32"  # CPU ranks: no half-precision speed-up to teach with
        return "bf16" if devices.bf16 else "fp16" if devices.fp16 else "fp32"
    if spec == "bf16_or_fp32":
        return "bf16" if devices.bf16 else "fp32"
    return spec


def resolve(sizes: dict[str, Any], devices: Devices) -> dict[str, Any]:
    """One profile's sizes with `world_size` and `precision` resolved for `devices`."""
    out = dict(sizes)
    if "world_size" in out:
        out["world_size"] = devices.max_ranks if out["world_size"] == "all" else min(out["world_size"],
                                                                                     devices.max_ranks)
    if "precision" in out:
        out["precision"] = precision_for(out["precision"], devices)
    return out


def sizes_for(notebook: str, devices: Devices | None = None) -> dict[str, dict[str, Any]]:
    """{profile: sizes} of `notebook` ("00", "01", ...), resolved for `devices` (default: this machine's)."""
    if notebook not in NOTEBOOKS:  # a bare KeyError '99' before
        raise ValueError(f"unknown notebook {notebook!r}; known: {', '.join(NOTEBOOKS)}")
    if devices is None:
        from labkit.runtime.devices import detect_devices

        devices = detect_devices()
    return {profile: resolve(NOTEBOOKS[notebook][profile], devices) for profile in PROFILE_NAMES}


def notebook_configs(notebook: str, sizes: dict[str, Any], devices: Devices,
                     work_dir: str | Path | None = None) -> dict[str, RunConfig]:
    """The runs `notebook` launches with one profile's resolved `sizes` (its cells' own RunConfig fields, script
    runs included), on a machine with `devices`; empty where it launches nothing there (03b on one GPU). Needs
    `detect_devices()` to answer for those devices (RunConfig checks them). `work_dir`: where a script run's copy
    of its DeepSpeed config is written, as the notebook writes it (default: a new temporary directory)."""
    if notebook in ("00", "05"):
        return {notebook: RunConfig(**sizes)}
    if notebook == "01":
        largest = max(sizes["micro_batches"])
        return {f"micro {mb}": RunConfig(example="pytorch", micro_batch=mb, hidden=sizes["hidden"],
                                         depth=sizes["depth"], steps=sizes["steps"], dataset_size=largest,
                                         device_memory_budget_bytes=sizes["emulated_capacity_bytes"])
                for mb in sizes["micro_batches"]}
    if notebook == "02":
        model = dict(hidden=sizes["hidden"], depth=sizes["depth"], micro_batch=sizes["micro_batch"],
                     steps=sizes["steps"], precision=sizes["precision"], world_size=1)
        configs = {f"stage {s}": RunConfig(example="deepspeed", stage=s, **model) for s in (0, 1, 2)}
        configs.update({f"stage {s} + offload": RunConfig(example="offload", stage=s, **model) for s in (1, 2, 3)})
        return configs
    if notebook in ("03", "03a"):
        return _zero3_notebook_configs(notebook, sizes, devices, work_dir)
    if notebook == "03b":
        return _communication_configs(sizes)
    if notebook == "04a":
        from labkit.study import lessons

        return {**lessons.sgd_scaling_configs(sizes["lesson_model"]), **lessons.warmup_configs(sizes["lesson_model"])}
    raise KeyError(f"no sizes for notebook {notebook!r}: NOTEBOOKS has {sorted(NOTEBOOKS)}")


def _zero3_notebook_configs(notebook: str, sizes: dict[str, Any], devices: Devices,
                            work_dir: str | Path | None) -> dict[str, RunConfig]:
    """03: Example 3's script on each world size (section 2), labkit's ZeRO-3 worker on each and once without a
    sampler (section 3). 03a: the worker on each world size, the comms-logged run without a sampler at reuse
    distance 0 and at DeepSpeed's default, and stages 0-2 on the largest (sections 1-3)."""
    model = dict(hidden=sizes["hidden"], depth=sizes["depth"], micro_batch=sizes["micro_batch"],
                 steps=sizes["steps"], dataset_size=sizes["dataset_size"], precision=sizes["precision"])
    world_sizes = [w for w in sizes["world_sizes"] if w <= devices.max_ranks]
    largest = max(world_sizes)
    configs: dict[str, RunConfig] = {}
    if notebook == "03":
        from labkit.study import examples

        config_args = []
        if sizes["precision"] != "fp32":
            out = work_dir if work_dir is not None else tempfile.mkdtemp(prefix="labkit-notebook-sizes-")
            variant = examples.config_variant("ex3_ds_config.json", out, **{sizes["precision"]: {"enabled": True}})
            config_args = ["--deepspeed_config", str(variant)]
        script_args = ["--hidden", str(sizes["hidden"]), "--depth", str(sizes["depth"]),
                       "--num-samples", str(sizes["dataset_size"]), *config_args]
        configs.update({f"script, {w} rank(s)": examples.script_config(
            "ex3_zero3.py", world_size=w, steps=2 * sizes["timing_steps"], args=script_args) for w in world_sizes})
    configs.update({f"{w} rank(s)": RunConfig(example="zero3", world_size=w, **model) for w in world_sizes})
    if largest == 1:
        return configs
    if notebook == "03":
        configs[f"{largest} ranks, no sampler"] = RunConfig(example="zero3", world_size=largest,
                                                            distributed_sampler=False, **model)
        return configs
    from labkit.study import lessons

    logged = {**lessons.comms_logger_overrides(),
              "zero_optimization": {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}}
    default_reuse = {**logged, "zero_optimization": {"stage3_prefetch_bucket_size": 0}}
    for label, overrides in (("", logged), (", default reuse distance", default_reuse)):
        configs[f"{largest} ranks, no sampler{label}"] = RunConfig(
            example="zero3", world_size=largest, distributed_sampler=False, ds_overrides=overrides, **model)
    configs.update({f"stage {s}, {largest} ranks": RunConfig(example="deepspeed", stage=s, world_size=largest,
                                                             **model) for s in (0, 1, 2)})
    return configs


def _communication_configs(sizes: dict[str, Any]) -> dict[str, RunConfig]:
    """03b: every strategy with DeepSpeed's comms logger on (section 2), then stage 0 timed on 1 and N ranks
    (section 6); nothing on one rank, where there is no link."""
    world = sizes["world_size"]
    if world < 2:
        return {}
    model = dict(hidden=sizes["hidden"], depth=sizes["depth"], micro_batch=sizes["micro_batch"],
                 dataset_size=sizes["dataset_size"], precision=sizes["precision"])
    strategies = {"stage 0": (0, False), "stage 1": (1, False), "stage 2": (2, False),
                  "stage 2 + offload": (2, True), "stage 3": (3, False)}
    configs = {label: RunConfig(example="offload" if offload else "deepspeed", stage=stage, world_size=world,
                                grad_accum=sizes["grad_accum"], steps=sizes["steps"], comms_log=True, **model)
               for label, (stage, offload) in strategies.items()}
    configs.update({f"timed, {w} rank(s)": RunConfig(example="deepspeed", stage=0, world_size=w, threads_per_rank=1,
                                                     grad_accum=1, steps=sizes["timing_steps"], **model)
                    for w in (1, world)})
    return configs

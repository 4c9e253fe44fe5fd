"""The answer's profiles (`python -m labkit answer --profile NAME`): what each sweeps, on which model, and the sizes
the GPT takes in place of the MLP. Data only, below the answer and the predictor (which predicts for an answer's
model)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from labkit.core.config import ConfigError
from labkit.study.sweep import STRATEGIES


@dataclass(frozen=True)
class AnswerProfile:
    name: str
    model: dict[str, Any]                 # RunConfig fields shared by every point
    strategies: tuple[str, ...]           # the sweep grid
    global_batches: tuple[int, ...]       # growth "micro_batch": these global batches on max(world_sizes) ranks
    world_sizes: tuple[int, ...] | None   # None: every device this machine has (one rank each)
    # growth "ranks": this per-rank micro-batch on 1, 2, 4, ... up to max(world_sizes) ranks
    # (None: the middle global batch's micro-batch, so that point is shared by both ways).
    rank_growth_micro_batch: int | None = None
    rank_growth_strategies: tuple[str, ...] = ("torch", "z0", "z3")
    # growth "grad_accum": these accumulation steps at the "ranks" micro-batch on max(world_sizes) ranks
    # (accumulation 1 is the point the other ways share). ZeRO-2/3 reduce gradients at every micro-step,
    # stage 0 at the boundary only (deepspeed/runtime/engine.py:3084-3095 in 0.19.8): both are measured.
    accum_growth: tuple[int, ...] = (1, 4, 16)
    accum_growth_strategies: tuple[str, ...] = ("z0", "z2", "z3")
    cpu_threads_per_rank: int | None = None  # CPU: threads per rank (None: cores // max ranks, one "device" each)
    memory_only: tuple[str, ...] = ()     # strategies run at the smallest batch only (memory comparison)
    lr_study_strategy: str | None = None  # runs the other LR scalings too
    # ...at these global batches (None: the grid's). Past the grid's largest micro-batch a batch is reached by
    # gradient accumulation at that micro-batch (it fits: the grid ran it).
    lr_study_batches: tuple[int, ...] | None = None
    lr_scalings: tuple[str, ...] = ("none", "linear", "sqrt")
    grid_lr_scaling: str = "sqrt"         # Adam: sqrt scaling (Malladi et al. 2022); SGD: linear
    maxbatch_strategies: tuple[str, ...] = ()
    maxbatch_start: int = 1
    maxbatch_tolerance: float = 0.0
    cpu_budget_bytes: int | None = None   # emulated device capacity per rank, CPU only
    parallel: int = 1                     # max-batch searches at once on CPU (untimed); timed runs: one at a time
    notes: tuple[str, ...] = field(default_factory=tuple)


PROFILES: dict[str, AnswerProfile] = {
    # Meant for ~10 minutes on 2 CPU cores, timed runs one at a time (data/reference-ci/machine.json
    # has the figure): a 320k-parameter MLP (its 512x512 layer is big enough for ZeRO-3 to partition);
    # growth "micro_batch": micro-batch 16, 64, 256 per rank on 2 ranks; growth "ranks": micro-batch 64
    # on 1 and 2 ranks; growth "grad_accum": micro-batch 64 x 1, 4, 16 on 2 ranks; every rank one thread
    # (one core: a "device"). The LR study spans 32-2048 (seven batches) so that the critical-batch fit
    # has data on both sides of it: with three batches its wild bootstrap had 8 distinct resamples.
    "ci": AnswerProfile(
        name="ci",
        model=dict(hidden=512, depth=2, dataset_size=8192, optimizer="adam", lr=2e-3, base_batch=64,
                   warmup_samples=1024, target_loss=0.8, stop_at_target=True, steps=600, noise_scale_every=4,
                   eval_every=4, eval_samples=1024, heartbeat_s=300.0),
        strategies=("torch", "z0", "z2", "z3", "z2-offload"),
        global_batches=(32, 128, 512),
        world_sizes=(2,),
        memory_only=("z1",),
        lr_study_strategy="z0",
        lr_study_batches=(32, 64, 128, 256, 512, 1024, 2048),
        # Stage 0 is not searched: it holds the same unpartitioned fp32 states per rank as plain PyTorch
        # (labkit.study.growth compares ZeRO-3 with plain PyTorch's search instead), which saves ~8 launches.
        maxbatch_strategies=("torch", "z3"),
        maxbatch_start=64,
        maxbatch_tolerance=0.125,
        cpu_budget_bytes=6_500_000,
        parallel=2,
    ),
    # GPU-sized: a 122M-parameter MLP (1024 -> 8 x 4096 -> 10), batches 64..4096 on every GPU; real
    # out-of-memory errors. The max-batch search starts near the memory model's boundary (maxbatch_start=0:
    # labkit.study.maxbatch.predicted_start) and passes the dataset's end by sampling with replacement:
    # ~5 probes per strategy, not ~90 at the dataset cap.
    "full": AnswerProfile(
        name="full",
        model=dict(hidden=4096, depth=8, input_size=1024, dataset_size=262144, optimizer="adam", lr=3e-4,
                   base_batch=256, warmup_samples=16384, target_loss=0.8, stop_at_target=True, steps=3000,
                   noise_scale_every=10, eval_every=10, eval_samples=8192, precision="bf16"),
        strategies=tuple(STRATEGIES),
        global_batches=(64, 256, 1024, 4096),
        world_sizes=None,
        lr_study_strategy="z0",
        maxbatch_strategies=tuple(STRATEGIES),
        maxbatch_start=0,
        maxbatch_tolerance=0.125,
        cpu_budget_bytes=4_000_000_000,
        parallel=1,
        notes=("For one node of 80 GB GPUs (A100/H100 80GB).",
               "Untested: no run of this profile on such a GPU has been checked yet (labkit's GPU path was read, "
               "not run); treat this report as the first."),
    ),
    # One node of 16-24 GB GPUs (T4, L4, A10G), and the reference run on one GPU (~9 min on an H200: 16 sweep points
    # and 2 searches of ~4 probes from the predicted boundary, at 13-30 s a spawned launch measured there).
    # A 50.7M-parameter MLP (0.81 GB of model states at stage 0) with 100 inputs: activations (~41 KB a sample in
    # bf16) set the boundary, ~0.33M per rank on 16 GB and ~1.9M on 80 GB, where a probe's input batch is
    # still under 1 GB of host memory. Two global batches; the LR study at both.
    "workshop": AnswerProfile(
        name="workshop",
        model=dict(hidden=4096, depth=4, input_size=100, dataset_size=65536, optimizer="adam", lr=1e-3,
                   base_batch=512, warmup_samples=16384, target_loss=0.8, stop_at_target=True, steps=300,
                   noise_scale_every=20, eval_every=10, eval_samples=4096, precision="bf16"),
        strategies=("torch", "z0", "z3", "z2-offload"),
        global_batches=(512, 4096),
        world_sizes=None,
        # Accumulation x16 made the global batch 65,536 on any GPU count: the whole dataset, a step an epoch. On an
        # H200 (data/reference-h200/) its held-out loss came to 0.87 by step 53 and then rose to 6.8 while the
        # training loss went to 2e-7 (memorised): the target was never reached, at 56-107 s a point.
        accum_growth=(1, 4),
        lr_study_strategy="z0",
        lr_study_batches=None,
        maxbatch_strategies=("torch", "z3"),
        maxbatch_start=0,
        maxbatch_tolerance=0.5,  # ~4 probes per strategy from the predicted start (each ~1M samples on 80 GB)
        cpu_budget_bytes=4_000_000_000,
        parallel=1,
        notes=("For one node of 16-24 GB GPUs (T4, L4, A10G); T4 has no bf16, so it runs fp32.",
               "About 9 minutes on one H200 (16 points at 13-30 s each, measured there with spawned launches, "
               "and 2 searches of ~4 probes); longer on T4s, whose steps take ~0.15 s at batch 4096.",
               "Untested as a whole answer: on one H100 80GB (data/reference-h100-80gb/) `make gpu-check` and "
               "every notebook passed, and on one H200 (data/reference-h200/) 14 of its 16 points finished before "
               "the device time ran out, with no max-batch search or report; docs/answer.md has the figures."),
    ),
    # End-to-end check of the command in a couple of minutes (tests, a quick look): a tiny MLP,
    # both growth ways, the LR study, no max-batch search. Its numbers answer nothing.
    "smoke": AnswerProfile(
        name="smoke",
        model=dict(hidden=64, depth=1, dataset_size=1024, optimizer="adam", lr=4e-3, base_batch=16,
                   warmup_samples=64, target_loss=1.9, stop_at_target=True, steps=120, noise_scale_every=4,
                   eval_every=4, eval_samples=256, heartbeat_s=300.0),
        strategies=("torch", "z0", "z3"),
        global_batches=(16, 32),
        world_sizes=(2,),
        rank_growth_micro_batch=8,
        rank_growth_strategies=("torch", "z0"),
        accum_growth=(1, 2),
        accum_growth_strategies=("z0",),
        lr_study_strategy="z0",
        lr_scalings=("none", "sqrt"),
        parallel=1,
    ),
}



# `answer(..., model="gpt")`: the byte-level GPT (labkit.models.gpt) in place of the MLP, per profile.
# Loss in nats per byte; ln 256 = 5.55 at the start, ~2.5 once byte and bigram statistics are learned.
GPT_MODELS: dict[str, dict[str, Any]] = {
    # eval_samples 256 (16k held-out bytes): evaluated every step near the target, the MLP's 1,024 made the
    # eval 30x the training compute of a ci GPT run (74.6 s to target against 2.5 s of steps, measured).
    "ci": dict(model="gpt", hidden=64, depth=2, input_size=64, dataset_size=4096, lr=3e-3, target_loss=2.6,
               eval_samples=256),
    "full": dict(model="gpt", hidden=768, depth=12, input_size=512, dataset_size=65536, lr=3e-4, target_loss=1.5),
    "smoke": dict(model="gpt", hidden=32, depth=1, input_size=32, dataset_size=1024, lr=4e-3, target_loss=3.0),
}
# The profile settings the GPT needs of its own. On CPU the capacity is emulated, and the MLP's 6.5 MB
# would not hold one GPT micro-batch. Measured on the ci GPT (120,576 parameters, 2-step probes):
# activations 1,020,416 bytes per sample + 516; model states on the device 1,929,328 bytes for plain
# PyTorch and 1,688,064 for ZeRO-3 on 2 ranks (every tensor is under its persistence threshold, so
# only grads, Adam states and the master copy are split). ZeRO-3 thus saves 241,264 bytes, a quarter
# of one sample: whatever the capacity, the two strategies' largest micro-batches differ by one at most.
# The capacity sits in the one window where they do differ at the sweep's largest micro-batch (256),
# so every sweep point fits: PyTorch fits 256 (257 needs 264,176,756 bytes), ZeRO-3 fits 257 (needs
# 263,935,492). Telling 256 from 257 needs a search to adjacency (tolerance 0), from 256: ~10 probes each.
# The grid's LR rule is the one the GPT's own LR study picks: no scaling. With the MLP's square root
# (Adam's rule) the LR at batch 512 is 8.5e-3, where this GPT overshoots (142 steps against 58), and the DeepSpeed
# strategies needed 138-155 steps there (data/reference-ci-gpt before this rule); kept at 3e-3, all
# of them (ZeRO-0, ZeRO-3, ZeRO-2 + offload) needed the same 63 steps at batch 128 and 58 at 512.
# The GPT's LR study adds batches below the grid (8 and 16) rather than above it: its gradient noise scale
# (~6 samples) puts its critical batch under the grid's smallest batch, 32, and a batch of 2048 would cost
# ~1.3 s a step on these CPU ranks, several minutes per rule.
GPT_PROFILES: dict[str, dict[str, Any]] = {
    "ci": dict(cpu_budget_bytes=264_056_000, maxbatch_start=256, maxbatch_tolerance=0.0, grid_lr_scaling="none",
               lr_study_batches=(8, 16, 32, 128, 512)),
}


def with_model(profile: AnswerProfile, model: str | None = None, data: str | None = None,
               loss: str | None = None) -> AnswerProfile:
    """The profile training another model: "gpt" (its sizes from GPT_MODELS) or the learner's import
    strings (RunConfig.model/data/loss) with the profile's other settings."""
    if model is None and data is None and loss is None:
        return profile
    fields = dict(profile.model)
    settings: dict[str, Any] = {}
    if model == "gpt":
        if profile.name not in GPT_MODELS:
            raise ConfigError("model", f"'gpt' has sizes for the profiles {', '.join(GPT_MODELS)}, "
                              f"not for {profile.name!r}")
        fields.update(GPT_MODELS[profile.name])
        settings = GPT_PROFILES.get(profile.name, {})
    elif model is not None:
        fields["model"] = model
    fields.update({k: v for k, v in (("data", data), ("loss", loss)) if v is not None})
    suffix = fields["model"].split(":")[0].split(".")[-1] if "model" in fields else (
        # The built-in MLP's profiles name no model (RunConfig's default): on the learner's data or loss it is still
        # the MLP, in a directory of its own per data and loss (their import strings, ':' as '.').
        "-".join(["mlp", *(spec.replace(":", ".") for spec in (data, loss) if spec)]))
    return dataclasses.replace(profile, name=f"{profile.name}-{suffix}", model=fields, **settings)

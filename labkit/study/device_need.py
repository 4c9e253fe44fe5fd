"""What one rank of a run needs on its device, predicted before any launch (the max-batch search starts from it;
tests/study/test_notebook_sizes.py checks every notebook's runs against stand-in GPUs with it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from labkit.core.config import RunConfig

# On top of what is predicted per rank: the CUDA context, cuBLAS's workspaces and the allocator's
# fragmentation (typically 0.5-1 GB together on current GPUs), and the share of the device a run may plan for.
DEVICE_OVERHEAD_BYTES = 2 * 2**30


def predicted_device_bytes(config: RunConfig) -> int:
    """What one rank of `config` (labkit's MLP, or an example script's, through its twin: examples.script_twin)
    holds on its device at its peak, predicted before any launch: the larger of the micro-step's peak
    (`micro_step_bytes`) and the optimizer step's (`optimizer_step_peak_bytes`)."""
    return max(micro_step_bytes(config), optimizer_step_peak_bytes(config))


def micro_step_bytes(config: RunConfig) -> int:
    """A micro-step's peak on one rank: model states (labkit.core.memory; plain PyTorch keeps fp32 states whatever
    its autocast), DeepSpeed's reduce bucket, the activations of a micro-batch, and DEVICE_OVERHEAD_BYTES. Linear in
    the micro-batch (the max-batch search's start solves it for the capacity)."""
    from labkit.core import memory

    config, numels, precision, stage = _run(config)
    bucket = 0 if config.example == "pytorch" else _bucket_bytes(config, stage, precision)
    element = 4 if precision == "fp32" else 2
    activations = config.micro_batch * memory.mlp_activation_bytes_per_sample(
        config.input_size, config.hidden, config.depth, config.output_size, element)
    return _state_bytes(config, numels, precision, stage) + bucket + activations + DEVICE_OVERHEAD_BYTES


def optimizer_step_peak_bytes(config: RunConfig) -> int:
    """The optimizer step's peak on one rank, the activations gone: the states, stage 3's reduce bucket (stages 1-2
    free theirs after the backward), what the step allocates for itself (DeepSpeed's:
    `memory.optimizer_step_bytes`, with the run's `sub_group_size`; plain PyTorch's Adam:
    `memory.plain_adam_step_bytes`), and DEVICE_OVERHEAD_BYTES. DeepSpeed's "Adam" is FusedAdam or, on a GPU without
    nvcc, torch's (labkit.runtime.ops.choose_optimizer_impl, decided in the ranks): the larger of the two."""
    from labkit.core import memory

    config, numels, precision, stage = _run(config)
    if config.example == "pytorch":  # torch.optim.SGD without momentum updates in place: nothing of its own
        held, own = 0, memory.plain_adam_step_bytes(sum(numels)) if config.optimizer == "adam" else 0
    else:
        held = _bucket_bytes(config, stage, precision) if stage == 3 else 0
        sub_group_size = int(config.zero_settings(stage).sub_group_size)
        own = max(memory.optimizer_step_bytes(stage, numels, config.world_size, precision,
                                              bool(config.offload_optimizer), sub_group_size=sub_group_size,
                                              optimizer=optimizer)
                  for optimizer in (("fused_adam", "torch_adam") if config.optimizer == "adam" else ("torch_sgd",)))
    return _state_bytes(config, numels, precision, stage) + held + own + DEVICE_OVERHEAD_BYTES


def _run(config: RunConfig) -> tuple[RunConfig, list[int], str, int]:
    """(the run labkit predicts: a script's twin, its parameters' element counts, the states' precision, the
    stage: 0 for plain PyTorch)."""
    from labkit.models import builders
    from labkit.study import examples

    if config.script is not None:
        config = examples.script_twin(config)
    plain = config.example == "pytorch"
    return (config, builders.param_numels(config), "fp32" if plain else config.precision,
            0 if plain else int(config.stage or 0))


def _bucket_bytes(config: RunConfig, stage: int, precision: str) -> int:
    """DeepSpeed's reduce bucket, as the run's `zero_optimization` overrides size it."""
    from labkit.core import memory

    zero = config.zero_settings(stage)
    return memory.reduce_bucket_bytes(stage, precision, int(zero.reduce_bucket_size), bool(zero.overlap_comm))


def _state_bytes(config: RunConfig, numels: list[int], precision: str, stage: int) -> int:
    from labkit.core import memory
    from labkit.models import builders

    persistent = builders.persistent_params(numels, config.zero_settings(stage).param_persistence_threshold)
    return int(memory.model_state_bytes(sum(numels), stage, config.world_size, precision,
                                        bool(config.offload_optimizer),
                                        persistent_params=persistent if stage == 3 else 0,
                                        optimizer=config.optimizer)["device_bytes"])

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
    holds on its device at its peak, predicted before any launch: model states (labkit.core.memory; plain
    PyTorch keeps fp32 states whatever its autocast), DeepSpeed's reduce bucket, the activations of a
    micro-batch, and DEVICE_OVERHEAD_BYTES."""
    from labkit.core import memory
    from labkit.models import builders
    from labkit.study import examples

    if config.script is not None:
        config = examples.script_twin(config)
    numels = builders.param_numels(config)
    plain = config.example == "pytorch"
    precision = "fp32" if plain else config.precision
    stage = 0 if plain else int(config.stage or 0)
    persistent = builders.persistent_params(numels, config.zero_settings().param_persistence_threshold)
    states = memory.model_state_bytes(sum(numels), stage, config.world_size, precision,
                                      bool(config.offload_optimizer), persistent_params=persistent if stage == 3 else 0)
    bucket = 0 if plain else memory.reduce_bucket_bytes(stage, precision)
    element = 4 if precision == "fp32" else 2
    activations = config.micro_batch * memory.mlp_activation_bytes_per_sample(
        config.input_size, config.hidden, config.depth, config.output_size, element)
    return states["device_bytes"] + bucket + activations + DEVICE_OVERHEAD_BYTES

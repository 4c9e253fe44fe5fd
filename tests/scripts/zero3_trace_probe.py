"""Does DeepSpeed's ZeRO-3 prefetch engage under activation checkpointing? (tests/study/test_zero3_prefetch.py)

    python tests/scripts/zero3_trace_probe.py PORT

One process, gloo, a 4-block model, 3 steps per way to checkpoint (none, torch's reentrant and non-reentrant,
DeepSpeed's own), each on a fresh engine. ZeRO-3 prefetches only while its module trace is complete
(deepspeed/runtime/zero/partitioned_param_coordinator.py: fetch_sub_module, trace_prologue); a recomputed forward
that changed the module order would invalidate the trace every step and leave every gather unprefetched. Prints one
JSON line per step: the mode, fetches made with a complete trace, fetches without one, and invalidations.
"""

import collections
import json
import os
import sys

MODES = ("none", "torch-reentrant", "torch-nonreentrant", "deepspeed")
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed.runtime.zero import partitioned_param_coordinator  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

Coordinator = partitioned_param_coordinator.PartitionedParameterCoordinator
counts: collections.Counter = collections.Counter()
fetch, invalidate = Coordinator.fetch_sub_module, Coordinator._invalidate_trace


def counted_fetch(self, sub_module, forward):
    counts["fetch_with_trace" if self.is_complete_trace() else "fetch_without_trace"] += 1
    return fetch(self, sub_module, forward)


def counted_invalidate(self):
    counts["invalidations"] += 1
    return invalidate(self)


Coordinator.fetch_sub_module, Coordinator._invalidate_trace = counted_fetch, counted_invalidate


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self, mode: str, hidden: int = 64, blocks: int = 4) -> None:
        super().__init__()
        self.mode = mode
        self.embed, self.head = nn.Linear(16, hidden), nn.Linear(hidden, 1)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(blocks))

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            if self.mode == "none":
                x = block(x)
            elif self.mode == "deepspeed":
                x = deepspeed.checkpointing.checkpoint(block, x)
            else:
                x = checkpoint(block, x, use_reentrant=self.mode == "torch-reentrant")
        return self.head(x).pow(2).mean()


config = {"train_micro_batch_size_per_gpu": 8, "zero_allow_untested_optimizer": True,
          "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
          # every parameter partitioned, and a prefetch bucket smaller than any module: each fetch prefetches
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                "stage3_prefetch_bucket_size": 1000}}
deepspeed.init_distributed(dist_backend="gloo")
deepspeed.checkpointing.configure(None, deepspeed_config=config)
x = torch.randn(8, 16, requires_grad=True)
for mode in MODES:
    model = Net(mode)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    for step in range(3):
        counts.clear()
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        print(json.dumps({"mode": mode, "step": step, **counts}), flush=True)

"""ZeRO-3's release and prefetch rules, each where it changes DeepSpeed's gathers (labkit.study.zero3.replay).

Each test replays a small model's recorded trace (`zero3.record`) under settings small enough that one rule of
DeepSpeed 0.19.8's coordinator decides a gather, and compares the all-gather calls with the ones DeepSpeed made: the
element counts of each call's parameters (sorted) in a steady micro-step (the third; the fourth is the same), on 2 CPU
ranks with gloo. This file is its own probe; to re-record the calls of one model (MODELS) under settings named
here (or given as JSON), from the repository's root:

    for r in 0 1; do MASTER_ADDR=127.0.0.1 MASTER_PORT=29533 WORLD_SIZE=2 RANK=$r LOCAL_RANK=$r \\
        .venv/bin/python -m tests.study.test_zero3_rules MODEL SETTINGS... & done; wait

It wraps the coordinator's `__all_gather_params_` (partitioned_param_coordinator.py:582) and prints, on rank 0, one
JSON line per settings: DeepSpeed's version and the calls of step 3 by phase (and whether step 4's were the same).
Line numbers below: deepspeed/runtime/zero/ in 0.19.8.
"""

from __future__ import annotations

import torch
from torch import nn

from labkit.study import zero3

# The settings of the tests (nothing persistent): the probe's SETTINGS
IN_FLIGHT = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 1_000,
             "stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 136}
WINDOW_0 = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}
LIVE_LIMIT = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 1_000,
              "stage3_max_live_parameters": 100}
UNLIMITED = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 1_000}  # limit 1e9 (default)


class Cell(nn.Module):
    """A cell that calls itself once: its 64-element weight is fetched twice before either call releases it."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) / 8)
        self.out = nn.Linear(8, 8)  # 64 + 8

    def forward(self, x: torch.Tensor, again: bool = True) -> torch.Tensor:
        if again:  # the outer call: the inner one, then `out`
            return self.out(self(x, again=False))
        return self.out(torch.tanh(x @ self.weight))


class Recursive(nn.Module):
    """The cell called twice by a model (not the model itself: each call of the model's forward starts a new step,
    parameter_offload.py:304)."""

    in_features = 8

    def __init__(self) -> None:
        super().__init__()
        self.cell = Cell()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cell(x) + self.cell(-x)


class Aliased(nn.Module):
    """A block that keeps a handle on its child's weight (`self.weight is self.inner.weight`, 64 elements) and calls
    the child twice: the block and the child both hold the weight."""

    in_features = 8

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8, bias=False)
        self.weight = self.inner.weight
        self.out = nn.Linear(8, 2, bias=False)  # 16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inner(torch.tanh(self.inner(x))))


class Reused(nn.Module):
    """A Linear (64) called twice in a row between two others (32, 16)."""

    in_features = 4

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 8, bias=False)
        self.shared = nn.Linear(8, 8, bias=False)
        self.last = nn.Linear(8, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.tanh(self.shared(torch.tanh(self.shared(self.first(x))))))


class Chain(nn.Sequential):
    """Three Linears of 48, 60 and 40 elements."""

    in_features = 8

    def __init__(self) -> None:
        super().__init__(nn.Linear(8, 6, bias=False), nn.Linear(6, 10, bias=False), nn.Linear(10, 4, bias=False))


MODELS = {"recursive": Recursive, "aliased": Aliased, "reused": Reused, "chain": Chain}


def loss(model: nn.Module, name: str) -> torch.Tensor:
    x = torch.randn(2, MODELS[name].in_features, generator=torch.Generator().manual_seed(1))
    return (model(x) ** 2).mean()


def calls(name: str, **settings: int) -> tuple[list[list[int]], list[list[int]]]:
    """The replayed all-gathers of MODELS[name]: forward's and backward's, each call's element counts sorted."""
    torch.manual_seed(0)
    model = MODELS[name]()
    r = zero3.replay(zero3.record(model, lambda: loss(model, name)), **settings)
    return [sorted(c) for c in r.forward_calls], [sorted(c) for c in r.backward_calls]


def test_a_parameter_still_in_flight_is_not_released():
    # partitioned_param_coordinator.py:625: __release_param frees only an AVAILABLE parameter, not one a prefetch
    # left INFLIGHT. The model's fetch prefetches all 136 elements (the limit); the inner call's release frees the
    # weight (window 0), the outer call's `out` fetch prefetches it again for the cell's second call (room 136 - 72),
    # and the outer call's release, at the step of that use (:650 lets it through), finds it in flight and keeps it:
    # the second call's fetch gathers nothing.
    # DeepSpeed 0.19.8 on 2 CPU ranks (2026-11-29), the module docstring's probe: MODEL SETTINGS = recursive IN_FLIGHT
    assert calls("recursive", **IN_FLIGHT) == ([[8, 64, 64], [8, 64], [64], [8, 64], [8, 64], [64]],
                                              [[8, 64], [8, 64]])


def test_a_module_called_twice_releases_after_the_backward_of_its_second_call():
    # parameter_offload.py:438: each call's pre-forward hook resets ds_grads_remaining, so only the second call's
    # inputs count and the module's post-backward hook (:522) releases as soon as they have their gradients, between
    # its two backward fetches: with window 0 and no prefetch `shared` is gathered twice in the backward too.
    # DeepSpeed 0.19.8 on 2 CPU ranks (2026-11-29), the module docstring's probe: MODEL SETTINGS = reused WINDOW_0
    assert calls("reused", **WINDOW_0) == ([[32], [64], [64], [16]], [[16], [64], [64], [32]])


def test_the_prefetch_stops_at_the_live_parameter_limit():
    # partitioned_param_coordinator.py:453: a prefetch takes at most stage3_max_live_parameters less the elements
    # already gathered. The Sequential's (parameter-free) fetch may take 100: 48, then 60 (108 >= 100) ends it; the
    # first Linear's fetch finds 108 live, no room; the third Linear is gathered by its own fetch.
    # DeepSpeed 0.19.8 on 2 CPU ranks (2026-11-29), the module docstring's probe:
    # MODEL SETTINGS = chain LIVE_LIMIT UNLIMITED
    assert calls("chain", **LIVE_LIMIT) == ([[48, 60], [40]], [])
    assert calls("chain", **UNLIMITED) == ([[40, 48, 60]], [])  # the default limit: one call


def test_a_parameter_another_module_still_uses_is_not_released():
    # partitioned_param_coordinator.py:625: __release_param frees a parameter only once no fetched module still
    # holds it (ds_active_sub_modules, added at :391, discarded at :527). The child's release after its first call
    # leaves the block holding the shared weight, so its second call gathers nothing; likewise in the backward.
    # DeepSpeed 0.19.8 on 2 CPU ranks (2026-11-29), the module docstring's probe: MODEL SETTINGS = aliased WINDOW_0
    assert calls("aliased", **WINDOW_0) == ([[64], [16]], [[64], [16]])


def _probe(name: str, settings_list: list[dict]) -> None:
    """The calls DeepSpeed makes for MODELS[name] under each settings: one JSON line per settings on rank 0."""
    import collections
    import json
    import logging

    from labkit.runtime.ds_import import import_deepspeed

    import_deepspeed()
    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.zero import partition_parameters
    from deepspeed.runtime.zero import partitioned_param_coordinator as ppc
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    torch.set_num_threads(1)
    deepspeed.utils.logger.setLevel(logging.ERROR)
    deepspeed.init_distributed("gloo", verbose=False)
    log: dict[int, list] = collections.defaultdict(list)
    step = [0]
    coordinator = ppc.PartitionedParameterCoordinator
    gather = coordinator._PartitionedParameterCoordinator__all_gather_params_
    external = partition_parameters.Init._all_gather

    def logged(self, params, forward, quantize=False):  # as the coordinator counts them: those not gathered yet
        todo = sorted(p.ds_numel for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE)
        if todo:
            log[step[0]].append(("forward" if forward else "backward", todo))
        return gather(self, params, forward, quantize)

    def logged_external(self, param_list, async_op=False, hierarchy=None):  # none expected: not modelled
        todo = sorted(p.ds_numel for p in param_list if p.ds_status == ZeroParamStatus.NOT_AVAILABLE)
        if todo:
            log[step[0]].append(("external", todo))
        return external(self, param_list, async_op, hierarchy)

    coordinator._PartitionedParameterCoordinator__all_gather_params_ = logged
    partition_parameters.Init._all_gather = logged_external
    for settings in settings_list:
        log.clear()
        torch.manual_seed(0)
        model = MODELS[name]()
        config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
                  "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30,
                  "zero_optimization": {"stage": 3, **settings}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        for k in range(1, 5):
            step[0] = k
            engine.backward(loss(engine, name))
            step[0] = 0
            engine.step()
        by_phase = {phase: [c for p, c in log[3] if p == phase] for phase in ("forward", "backward", "external")}
        if dist.get_rank() == 0:
            print(json.dumps({"deepspeed": deepspeed.__version__, "model": name, "settings": settings, **by_phase,
                              "step4_same": log[3] == log[4]}), flush=True)


if __name__ == "__main__":
    import json
    import sys

    _probe(sys.argv[1], [json.loads(a) if a.startswith("{") else globals()[a] for a in sys.argv[2:]])

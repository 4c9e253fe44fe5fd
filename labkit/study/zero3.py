"""ZeRO-3's parameter coordinator replayed: the all-gathers DeepSpeed 0.19.8 runs in a steady micro-step.

    from labkit.study import zero3
    trace = zero3.record(model, lambda: model(inputs))   # the module trace, as DeepSpeed's hooks see it
    r = zero3.replay(trace, stage3_prefetch_bucket_size=30_000)
    r.forward_calls, r.backward_calls   # each all-gather call: the element counts of the parameters it gathers
    r.resident_at_turn                  # gathered elements held at the turn from the forward to the backward

From the second step on the coordinator holds a complete trace of the modules its hooks fetched in the first
(`partitioned_param_coordinator.py`, deepspeed 0.19.8, the lines below) and replays it: every module the forward
calls, parameter-free containers included, fetches before its forward (pre-forward hook) and may release after it
(post-forward hook); in the backward each module whose output needs a gradient fetches again (pre-backward hook:
the reverse of the order the forwards ended in) and releases where its inputs need one (post-backward hook). What a
fetch gathers, what it prefetches and what a release keeps follow the coordinator's rules line by line (`replay`),
so the calls match DeepSpeed's comms log byte for byte (tests/study/test_comms.py, on real 2-rank runs).

Not modelled (none of the lab's models or the transformer shapes has them): a module called twice in one forward,
modules with several outputs that receive gradients, outputs the loss does not use, ZeRO-3 leaf modules
(`set_z3_leaf_modules`, `stage3_module_granularity_threshold`), external parameters, and activation checkpointing's
recomputed forward (its fetches are counted as the backward's).
"""

from __future__ import annotations

import bisect
import collections
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Event = tuple[bool, int]  # (fetch: True / release: False, module index into ModuleTrace.owns)


@dataclass(frozen=True)
class ModuleTrace:
    """One micro-step's module hooks as ZeRO-3 meets them."""

    numels: tuple[int, ...]                  # every parameter's elements, by id: model.parameters() order
    owns: tuple[tuple[int, ...], ...]        # every module the forward calls: its own parameters' ids (a tied head's
                                             # is the embedding's)
    forward: tuple[Event, ...]               # pre-forward hooks fetch, post-forward hooks release
    backward: tuple[Event, ...]              # pre-backward hooks fetch, post-backward hooks release
    names: tuple[str, ...] = ()              # each module's name in the model, where recorded

    @classmethod
    def from_layout(cls, modules: Sequence[Sequence[int]], tied_head: bool = False) -> ModuleTrace:
        """A trace of parameter-holding modules called one after the other, nothing around them (`comms.module_layout`'s
        shape; with `tied_head`, the first module's parameters used once more at the end): where no model is at hand."""
        numels: list[int] = []
        owns: list[tuple[int, ...]] = []
        for module in modules:
            owns.append(tuple(range(len(numels), len(numels) + len(module))))
            numels.extend(int(n) for n in module)
        if tied_head and owns:
            owns.append(owns[0])
        forward = tuple(e for m in range(len(owns)) for e in ((True, m), (False, m)))
        return cls(tuple(numels), tuple(owns), forward, _mirror(forward))


def _mirror(forward: Sequence[Event]) -> tuple[Event, ...]:
    """The backward of a forward whose every module's output and input need gradients: its hooks in reverse, each
    module's pre-backward hook (a fetch) where its forward ended, its post-backward hook (a release) where it began."""
    return tuple((not fetch, m) for fetch, m in reversed(forward))


def record(model: Any, run_forward: Callable[[], Any]) -> ModuleTrace:
    """The trace of `model` (on any device, the meta device too) from one forward: forward hooks on every module note
    the order modules start and end and whether their outputs and positional inputs need gradients. DeepSpeed hooks
    every module (parameter_offload.py:`_register_deepspeed_module`); its pre-backward hook rides on the outputs that
    need a gradient (`_pre_backward_module_hook`, :410), its post-backward hook on the positional inputs that do (a
    forward pre-hook, which sees no keyword arguments: `_post_backward_module_hook`, :437, registered at :528)."""
    import torch

    ids: dict[int, int] = {}
    numels: list[int] = []
    for p in model.parameters():  # shared parameters once, as DeepSpeed numbers them (ds_id)
        ids[id(p)] = len(numels)
        numels.append(p.numel())
    index: dict[int, int] = {}
    names = {id(m): n for n, m in model.named_modules()}
    traced: list[str] = []
    owns: list[tuple[int, ...]] = []
    events: list[tuple[str, int]] = []  # ("pre" | "post", module), and the gradient flags beside
    outputs_grad: dict[int, bool] = {}
    inputs_grad: dict[int, bool] = {}

    def needs_grad(value: Any) -> bool:
        if isinstance(value, torch.Tensor):
            return value.requires_grad
        if isinstance(value, Mapping):
            return any(needs_grad(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return any(needs_grad(v) for v in value)
        return False

    def pre(module: Any, args: Any, _kwargs: Any) -> None:
        key = id(module)
        if key not in index:
            index[key] = len(owns)
            traced.append(names.get(key, "?"))
            own = sorted({ids[id(p)] for p in module.parameters(recurse=False)})
            owns.append(tuple(own))
        m = index[key]
        events.append(("pre", m))
        inputs_grad[m] = needs_grad(args)

    def post(module: Any, args: Any, kwargs: Any, output: Any) -> None:
        m = index[id(module)]
        events.append(("post", m))
        outputs_grad[m] = needs_grad(output)

    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    try:
        with torch.enable_grad():
            run_forward()
    finally:
        for h in handles:
            h.remove()
    forward = tuple((kind == "pre", m) for kind, m in events)
    backward = tuple((fetch, m) for fetch, m in _mirror(forward)
                     if (outputs_grad.get(m, False) if fetch else inputs_grad.get(m, False)))
    return ModuleTrace(tuple(numels), tuple(owns), forward, backward, tuple(traced))


def repeat_blocks(trace: ModuleTrace, layers: int,
                  block: re.Pattern[str] = re.compile(r"(^|\.)(h|layers)\.0(\.|$)")) -> ModuleTrace:
    """The trace of a model with `layers` decoder blocks from the recorded trace of its one-block build: the
    block's stretch of hooks (its modules' names match `block`) repeated, its parameters renumbered."""
    if layers == 1:
        return trace
    if len(trace.names) != len(trace.owns):
        raise ValueError("repeat_blocks needs a recorded trace (its modules' names)")
    inside = [bool(block.search(n)) for n in trace.names]
    block_params = sorted({p for m, own in enumerate(trace.owns) if inside[m] for p in own})
    if not block_params:
        raise ValueError(f"no module of the traced model matches the block pattern {block.pattern!r}")
    if block_params != list(range(block_params[0], block_params[-1] + 1)):
        raise ValueError("a block's parameters are not numbered together: cannot repeat it")
    first, width = block_params[0], len(block_params)
    numels = list(trace.numels[:first]) + list(trace.numels[first:first + width]) * layers + \
        list(trace.numels[first + width:])
    shift = (layers - 1) * width

    def renumber(p: int, layer: int) -> int:
        return p + layer * width if first <= p < first + width else p + shift if p >= first + width else p

    owns: list[tuple[int, ...]] = []
    names: list[str] = []
    copies: dict[tuple[int, int], int] = {}
    for m, own in enumerate(trace.owns):
        for layer in range(layers if inside[m] else 1):
            copies[m, layer] = len(owns)
            owns.append(tuple(renumber(p, layer) for p in own))
            names.append(block.sub(_layer_name(layer), trace.names[m]) if inside[m] else trace.names[m])

    def expand(events: Sequence[Event]) -> tuple[Event, ...]:
        out: list[Event] = []
        k = 0
        while k < len(events):
            if not inside[events[k][1]]:
                out.append((events[k][0], copies[events[k][1], 0]))
                k += 1
                continue
            end = k
            while end < len(events) and inside[events[end][1]]:
                end += 1
            stretch = events[k:end]
            if any(inside[m] for _, m in events[end:]):
                raise ValueError("a block's hooks are split by another module's: cannot repeat the block")
            order = range(layers) if events is trace.forward else range(layers - 1, -1, -1)
            out.extend((fetch, copies[m, layer]) for layer in order for fetch, m in stretch)
            k = end
        return tuple(out)

    return ModuleTrace(tuple(numels), tuple(owns), expand(trace.forward), expand(trace.backward), tuple(names))


def _layer_name(layer: int) -> Callable[[re.Match[str]], str]:
    """`repeat_blocks`' name of a block's module in layer `layer`: the first block's name with its index replaced."""
    return lambda g: f"{g[1]}{g[2]}.{layer}{g[3]}"


def persistent_ids(numels: Sequence[int], cfg: Any) -> set[int]:
    """ZeRO-3's persistent parameters: each of at most stage3_param_persistence_threshold elements, while their total
    stays within model_persistence_threshold (parameter_offload.py:317-327, in named_parameters order)."""
    total, keep = 0, set()
    for p, n in enumerate(numels):
        if n <= cfg.param_persistence_threshold and total + n <= cfg.model_persistence_threshold:
            keep.add(p)
            total += n
    return keep


@dataclass(frozen=True)
class Replay:
    forward_calls: list[list[int]]   # each all-gather of the forward: its parameters' element counts
    backward_calls: list[list[int]]  # the same in the backward
    resident_at_turn: int            # gathered (not persistent) elements held once the backward's first module with
                                     # parameters to gather has them (its fetch and prefetch done): the activations'
                                     # peak
    gathering_fetches: int           # fetches of a module whose parameters were gathered for this use (by the fetch
                                     # itself or by an earlier prefetch): the host work of the gather path
    gathered_params_fetched: int     # the partitioned parameters those fetches hold, summed
    persistent: frozenset[int]       # the persistent parameters' ids


def replay(trace: ModuleTrace, **zero_settings: Any) -> Replay:
    """DeepSpeed 0.19.8's coordinator over one steady micro-step of `trace` (every gathered parameter released at
    the start, as after the previous backward), with its `zero_optimization` settings (defaults where not given).
    Line numbers: deepspeed/runtime/zero/partitioned_param_coordinator.py (0.19.8)."""
    from labkit.study import comms

    cfg = comms.zero_config(3, zero_settings)
    numels = trace.numels
    persistent = persistent_ids(numels, cfg)
    limit, bucket, reuse = int(cfg.max_live_parameters), int(cfg.prefetch_bucket_size), int(cfg.max_reuse_distance)
    events = [(fetch, m, True) for fetch, m in trace.forward] + [(fetch, m, False) for fetch, m in trace.backward]
    order = [m for fetch, m, _ in events if fetch]  # __submodule_order: the module of each fetch (step)
    # The parameter trace (:243-249): each step's module's parameters, sorted by id, tagged with the step.
    queue = collections.deque((p, step) for step, m in enumerate(order) for p in sorted(set(trace.owns[m])))
    # Where each parameter is used, and the elements the steps before each step hold, for the reuse window (:656-663)
    uses: dict[int, list[int]] = collections.defaultdict(list)
    before = [0]
    for step, m in enumerate(order):
        for p in trace.owns[m]:
            uses[p].append(step)
        before.append(before[-1] + sum(numels[p] for p in trace.owns[m]))

    gathered: set[int] = set()  # not NOT_AVAILABLE: gathered or in flight
    inflight: set[int] = set()  # prefetched, not yet waited on by a fetch of their module (INFLIGHT, not AVAILABLE)
    active: dict[int, set[int]] = collections.defaultdict(set)  # parameter -> modules using it (ds_active_sub_modules)
    fetched_for: dict[int, int] = collections.defaultdict(lambda: -10**10)  # __most_recent_step_id_param_fetched_for
    available = 0  # __n_available_params
    calls: dict[bool, list[list[int]]] = {True: [], False: []}
    turn = None
    turn_resident = 0
    gathering = gathered_fetched = 0
    fresh: set[tuple[int, int]] = set()  # (parameter, the step of its next use) gathered for that use
    step = 0

    def gather(params: Sequence[int], forward: bool) -> list[int]:  # __all_gather_params_ (:582-600): one call
        nonlocal available
        todo = [p for p in params if p not in gathered and p not in persistent]
        if todo:
            calls[forward].append([numels[p] for p in todo])
            gathered.update(todo)
            available += sum(numels[p] for p in todo)
            for p in todo:
                later = uses[p]
                k = bisect.bisect_left(later, step)
                if k < len(later):
                    fresh.add((p, later[k]))
        return todo

    for fetch, m, forward in events:
        own = sorted(set(trace.owns[m]))
        if fetch:  # _fetch_sub_module_impl (:349-487)
            if turn is None and not forward and any(p not in persistent for p in own):
                turn = step
            if any(p not in gathered and p not in persistent for p in own):  # :365-381
                gather(own, forward)
            inflight.difference_update(own)  # waited on (:384-410): AVAILABLE
            if any((p, step) in fresh for p in own):
                gathering += 1
                gathered_fetched += sum(p not in persistent for p in own)
            for p in own:
                active[p].add(m)
            # pop this module's entries unless a prefetch popped them already (:421-441)
            for _ in [p for p in own if fetched_for[p] < step]:
                p, used_at = queue.popleft()
                fetched_for[p] = used_at
            if bucket > 0:  # prefetch (:452-485): at most one bucket, within the live-parameter limit
                room = min(limit - available, bucket)
                batch: list[int] = []
                numel = 0
                while queue and numel < room:
                    p, used_at = queue.popleft()
                    if p not in gathered and p not in persistent and p not in batch:
                        batch.append(p)
                        numel += numels[p]
                    fetched_for[p] = max(fetched_for[p], used_at)
                if batch:
                    inflight.update(gather(batch, forward))
            step += 1
            if turn == step - 1:
                turn_resident = available
        else:  # release_sub_module (:494-532) with __params_to_release (:634-665) at the current step
            release = [p for p in own if p not in persistent and fetched_for[p] <= step]
            end = bisect.bisect_left(before, before[step] + reuse, lo=step)  # the window scans [step, end) (:656-663)
            for p in own:
                active[p].discard(m)
            for p in release:
                later = uses[p]
                k = bisect.bisect_left(later, step)
                if k < len(later) and later[k] < end:
                    continue  # used again within the reuse window
                if p in gathered and p not in inflight and not active[p]:  # __release_param (:624-631): AVAILABLE
                    gathered.discard(p)
                    available -= numels[p]
    return Replay(calls[True], calls[False], turn_resident, gathering, gathered_fetched, frozenset(persistent))


def record_lab_model(config: Any) -> ModuleTrace:
    """The trace of a RunConfig's model (labkit.models.builders) computing its loss on one sample: on the meta device,
    or on a CPU copy where its forward reads a value (the lab's GPT), as `predict.ModuleWorkload.census` counts it."""
    import torch
    from torch.utils.data import default_collate

    from labkit.models import builders

    sample = default_collate([builders.build_dataset(config)[0]])
    loss_fn = builders.loss_function(config)

    def on(device: str) -> ModuleTrace:
        with torch.device(device), torch.random.fork_rng(devices=[]):
            model = builders.build_model(config)
        inputs, labels = (t.to(device) for t in sample)
        return record(model, lambda: loss_fn(model, inputs, labels))

    try:
        return on("meta")
    except RuntimeError as exc:
        if "meta" not in str(exc):
            raise
        return on("cpu")

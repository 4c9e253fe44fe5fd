"""ZeRO-3's parameter coordinator replayed: the all-gathers DeepSpeed 0.19.8 runs in a steady micro-step.

    from labkit.study import zero3
    trace = zero3.record(model, lambda: loss(model(inputs)))   # the module trace, as DeepSpeed's hooks see it
    r = zero3.replay(trace, stage3_prefetch_bucket_size=30_000)
    r.forward_calls, r.backward_calls   # each all-gather call: the element counts of the parameters it gathers
    r.resident_at_turn                  # gathered elements held at the turn from the forward to the backward

From the second step on the coordinator holds a complete trace of the modules its hooks fetched in the first
(`partitioned_param_coordinator.py`, deepspeed 0.19.8, the lines below) and replays it: every module the forward
calls, parameter-free containers included, fetches before its forward (pre-forward hook) and may release after it
(post-forward hook); in the backward it fetches again as each of its outputs receives a gradient (pre-backward hook)
and releases once its inputs have theirs (post-backward hook), in the order autograd runs them. What a fetch
gathers, what it prefetches and what a release keeps follow the coordinator's rules line by line (`replay`),
so the calls match DeepSpeed's comms log byte for byte (tests/study/test_comms.py, on real 2-rank runs).

`record` runs the hooks' own mechanics, so a module called twice in one forward, a module whose several outputs
receive gradients (one backward fetch each) and outputs the loss does not use (none; their parameters get no
gradient, `ModuleTrace.ungraded`, so ZeRO-3 reduces none) come out as DeepSpeed makes them
(tests.own_model:build_odd_model, a real run in tests/study/test_comms.py), and so do a module registered under two
parents (hooked twice), external parameters (another module's parameter read in a forward, or returned by a
module: `ModuleTrace.owners`) and a recomputed forward under activation checkpointing where the recorded step
checkpoints (its fetches counted in the backward, where they run; DeepSpeed's log tags them forward). Refused: ZeRO-3
leaf modules (`set_z3_leaf_modules`, `stage3_module_granularity_threshold` and `leaf_module` by `comms`, the default
leaf classes, Mixtral's and Qwen-MoE's sparse blocks, by `record`) and a forward that calls other modules from one
step to the next (`record`), and by `comms` gradient accumulation where a module returns a parameter (it stays gathered
across the micro-steps of a step, `ModuleTrace.returned`, while the replay starts each micro-step with everything
released).
"""

from __future__ import annotations

import bisect
import collections
import re
from collections.abc import Callable, Sequence
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
    ungraded: frozenset[int] = frozenset()   # parameters the recorded backward gave no gradient (an unused output)
    # DeepSpeed's external parameters, (module, parameter): another module's parameter a module reads or gets back
    # from a child in its forward, which DeepSpeed then fetches with that module too; which ones depends on whether
    # the parameter is partitioned or persistent (`record`), so both are kept and `replay` picks
    external_if_partitioned: frozenset[tuple[int, int]] = frozenset()
    external_if_persistent: frozenset[tuple[int, int]] = frozenset()
    returned: frozenset[int] = frozenset()   # parameters a module returned: DeepSpeed flags them `is_external_param`
                                             # and no release frees them until the optimizer step (:386, :528)
    # Where `record` was given a `mark` (the ops recorded so far, `zero3_overlap`): for each event of the forward
    # and then the backward, the ops [start, end) from it to the next event (the last one's to the backward's end)
    spans: tuple[tuple[int, int], ...] = ()
    backward_from: int = 0  # the op where the backward began (`loss.backward()`), in the same count

    def hooked_modules(self) -> tuple[float, float]:
        """(parameter-holding, parameter-free) modules per micro-step as ZeRO-3's host costs count them
        (`predict.HostCosts`: one fetch before the forward, one before the backward): the fetches over two, so a
        module called twice counts twice and one never called not at all."""
        fetches = [m for fetch, m in (*self.forward, *self.backward) if fetch]
        holding = sum(1 for m in fetches if self.owns[m])
        return holding / 2, (len(fetches) - holding) / 2

    def owners(self, persistent: set[int] | frozenset[int]) -> list[tuple[int, ...]]:
        """Each module's parameters as DeepSpeed's coordinator iterates them (`iter_params`: its own and its
        external ones), with `persistent` the persistent parameters."""
        owns = [set(own) for own in self.owns]
        for m, p in self.external_if_partitioned:
            if p not in persistent:
                owns[m].add(p)
        for m, p in self.external_if_persistent:
            if p in persistent:
                owns[m].add(p)
        return [tuple(sorted(own)) for own in owns]

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


def record(model: Any, run_step: Callable[[], Any], mark: Callable[[], int] | None = None) -> ModuleTrace:
    """The trace of `model` (on any device, the meta device too) from `run_step()`, which returns the loss: its
    forward and its backward run with DeepSpeed's hooks' mechanics on every module, logging where DeepSpeed would
    fetch and release (parameter_offload.py, 0.19.8):
    - hooks go on every module as DeepSpeed walks them, each parent's children in turn (:353-356), so a module
      registered under two parents is hooked, and fetched, twice per call;
    - a forward pre-hook fetches; a forward hook releases;
    - each output tensor goes through an autograd function whose backward fetches (`_pre_backward_module_hook`, :410;
      `PreBackwardFunctionForModule`, :456-483: once per output tensor that receives a gradient, counted per module);
    - each positional input tensor that needs a gradient goes through one whose backward releases once the last of
      them has its gradient (`_post_backward_module_hook`, :437, a forward pre-hook, so no keyword arguments;
      `PostBackwardFunctionModule`, :498-526; a second call of the module resets the count, as :438 does);
    - external parameters, as the first (recording) step registers them: a parameter read in the forward while no
      module on the forward stack holds it, where it is partitioned (so not available: the recording step releases
      every module's parameters after its forward, partitioned_param_coordinator.py:498-499), becomes the innermost
      module's (the getter, parameter_offload.py:80-93); a parameter a module returns becomes its caller's, partitioned
      or persistent (parameter_offload.py:381-401).
    So the backward's order is autograd's own, and outputs the loss does not use fetch nothing. The step runs twice:
    a forward whose modules differ between steps (DeepSpeed then records its trace again,
    partitioned_param_coordinator.py:195-219, and never prefetches) is refused. The parameters' `.grad` are left as
    they were; anything else the step changes (running statistics, the random state) is not restored. `mark()`, where
    given, says how many ops were recorded so far (a census's, `zero3_overlap`): the trace's `spans` then say which
    ops of the first step ran after each event."""
    import torch
    from deepspeed.runtime.zero.leaf_module_config import DeepSpeedZeroLeafModuleConfig
    from deepspeed.runtime.zero.utils import apply_to_tensors_only

    if torch.is_inference_mode_enabled():  # no autograd at all: no backward to record
        raise ValueError("the step's loss needs a gradient: record runs outside torch.inference_mode")
    leaves = set(DeepSpeedZeroLeafModuleConfig().classes)  # what ZeRO-3 makes a leaf by default (MoE blocks)
    for module in model.modules():
        kind = f"{type(module).__module__}.{type(module).__qualname__}"
        if kind in leaves or getattr(module, "_z3_leaf", False):  # the flag deepspeed.utils.set_z3_leaf_modules sets
            raise ValueError(f"{kind} is a ZeRO-3 leaf module: its fetches are not modelled")
    ids: dict[int, int] = {}
    numels: list[int] = []
    for p in model.parameters():  # shared parameters once, as DeepSpeed numbers them (ds_id)
        ids[id(p)] = len(numels)
        numels.append(p.numel())
    index: dict[int, int] = {}
    names = {id(m): n for n, m in model.named_modules()}
    traced: list[str] = []
    owns: list[tuple[int, ...]] = []
    events: list[Event] = []
    marks: list[int] = []  # mark() at each event

    def log(event: Event) -> None:
        events.append(event)
        marks.append(mark() if mark else 0)

    pending_fetches: dict[int, int] = collections.defaultdict(int)  # applied_pre_backward_ref_cnt
    grads_remaining: dict[int, int] = collections.defaultdict(int)  # ds_grads_remaining
    # External parameters by module key (id), registered by the user (register_external_parameter) or in the
    # recording step: as they come out where the parameter is partitioned, and where it is persistent
    external: dict[bool, dict[int, set[int]]] = {
        persistent: {id(m): {ids[key_p] for key_p in getattr(m, "_external_params", {}) if key_p in ids}
                     for m in model.modules()} for persistent in (False, True)}
    own_ids = {id(m): {ids[id(p)] for p in m.parameters(recurse=False)} for m in model.modules()}
    returned: set[int] = set()
    stack = [id(model)]  # FWD_MODULE_STACK: the model at the bottom (:314-315)
    recording = [True]   # the forward of the first step, where the getter registers (engine.py:2950-2969)

    class PreBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, m: int, x: Any) -> Any:
            ctx.m = m
            pending_fetches[m] += 1
            return x.detach()

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            if pending_fetches[ctx.m] > 0:
                log((True, ctx.m))
                pending_fetches[ctx.m] -= 1
            return None, grad

    class PostBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, m: int, x: Any) -> Any:
            ctx.m = m
            return x.detach()

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            grads_remaining[ctx.m] -= 1
            if grads_remaining[ctx.m] == 0:
                log((False, ctx.m))
            return None, grad

    def read(param: Any) -> None:  # ZeROOrderedDict.__getitem__ (:58-93)
        p = ids.get(id(param))
        if p is None or not recording[0] or len(stack) < 2 or p in returned:  # a returned one stays gathered
            return
        if not any(p in own_ids[k] or p in external[False][k] for k in stack):  # not gathered: registered
            external[False][stack[-1]].add(p)

    def pre(module: Any, args: Any) -> Any:
        key = id(module)
        if key not in index:
            index[key] = len(owns)
            traced.append(names.get(key, "?"))
            owns.append(tuple(sorted(own_ids[key])))
        m = index[key]
        stack.append(key)
        log((True, m))
        grads_remaining[m] = 0

        def wrap(x: Any) -> Any:
            if not x.requires_grad:
                return x
            grads_remaining[m] += 1
            return PostBackward.apply(m, x)

        return apply_to_tensors_only(wrap, args)

    def post(module: Any, args: Any, output: Any) -> Any:
        key = id(module)
        stack.pop()
        for p in {ids[id(x)] for x in _outputs(output) if isinstance(x, torch.nn.Parameter) and id(x) in ids}:
            for registry in external.values():  # a returned parameter (:381-401), partitioned or persistent
                if not any(p in registry[k] for k in stack):
                    registry[stack[-1]].add(p)
                    registry[key].discard(p)
                    returned.add(p)
        m = index[key]
        log((False, m))
        return apply_to_tensors_only(lambda x: PreBackward.apply(m, x), output)

    class Reads(dict):  # a module's parameters, noticing a read (DeepSpeed's ZeROOrderedDict)
        def __getitem__(self, key: str) -> Any:
            param = super().__getitem__(key)
            read(param)
            return param

    handles = []
    swapped = []

    def hook(module: Any) -> None:  # _register_deepspeed_module (:340-356): every visit, children in turn
        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
        for child in module.children():
            hook(child)

    grads = [(p, p.grad) for p in model.parameters()]
    steps = []
    spans: tuple[tuple[int, int], ...] = ()
    backward_from = 0
    try:
        hook(model)
        for module in model.modules():
            swapped.append((module, module._parameters))
            module._parameters = Reads(module._parameters)
        for _ in range(2):
            for p, _ in grads:
                p.grad = None
            events.clear()
            marks.clear()
            with torch.enable_grad():
                loss = run_step()
                turn = len(events)
                if not getattr(loss, "requires_grad", False):
                    raise ValueError("the step's loss needs a gradient (parameters to train, not under "
                                     "inference_mode)")
                recording[0] = False
                started = mark() if mark else 0
                loss.backward()
            steps.append((tuple(events[:turn]), tuple(events[turn:])))
            if mark and not spans:  # the first step's
                ends = [*marks[1:], mark()]
                spans, backward_from = tuple(zip(marks, ends, strict=True)), started
        ungraded = frozenset(ids[id(p)] for p, _ in grads if p.grad is None)
    finally:
        for h in handles:
            h.remove()
        for module, params in swapped:  # the module's own dict back, with what the step changed in it
            params.clear()
            params.update(module._parameters)
            module._parameters = params
        for p, grad in grads:
            p.grad = grad
    if len(ids) != len({id(p) for p in model.parameters()}):
        raise ValueError("the model made parameters in its forward (a lazy module): run a step before recording")
    if steps[0] != steps[1]:
        raise ValueError("the model's forward calls other modules, or in another order, from one step to the next "
                         "(or on its first call only: run a step before recording): DeepSpeed then records its "
                         "trace again, and never prefetches while it differs, which is not modelled")

    def registered(persistent: bool) -> frozenset[tuple[int, int]]:
        return frozenset((index[key], p) for key, ps in external[persistent].items() if key in index for p in ps
                         if p not in own_ids[key])

    return ModuleTrace(tuple(numels), tuple(owns), steps[0][0], steps[0][1], tuple(traced), ungraded,
                       registered(False), registered(True), frozenset(returned), spans, backward_from)


def _outputs(output: Any) -> list[Any]:
    """A module's outputs as DeepSpeed's post-forward hook reads them for returned parameters (parameter_offload.py:
    367-376): a list or tuple's items, a tensor, else a dict's (or an object's attributes') tensors."""
    import torch

    if output is None:
        return []
    if isinstance(output, (list, tuple)):
        return list(output)
    if torch.is_tensor(output):
        return [output]
    items = output if isinstance(output, dict) else getattr(output, "__dict__", {})
    return [v for k, v in items.items() if not str(k).startswith("__") and torch.is_tensor(v)]


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

    def expand(events: Sequence[Event], forward: bool) -> tuple[tuple[Event, int], ...]:
        """The events of `layers` blocks, each with the index of the recorded event it copies."""
        out: list[tuple[Event, int]] = []
        k = 0
        while k < len(events):
            if not inside[events[k][1]]:
                out.append(((events[k][0], copies[events[k][1], 0]), k))
                k += 1
                continue
            end = k
            while end < len(events) and inside[events[end][1]]:
                end += 1
            if any(inside[m] for _, m in events[end:]):
                raise ValueError("a block's hooks are split by another module's: cannot repeat the block")
            order = range(layers) if forward else range(layers - 1, -1, -1)
            out.extend(((events[j][0], copies[events[j][1], layer]), j) for layer in order for j in range(k, end))
            k = end
        return tuple(out)

    forward, backward = expand(trace.forward, True), expand(trace.backward, False)
    # each copy keeps the ops of the event it copies (the last block's span ends where the recorded block's did)
    spans = (tuple(trace.spans[j] for _, j in forward) + tuple(trace.spans[len(trace.forward) + j] for _, j in backward)
             if trace.spans else ())

    ungraded = frozenset(renumber(p, layer) for p in trace.ungraded
                         for layer in (range(layers) if first <= p < first + width else (0,)))

    def external(pairs: frozenset[tuple[int, int]]) -> frozenset[tuple[int, int]]:
        if any(not inside[m] and first <= p < first + width for m, p in pairs):
            raise ValueError("a module outside the block reads a block's parameter: cannot repeat the block")
        return frozenset((copies[m, layer], renumber(p, layer)) for m, p in pairs
                         for layer in (range(layers) if inside[m] else (0,)))

    return ModuleTrace(tuple(numels), tuple(owns), tuple(e for e, _ in forward), tuple(e for e, _ in backward),
                       tuple(names), ungraded, external(trace.external_if_partitioned),
                       external(trace.external_if_persistent),
                       frozenset(renumber(p, layer) for p in trace.returned
                                 for layer in (range(layers) if first <= p < first + width else (0,))), spans,
                       trace.backward_from)


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
    # per fetch (the trace's fetch events in order, the forward's then the backward's): the element counts its own
    # gather call takes (none where everything was resident or in flight), its prefetch call's, and for each of its
    # parameters it waits on the call that took it (by the calls' number in the order they were made)
    fetches: tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...] = ()


def replay(trace: ModuleTrace, **zero_settings: Any) -> Replay:
    """DeepSpeed 0.19.8's coordinator over one steady micro-step of `trace` (every gathered parameter released at
    the start, as after the previous backward), with its `zero_optimization` settings (defaults where not given).
    Line numbers: deepspeed/runtime/zero/partitioned_param_coordinator.py (0.19.8)."""
    from labkit.study import comms

    # what changes the gathers and is not replayed (ZeRO++'s, parameter offload, leaf modules, a stage) is refused by
    # name; the optimizer's offload, either way, changes none of them
    cfg = comms.check_zero_settings(3, zero_settings, offload_optimizer=None)
    numels = trace.numels
    persistent = persistent_ids(numels, cfg)
    owns = trace.owners(persistent)
    limit, bucket, reuse = int(cfg.max_live_parameters), int(cfg.prefetch_bucket_size), int(cfg.max_reuse_distance)
    events = [(fetch, m, True) for fetch, m in trace.forward] + [(fetch, m, False) for fetch, m in trace.backward]
    order = [m for fetch, m, _ in events if fetch]  # __submodule_order: the module of each fetch (step)
    # The parameter trace (:233-248): each step's module's parameters, sorted by id, tagged with the step.
    queue = collections.deque((p, step) for step, m in enumerate(order) for p in owns[m])
    # Where each parameter is used, and the elements the steps before each step hold, for the reuse window (:656-663)
    uses: dict[int, list[int]] = collections.defaultdict(list)
    before = [0]
    for step, m in enumerate(order):
        for p in owns[m]:
            uses[p].append(step)
        before.append(before[-1] + sum(numels[p] for p in owns[m]))

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
    fetches: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = []
    call_of: dict[int, int] = {}  # parameter -> the number of the call that gathered it last
    step = 0

    def gather(params: Sequence[int], forward: bool) -> list[int]:  # __all_gather_params_ (:582-613): one call
        nonlocal available
        todo = [p for p in params if p not in gathered and p not in persistent]
        if todo:
            for p in todo:
                call_of[p] = len(calls[True]) + len(calls[False])
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
        own = owns[m]
        if fetch:  # _fetch_sub_module_impl (:353-490)
            if turn is None and not forward and any(p not in persistent for p in own):
                turn = step
            fetched: list[int] = []
            if any(p not in gathered and p not in persistent for p in own):  # :365-381
                fetched = gather(own, forward)
            waits = tuple(call_of[p] for p in own if p in inflight or p in fetched)  # one per parameter waited on
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
            batch: list[int] = []
            if bucket > 0:  # prefetch (:452-485): at most one bucket, within the live-parameter limit
                room = min(limit - available, bucket)
                numel = 0
                while queue and numel < room:
                    p, used_at = queue.popleft()
                    if p not in gathered and p not in persistent and p not in batch:
                        batch.append(p)
                        numel += numels[p]
                    fetched_for[p] = max(fetched_for[p], used_at)
                if batch:
                    batch = gather(batch, forward)
                    inflight.update(batch)
            fetches.append((tuple(numels[p] for p in fetched), tuple(numels[p] for p in batch), waits))
            step += 1
            if turn == step - 1:
                turn_resident = available
        else:  # release_sub_module (:494-532) with __params_to_release (:634-665) at the current step
            release = [p for p in own if p not in persistent and p not in trace.returned and fetched_for[p] <= step]
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
    return Replay(calls[True], calls[False], turn_resident, gathering, gathered_fetched, frozenset(persistent),
                  tuple(fetches))


def record_lab_model(config: Any) -> ModuleTrace:
    """The trace of a RunConfig's model (labkit.models.builders) computing its loss on one sample: on the meta device,
    or on a CPU copy where its forward reads a value (the lab's GPT: `builders.on_meta_else_cpu`), as the census
    counts it."""
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

    return builders.on_meta_else_cpu(on)

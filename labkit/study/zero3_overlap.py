"""What ZeRO-3's communication costs a micro-step beside the compute, hook by hook, as DeepSpeed 0.19.8 queues it.

    from labkit.study import zero3_overlap
    trace, ops = zero3_overlap.recorded(model, lambda: loss(model(inputs)))  # hooks and ops of one micro-step
    fetches = zero3_overlap.fetches(trace, zero3.replay(trace), op_seconds, gather_s)
    zero3_overlap.micro_step_s(fetches, forward_s=..., backward_s=..., ...)  # the micro-step, its calls played

Two lines decide what hides:
- At every module's fetch (its pre-forward and pre-backward hooks) the coordinator queues the module's own gather if
  its parameters are neither resident nor in flight, makes its all-gather stream wait for the calls that took them
  (`AllGatherCoalescedHandle.wait`, partition_parameters.py:761-795: the call's work, then the copy out of its
  buffer) and then makes the compute stream wait for that stream (`get_accelerator().current_stream().wait_stream(
  self.__allgather_stream)`, deepspeed/runtime/zero/partitioned_param_coordinator.py:415), before it queues that
  hook's prefetch of the modules ahead (:452-485). So a module's compute starts once the call that gathered its
  parameters has finished, prefetched or not.
- torch's ProcessGroupNCCL runs every collective of a process group on one NCCL stream per device, which waits for
  the stream that issued it (`collective()`: `auto ncclStream = ncclStreams_.at(key); syncStream(device,
  ncclEvents_[key], ncclStream)`, torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp). ZeRO-3's gathers and its
  gradients' reduce-scatters go through the same group, so they run one after the other in the order the host
  issues them: a gather finishes only after every call issued before it, and a reduce-scatter starts no earlier than
  the compute that made its gradients (stage3.py:1623, the reduce stream waits for the compute stream; the group is
  the parameters' own, `_get_param_partition_group`, :643). A bucket of gradients is reduce-scattered when the next
  gradient would overflow it (`reduce_bucket_size`, stage3.py:1583) and the last one when the backward ends (:1410),
  in the order their reduce hooks fire.

`micro_step_s` plays one micro-step on two clocks, the compute stream's and the NCCL stream's: the host is taken to
run ahead of the device (it issues each call as soon as it meets the hook or the gradient), and each stretch of
compute between two fetches takes its share of the phase as the model times it (`predict`), slowed beside
communication as `predict.comm_time` slows it. What is left out: the host's own work between hooks (it takes no time
here, but where it bounds the phase) and so its bounds on running ahead (past two fetch events not reached it waits
for the oldest, :403; past `max_param_reduce_events` reduce events, stage3.py:1666: with no time of its own the host
could only wait on gathers the NCCL stream already has), the copy of a
gathered call out of its buffer on the all-gather stream (memory traffic the compute waits for), a gather split into
one call per dtype (partition_parameters.py:1470: one call per module here), and, under activation checkpointing,
where in the backward the recomputed forward's fetches fall (the backward's stretches keep the shares of a backward
without recomputation).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from labkit.study import zero3


def recorded(model: Any, run_step: Callable[[], Any], cuda_dropout: bool = True) -> tuple[zero3.ModuleTrace, list[Any]]:
    """ZeRO-3's module trace of `model` (`zero3.record`) and every op of the step (`flops.Op`, forward and
    backward in one list, as they ran), the trace's `spans` indexing that list."""
    from labkit.study import flops

    census = flops.Census()
    with flops.recording(census, cuda_dropout):
        trace = zero3.record(model, run_step, mark=lambda: len(census.forward))
    return trace, census.forward


@dataclass(frozen=True)
class Fetch:
    """One module fetch of a micro-step, in the order the host meets them, and the work up to the next one."""

    gather_s: float | None    # its own gather call (None: none, its parameters resident or in flight)
    prefetch_s: float | None  # the call it prefetches (None: none)
    waits: tuple[int, ...]    # per parameter it waits on, the gather call that took it (calls numbered in the order
                              # they were issued)
    forward_s: float          # the device's forward work from this fetch to the next (roofline seconds)
    backward_s: float         # and its backward work (the last forward fetch's stretch runs into the backward)
    ready: tuple[int, ...] = ()  # the elements of each gradient completed in the stretch, in the order their reduce
                                 # hooks fire (its modules' last backward hook)


def fetches(trace: zero3.ModuleTrace, replay: zero3.Replay, op_seconds: Sequence[float],
            gather_s: Callable[[Sequence[int]], float]) -> list[Fetch]:
    """The micro-step's fetches: `replay`'s calls (`zero3.replay` of `trace`), timed by `gather_s` (element counts of
    the call's parameters -> seconds), and the ops of `trace.spans` (`recorded`) timed by `op_seconds`."""
    if not trace.spans:
        raise ValueError("the trace has no spans: record it with its ops (zero3_overlap.recorded)")
    events = [*trace.forward, *trace.backward]
    if len(trace.spans) != len(events) or len(replay.fetches) != sum(fetch for fetch, _ in events):
        raise ValueError("the trace's spans or the replay's fetches do not match its events: a replay of another trace")
    prefix = [0.0, *itertools.accumulate(op_seconds)]
    turn = trace.backward_from
    # A gradient is complete once the last module that uses its parameter has run its backward: in the stretch of
    # that module's last backward event (its release; a module whose input needs no gradient, an embedding, has
    # none, and runs its backward after its fetch). Within a module, in the parameters' order (an nn.Linear's weight
    # before its bias under ZeRO-3's memory-efficient linear, comms._stage3).
    last_event: dict[int, int] = {}
    for k, (_, m) in enumerate(events[len(trace.forward):], start=len(trace.forward)):
        for p in trace.owns[m]:
            last_event[p] = k
    ready_at: dict[int, list[int]] = {}
    for p, k in sorted(last_event.items(), key=lambda item: (item[1], item[0])):
        if p not in trace.ungraded:
            ready_at.setdefault(k, []).append(trace.numels[p])
    out: list[Fetch] = []
    calls = iter(replay.fetches)
    for k, (fetch, _) in enumerate(events):
        start, end = trace.spans[k]
        forward = prefix[max(min(end, turn), start)] - prefix[start]  # the ops before loss.backward() began
        backward = prefix[end] - prefix[max(start, min(turn, end))]
        if fetch:
            own, ahead, waits = next(calls)
            out.append(Fetch(gather_s(own) if own else None, gather_s(ahead) if ahead else None, waits, 0.0, 0.0))
        elif not out:
            continue  # work before the first fetch: none in a module's forward
        out[-1] = dataclasses.replace(out[-1], forward_s=out[-1].forward_s + forward,
                                      backward_s=out[-1].backward_s + backward,
                                      ready=out[-1].ready + tuple(ready_at.get(k, ())))
    return out


@dataclass(frozen=True)
class MicroStep:
    seconds: float     # the micro-step on the device, its gathers and reduce-scatters included
    compute_s: float   # its compute as the phases take it (forward_s + backward_s)

    @property
    def exposed_s(self) -> float:
        return self.seconds - self.compute_s


def micro_step_s(steps: Sequence[Fetch], *, forward_s: float, backward_s: float, device_forward_s: float,
                 device_backward_s: float, bucket_elements: int = 0,
                 scatter_s: Callable[[Sequence[int]], float] | None = None, slowdown: float = 1.0) -> MicroStep:
    """One micro-step on the compute stream's and the NCCL stream's clocks (module doc). Each stretch between two
    fetches takes its share of the phases as they run (`forward_s`, `backward_s`: host-bound or not) and of the
    device's own compute in them (`device_*`); beside communication the device's share takes `slowdown` x as long
    (`predict.comm_time`'s rule, per stretch). The gradients the stretches complete (`Fetch.ready`) go into buckets
    of `bucket_elements`, each reduce-scattered (`scatter_s`: its gradients' element counts -> seconds) when the next
    gradient would overflow it, the last when the backward ends; the micro-step ends when both clocks have."""
    if not steps:
        raise ValueError("a micro-step has at least one fetch")
    if slowdown < 1:
        raise ValueError(f"slowdown must be >= 1, got {slowdown}")
    raw_forward = sum(s.forward_s for s in steps)
    raw_backward = sum(s.backward_s for s in steps)
    for name, seconds, raw in (("forward", forward_s, raw_forward), ("backward", backward_s, raw_backward)):
        if seconds > 0 and raw <= 0:
            raise ValueError(f"the {name} takes {seconds} s but its stretches have no work to share it by")
    if any(s.ready for s in steps) and (scatter_s is None or bucket_elements <= 0):
        raise ValueError("gradients to reduce need bucket_elements > 0 and scatter_s")

    def share(raw: float, total: float, phase: float) -> float:
        return phase * raw / total if total > 0 else 0.0

    # Where the host's work bounds a phase it reaches each hook when the device does: it issues the hook's calls
    # then, not ahead (the same in every stretch of the phase: its stretches share the phase in proportion).
    host_bound = {"forward": forward_s > device_forward_s, "backward": backward_s > device_backward_s}
    compute = free = 0.0  # when the compute stream and the NCCL stream are done with what they were given
    done: list[float] = []  # when each gather call finished, in the order they were issued
    bucket: list[int] = []
    for s in steps:
        phase = share(s.forward_s, raw_forward, forward_s) + share(s.backward_s, raw_backward, backward_s)
        device = (share(s.forward_s, raw_forward, device_forward_s)
                  + share(s.backward_s, raw_backward, device_backward_s))
        issue = compute if host_bound["backward" if s.backward_s > s.forward_s else "forward"] else 0.0
        if s.gather_s is not None:
            free = max(free, issue) + s.gather_s
            done.append(free)
        for w in s.waits:  # :415, the compute waits for its module's calls
            compute = max(compute, done[w])
        if s.prefetch_s is not None:  # queued after the wait: it runs beside this stretch, or later
            free = max(free, issue) + s.prefetch_s
            done.append(free)
        beside = min(max(free - compute, 0.0), slowdown * device)  # communication running beside this stretch
        compute += max(phase, device + beside * (1.0 - 1.0 / slowdown))
        for elements in s.ready:  # stage3.py:1583: a full bucket goes when the next gradient would overflow it
            if bucket and sum(bucket) + elements > bucket_elements:
                assert scatter_s is not None
                free = max(free, compute) + scatter_s(bucket)
                bucket = []
            bucket.append(elements)
    if bucket:  # the last one when the backward has ended (:1410)
        assert scatter_s is not None
        free = max(free, compute) + scatter_s(bucket)
    return MicroStep(max(compute, free), forward_s + backward_s)

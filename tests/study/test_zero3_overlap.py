"""ZeRO-3's communication against the compute, hook by hook (labkit.study.zero3_overlap): the stretches between
hooks are the step's own ops, the calls and waits are DeepSpeed's coordinator replayed (zero3.replay), and the two
clocks follow partitioned_param_coordinator.py:415 and ProcessGroupNCCL's one stream per group."""

from __future__ import annotations

import pytest
import torch

from labkit.study import flops, shapes, zero3, zero3_overlap
from labkit.study.zero3_overlap import Fetch

SHAPE = flops.Transformer.parse("layers=3,hidden=64,heads=4,seq=16,vocab=100")


def stretch(compute: float, *, gather: float | None = None, prefetch: float | None = None,
            waits: tuple[int, ...] = (), ready: int = 0) -> Fetch:
    return Fetch(gather, prefetch, waits, compute, 0.0, ready)


def play(steps: list[Fetch], **kwargs) -> float:
    forward = sum(s.forward_s for s in steps)
    kwargs = {"forward_s": forward, "backward_s": 0.0, "device_forward_s": forward, "device_backward_s": 0.0,
              **kwargs}
    return zero3_overlap.micro_step_s(steps, **kwargs).exposed_s


def test_a_prefetch_hides_behind_the_compute_until_its_module_waits_for_it():
    # a 3 s gather prefetched at the first hook, waited on at the third: 1 + 1 s of compute hide 2 s of it
    assert play([stretch(1.0, prefetch=3.0), stretch(1.0), stretch(1.0, waits=(0,))]) == pytest.approx(1.0)
    # waited on at the fourth: all of it hides
    assert play([stretch(1.0, prefetch=3.0), stretch(1.0), stretch(1.0), stretch(1.0, waits=(0,))]) == 0.0
    # a module's own gather is waited on at once: only the compute before its hook hides it
    assert play([stretch(1.0), stretch(1.0, gather=3.0, waits=(0,))]) == pytest.approx(2.0)


def test_calls_run_one_after_the_other_on_the_groups_nccl_stream():
    # two prefetches queued at the first hook: the second finishes after both, 4 s in
    steps = [stretch(1.0, prefetch=2.0), stretch(1.0, prefetch=2.0), stretch(1.0, waits=(1,))]
    assert play(steps) == pytest.approx(2.0)
    # a reduce-scatter issued once its bucket's gradients are ready queues before a later gather
    rs = [stretch(1.0, ready=10), stretch(1.0, prefetch=1.0), stretch(0.5, waits=(0,))]
    assert play(rs) == pytest.approx(0.0)
    assert play(rs, reduce_scatters_s=[3.0], bucket_elements=10) == pytest.approx(3.0)  # 1 + 3 + 1 = 5 vs 2.5
    # one issued after the last stretch makes the micro-step end when it does
    assert play([stretch(1.0, ready=10)], reduce_scatters_s=[2.0], bucket_elements=10) == pytest.approx(2.0)


def test_compute_beside_communication_is_slowed_as_predict_slows_a_phase():
    k = 1.25
    # 1 s of compute beside 0.5 s of gather: 1 + 0.5 (1 - 1/k)
    assert play([stretch(1.0, prefetch=0.5), stretch(0.0, waits=(0,))], slowdown=k) == pytest.approx(0.5 * (1 - 1 / k))
    # communication longer than k x the compute: the stretch is the communication's
    assert play([stretch(1.0, prefetch=2.0), stretch(0.0, waits=(0,))], slowdown=k) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="slowdown"):
        play([stretch(1.0)], slowdown=0.5)


def test_where_the_host_bounds_the_phase_a_call_is_issued_when_the_device_gets_there():
    steps = [stretch(1.0), stretch(1.0, gather=1.0, waits=(0,))]
    assert play(steps) == pytest.approx(0.0)  # device-bound: the host queued it during the first stretch
    # the host's work twice the device's: the gather starts at the hook, after 2 s
    assert play(steps, forward_s=4.0) == pytest.approx(1.0)


def test_the_stretches_are_the_steps_ops_between_hooks_and_the_waits_the_calls_that_took_each_module():
    model = shapes.build(SHAPE, 3, torch.float32)
    ids = torch.zeros(2, SHAPE.seq, dtype=torch.long, device="meta")
    trace, ops = zero3_overlap.recorded(model, lambda: model(input_ids=ids, labels=ids).loss)
    census = flops.module_census(model, lambda: model(input_ids=ids, labels=ids).loss)
    # the spans cover the step's ops once each, in order: those of the first step, as the census counts them
    events = len(trace.forward) + len(trace.backward)
    assert len(trace.spans) == events and trace.spans[0][0] >= 0
    assert all(a[1] == b[0] for a, b in zip(trace.spans, trace.spans[1:], strict=False))
    inside = ops[trace.spans[0][0]:trace.spans[-1][1]]
    assert sum(op.flops for op in inside) == pytest.approx(census.flops())
    replay = zero3.replay(trace, stage3_prefetch_bucket_size=3_000, stage3_param_persistence_threshold=100)
    calls = iter(range(10**6))
    for own, ahead, waits in replay.fetches:  # the calls in the order they were made: own, then prefetch
        ids_own = next(calls) if own else None
        if ids_own is not None:
            assert ids_own in waits  # a module's own gather is waited on at once
        if ahead:
            next(calls)
        assert all(w <= (ids_own if ids_own is not None else 10**6) for w in waits)
    assert sum(1 for own, _, _ in replay.fetches if own) + sum(1 for _, a, _ in replay.fetches if a) == \
        len(replay.forward_calls) + len(replay.backward_calls)
    steps = zero3_overlap.fetches(trace, replay, [op.flops for op in ops], lambda call: float(sum(call)))
    assert len(steps) == len(replay.fetches)
    assert sum(s.forward_s + s.backward_s for s in steps) == pytest.approx(census.flops())
    # every gradient is ready once in the backward, the parameters' elements
    assert sum(s.ready_elements for s in steps) == sum(trace.numels)


def test_a_transformers_stretches_are_its_one_block_stretches_repeated():
    model = shapes.build(SHAPE, 3, torch.float32)
    ids = torch.zeros(2, SHAPE.seq, dtype=torch.long, device="meta")
    trace_3, ops_3 = zero3_overlap.recorded(model, lambda: model(input_ids=ids, labels=ids).loss)
    repeated, ops_1 = SHAPE.zero3_timeline(2, "fp32")
    def hooks(trace: zero3.ModuleTrace) -> list[tuple[bool, str]]:
        return [(fetch, trace.names[m]) for fetch, m in trace.forward + trace.backward]

    assert hooks(repeated) == hooks(trace_3)

    def work(trace: zero3.ModuleTrace, ops: list) -> list[float]:
        steps = zero3_overlap.fetches(trace, zero3.replay(trace), [op.flops for op in ops], lambda call: 1.0)
        return [s.forward_s + s.backward_s for s in steps]

    assert work(repeated, ops_1) == pytest.approx(work(trace_3, ops_3))


def test_fetches_refuses_a_trace_without_its_ops_or_a_replay_of_another():
    trace = SHAPE.zero3_trace()
    with pytest.raises(ValueError, match="no spans"):
        zero3_overlap.fetches(trace, zero3.replay(trace), [], lambda call: 1.0)
    timed, ops = SHAPE.zero3_timeline(1, "fp32")
    other = flops.Transformer.parse("layers=2,hidden=64,heads=4,seq=16,vocab=100").zero3_trace()
    with pytest.raises(ValueError, match="another trace"):
        zero3_overlap.fetches(timed, zero3.replay(other), [0.0] * len(ops), lambda call: 1.0)

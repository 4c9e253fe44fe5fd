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
            waits: tuple[int, ...] = (), ready: tuple[int, ...] = (), backward: float = 0.0) -> Fetch:
    return Fetch(gather, prefetch, waits, compute, backward, ready)


def play(steps: list[Fetch], **kwargs) -> float:
    forward, backward = sum(s.forward_s for s in steps), sum(s.backward_s for s in steps)
    kwargs = {"forward_s": forward, "backward_s": backward, "device_forward_s": forward,
              "device_backward_s": backward, "bucket_elements": 10, "scatter_s": lambda bucket: sum(bucket) / 10,
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
    # a full bucket is reduce-scattered when the next gradient would overflow it, on the same stream as the gathers:
    # here (6 + 6 elements, a bucket of 10) after the first stretch, 1.2 s before the prefetch can start
    rs = [stretch(0.0, backward=1.0, ready=(6, 6)), stretch(0.0, backward=1.0, prefetch=1.0),
          stretch(0.0, backward=0.5, waits=(0,))]
    # the first bucket's 1.2 s end 2.2 s in, the prefetch 3.2 s in (the third stretch waits for it), and the last
    # bucket (the second 6, flushed when the backward ends at 3.7 s) 4.9 s in: 2.5 s of compute, 2.4 s exposed
    assert play(rs, scatter_s=lambda bucket: 2 * sum(bucket) / 10) == pytest.approx(4.9 - 2.5)
    # gradients that fit one bucket go once, when the backward ends
    assert play([stretch(0.0, backward=1.0, ready=(4, 4))]) == pytest.approx(0.8)
    assert play([stretch(0.0, backward=1.0, ready=(4, 4, 4)), stretch(0.0, backward=1.0)]) == pytest.approx(0.4)


def test_compute_beside_communication_is_slowed_as_predict_slows_a_phase():
    k = 1.25
    # 1 s of compute beside 0.5 s of gather: 1 + 0.5 (1 - 1/k)
    assert play([stretch(1.0, prefetch=0.5), stretch(0.0, waits=(0,))], slowdown=k) == pytest.approx(0.5 * (1 - 1 / k))
    # communication longer than k x the compute: the stretch is the communication's
    assert play([stretch(1.0, prefetch=2.0), stretch(0.0, waits=(0,))], slowdown=k) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="slowdown"):
        play([stretch(1.0)], slowdown=0.5)


def test_a_micro_step_the_stretches_cannot_share_is_refused():
    with pytest.raises(ValueError, match="at least one fetch"):
        zero3_overlap.micro_step_s([], forward_s=1.0, backward_s=1.0, device_forward_s=1.0, device_backward_s=1.0)
    with pytest.raises(ValueError, match=r"backward takes 1\.0 s but its stretches have no work"):
        play([stretch(1.0)], backward_s=1.0)
    with pytest.raises(ValueError, match="bucket_elements > 0"):
        play([stretch(0.0, backward=1.0, ready=(4,))], bucket_elements=0)


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
    issued = 0  # calls made so far, numbered as micro_step_s numbers them: a fetch's own call, then its prefetch
    calls = [*replay.forward_calls, *replay.backward_calls]
    waited = set()
    for own, ahead, waits in replay.fetches:
        if own:
            assert list(own) == calls[issued] and issued in waits  # a module's own gather is waited on at once
            issued += 1
        assert all(w < issued for w in waits)  # only calls already made
        waited.update(waits)
        if ahead:
            assert list(ahead) == calls[issued]
            issued += 1
    assert issued == len(calls) and waited == set(range(issued))  # every call is waited on by some fetch
    steps = zero3_overlap.fetches(trace, replay, [op.flops for op in ops], lambda call: float(sum(call)))
    assert len(steps) == len(replay.fetches)
    assert sum(s.forward_s for s in steps) == pytest.approx(census.flops("forward"))
    assert sum(s.backward_s for s in steps) == pytest.approx(census.flops("backward"))
    # the forward's stretches do no backward work but the last one (it runs into the loss's backward), the
    # backward's no forward work; gradients complete in the backward's stretches only, each once
    turn = sum(fetch for fetch, _ in trace.forward)
    assert all(s.backward_s == 0 for s in steps[:turn - 1]) and all(s.forward_s == 0 for s in steps[turn:])
    assert not any(s.ready for s in steps[:turn - 1])
    assert sorted(n for s in steps for n in s.ready) == sorted(trace.numels)
    # the embedding's gradient last (the tied head's too: the same parameter), the LM head's module first
    assert steps[-1].ready[-1] == trace.numels[0] == SHAPE.vocab * SHAPE.hidden


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


@pytest.mark.parametrize("bucket", [20_000, 500_000_000])
def test_the_played_buckets_are_the_reduce_scatters_comms_counts(bucket):
    """The gradients the stretches complete, bucketed by DeepSpeed's flush rule as the play issues them, are the
    reduce-scatter calls comms.collectives counts for the same model (checked there against DeepSpeed's log)."""
    from labkit.study import comms

    trace, ops = SHAPE.zero3_timeline(2, "fp32")
    steps = zero3_overlap.fetches(trace, zero3.replay(trace), [op.flops for op in ops], lambda call: 1.0)
    played: list[list[int]] = []
    total = sum(s.forward_s + s.backward_s for s in steps)
    zero3_overlap.micro_step_s(steps, forward_s=total, backward_s=0.0, device_forward_s=total, device_backward_s=0.0,
                               bucket_elements=bucket, scatter_s=lambda b: played.append(list(b)) or 0.0)
    rows = comms.collectives(3, sum(trace.numels), 4, precision="fp32", modules=SHAPE.module_layout(),
                             trace=SHAPE.zero3_trace(), reduce_bucket_size=bucket)
    scatters = sorted(c.bytes for c in rows if c.op == "reduce_scatter" for _ in range(c.count))
    assert sorted(comms.gathered_elements(b, 4) * 4 for b in played) == scatters

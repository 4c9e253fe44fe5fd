"""ZeRO-3's coordinator replayed (labkit.study.zero3). The traces here are the order DeepSpeed 0.19.8's own
coordinator recorded on 2 CPU ranks (its `__submodule_order`, printed on 2026-11-29); the gathers it replays are
checked against DeepSpeed's comms log on real 2-rank runs in tests/study/test_comms.py (the `slow` tests)."""

from __future__ import annotations

import pytest

from labkit.core.config import RunConfig
from labkit.study import flops, zero3

# DeepSpeed's trace of the lab MLP (SimpleModel: a Sequential of Linear, ReLU, Linear): every module's pre-forward
# hook, then the pre-backward hooks in the reverse of the order the forwards ended
MLP_ORDER = ["", "layers", "layers.0", "layers.1", "layers.2", "", "layers", "layers.2", "layers.1", "layers.0"]
# ... and of the lab's tied GPT (hidden 64, 2 blocks): modules the forward does not call (the ModuleList, the
# attention dropout SDPA skips) have no hooks; the LM head's backward comes before the transformer's
GPT_BLOCK = ["ln_1", "attn", "attn.c_attn", "attn.c_proj", "attn.resid_dropout", "ln_2", "mlp", "mlp.c_fc", "mlp.act",
             "mlp.c_proj", "mlp.dropout"]
GPT_BLOCK_BACKWARD = ["mlp", "mlp.dropout", "mlp.c_proj", "mlp.act", "mlp.c_fc", "ln_2", "attn", "attn.resid_dropout",
                      "attn.c_proj", "attn.c_attn", "ln_1"]


def fetched(trace: zero3.ModuleTrace) -> list[str]:
    return [trace.names[m] for fetch, m in trace.forward + trace.backward if fetch]


def test_the_recorded_trace_is_deepspeeds():
    assert fetched(zero3.record_lab_model(RunConfig(example="zero3"))) == MLP_ORDER
    gpt = zero3.record_lab_model(RunConfig(example="zero3", model="gpt", hidden=64, depth=2, input_size=64))
    blocks = [f"lm.transformer.h.{k}" for k in (0, 1)]
    assert fetched(gpt) == [
        "", "lm", "lm.transformer", "lm.transformer.wte", "lm.transformer.wpe", "lm.transformer.drop",
        *[n for b in blocks for n in [b, *(f"{b}.{m}" for m in GPT_BLOCK)]], "lm.transformer.ln_f", "lm.lm_head",
        "", "lm", "lm.lm_head", "lm.transformer", "lm.transformer.ln_f",
        *[n for b in blocks[::-1] for n in [b, *(f"{b}.{m}" for m in GPT_BLOCK_BACKWARD)]],
        "lm.transformer.drop", "lm.transformer.wpe", "lm.transformer.wte"]
    head = gpt.names.index("lm.lm_head")
    assert gpt.owns[head] == gpt.owns[gpt.names.index("lm.transformer.wte")]  # the tied head holds the embedding's


def test_a_release_hook_only_where_the_modules_input_needs_a_gradient():
    trace = zero3.record_lab_model(RunConfig(example="zero3"))
    released_in_backward = [trace.names[m] for fetch, m in trace.backward if not fetch]
    assert released_in_backward == ["layers.2", "layers.1"]  # the first Linear, the Sequential and the model see data


@pytest.mark.parametrize("spec", ["layers=3,hidden=64,heads=4,seq=16,vocab=100",
                                  "arch=llama,layers=3,hidden=64,heads=4,kv_heads=2,ffn=96,seq=16,vocab=100",
                                  "arch=qwen2,layers=3,hidden=64,heads=4,kv_heads=2,ffn=96,seq=16,vocab=100,tied=1"])
def test_a_transformers_trace_is_its_one_block_trace_repeated(spec):
    import torch

    from labkit.study import shapes

    shape = flops.Transformer.parse(spec)
    model = shapes.build(shape, 3, torch.float32)
    ids = torch.zeros(1, 8, dtype=torch.long, device="meta")
    recorded = zero3.record(model, lambda: model(input_ids=ids, labels=ids).loss)
    repeated = shape.zero3_trace()

    def hooks(trace: zero3.ModuleTrace) -> list[tuple[bool, str, tuple[int, ...]]]:
        return [(fetch, trace.names[m], trace.owns[m]) for fetch, m in trace.forward + trace.backward]

    assert repeated.numels == recorded.numels and hooks(repeated) == hooks(recorded)


def test_prefetches_of_parameter_free_hooks_batch_the_gathers():
    # The lab MLP with 100 -> 501 -> 9 and nothing persistent, a prefetch bucket of 30,000: the model's hook prefetches
    # the 50,100-element weight (>= 30,000: the batch ends), the Sequential's the rest, before the first Linear's
    # own fetch finds everything gathered: DeepSpeed's log on 2 ranks has the same two calls
    trace = zero3.record_lab_model(RunConfig(example="zero3", hidden=501, output_size=9))
    r = zero3.replay(trace, stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=30_000)
    assert r.forward_calls == [[50_100], [501, 4_509, 9]] and r.backward_calls == []
    assert (r.gathering_fetches, r.gathered_params_fetched) == (2, 4)  # each Linear's fetch, its two parameters
    # without the parameter-free hooks (a layout alone) the first Linear's own fetch gathers its two parameters
    flat = zero3.replay(zero3.ModuleTrace.from_layout([[50_100, 501], [4_509, 9]]),
                        stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=30_000)
    assert flat.forward_calls == [[50_100, 501], [4_509, 9]]


def test_a_parameter_the_prefetch_took_for_a_later_use_is_kept_past_the_reuse_window():
    # three modules of 100 called one after the other, nothing persistent, reuse distance 0, a bucket of 1,000:
    # the first fetch gathers p0 and prefetches p1, p2, popping every later entry, their backward uses too, so a
    # release keeps what is used after the next fetch (partitioned_param_coordinator.py:650: popped for a step past
    # the current one). The last module is the exception: released after its forward at step 3, where its backward
    # is the next fetch (step 3, not past it), so it is gathered again at once.
    trace = zero3.ModuleTrace.from_layout([[100]] * 3)
    r = zero3.replay(trace, stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0,
                     stage3_prefetch_bucket_size=1_000)
    assert r.forward_calls == [[100], [100, 100]] and r.backward_calls == [[100]]
    # with a window of one module (100 elements) it stays
    assert zero3.replay(trace, stage3_param_persistence_threshold=0, stage3_max_reuse_distance=100,
                        stage3_prefetch_bucket_size=1_000).backward_calls == []
    # no prefetch: each released after its forward (window 0), each gathered again for its backward
    r = zero3.replay(trace, stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0,
                     stage3_prefetch_bucket_size=0)
    assert r.forward_calls == [[100]] * 3 and r.backward_calls == [[100]] * 3
    assert (r.gathering_fetches, r.gathered_params_fetched) == (6, 6)


def test_persistent_parameters_are_never_gathered_and_count_against_the_model_threshold():
    trace = zero3.ModuleTrace.from_layout([[10, 10], [10]])
    cfg = {"stage3_param_persistence_threshold": 10, "stage3_model_persistence_threshold": 20}
    r = zero3.replay(trace, **cfg)
    assert r.persistent == {0, 1} and r.forward_calls == [[10]]  # the third would take the total past 20


def test_a_block_whose_parameters_are_not_numbered_together_is_refused():
    trace = zero3.ModuleTrace((1, 1, 1), ((0, 2), (1,)), ((True, 0), (False, 0), (True, 1), (False, 1)), (),
                              ("h.0.a", "b"))
    with pytest.raises(ValueError, match="not numbered together"):
        zero3.repeat_blocks(trace, 2)


def test_a_block_pattern_that_matches_nothing_is_refused_not_read_as_one_layer():
    import re

    recorded = zero3.record_lab_model(RunConfig(example="zero3"))
    with pytest.raises(ValueError, match="matches the block pattern"):
        zero3.repeat_blocks(recorded, 4, re.compile(r"blocks\.0"))
    with pytest.raises(ValueError, match="needs a recorded trace"):
        zero3.repeat_blocks(zero3.ModuleTrace.from_layout([[1]]), 2)


def test_odd_hooks_come_out_as_deepspeeds_coordinator_recorded_them():
    # tests.own_model:build_odd_model: `shared` called twice, `split`'s two outputs both used (its backward fetches
    # twice), `split_unused`'s second output unused (once), `unused`'s output dropped (never). The order DeepSpeed
    # 0.19.8's coordinator recorded for this model on 2 CPU ranks (2026-11-29); its gathers are checked on a real run
    # in test_comms.py
    config = RunConfig(example="zero3", model="tests.own_model:build_odd_model", data="tests.own_model:build_dataset",
                       loss="tests.own_model:loss_fn", hidden=64)
    trace = zero3.record_lab_model(config)
    assert fetched(trace) == [
        "", "first", "shared", "shared", "split", "split.linear", "split_unused", "split_unused.linear", "unused",
        "last",
        "", "last", "split_unused", "split_unused.linear", "split", "split", "split.linear", "shared", "shared",
        "first"]
    # the second call's release hook only: the first call's count was reset when the module was called again
    shared = trace.names.index("shared")
    assert sum(1 for fetch, m in trace.backward if m == shared and not fetch) == 1
    # the dropped Linear's parameters get no gradient, so no reduce hook fires for them (comms leaves them out)
    assert trace.ungraded == set(trace.owns[trace.names.index("unused")])


def test_a_default_zero3_leaf_module_is_refused_before_anything_runs():
    import torch
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = transformers.MixtralConfig(hidden_size=16, intermediate_size=32, num_local_experts=2,
                                        num_experts_per_tok=1)
    with torch.device("meta"):
        block = MixtralSparseMoeBlock(config)
    with pytest.raises(ValueError, match="MixtralSparseMoeBlock is a ZeRO-3 leaf module"):
        zero3.record(block, lambda: pytest.fail("ran"))


def test_record_needs_a_loss_to_differentiate_and_leaves_the_gradients_as_they_were():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    x = torch.randn(2, 4)
    trace = zero3.record(model, lambda: model(x).sum())
    assert trace.backward and all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="needs a gradient"), torch.inference_mode():
        zero3.record(model, lambda: model(x).sum())
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="needs a gradient"):
        zero3.record(model, lambda: model(x).sum())


def _external_trace() -> zero3.ModuleTrace:
    config = RunConfig(example="zero3", model="tests.own_model:build_external_model",
                       data="tests.own_model:build_dataset", loss="tests.own_model:loss_fn", hidden=64)
    return zero3.record_lab_model(config)


def test_a_layer_under_two_parents_is_hooked_twice_as_deepspeed_walks_its_children():
    # DeepSpeed registers its hooks at every visit of a parent's children (parameter_offload.py:353-356), so the
    # Linear that `a` and `b` both hold fetches twice per call (DeepSpeed's recorded order has each such module's id
    # twice in a row; the whole run's gathers are checked in test_comms.py, "stage 3, external parameters")
    trace = _external_trace()
    assert fetched(trace)[:9] == ["", "first", "offset", "a", "a.layer", "a.layer", "b", "a.layer", "a.layer"]
    # the host's per-module costs count each fetch: first, offset, the shared Linear 4 times, mix and last hold
    # parameters; the model, a and b do not
    assert trace.hooked_modules() == (8.0, 3.0)


def test_external_parameters_are_the_reading_or_receiving_modules_where_deepspeed_makes_them_so():
    trace = _external_trace()
    root, (offset,), mix = 0, trace.owns[trace.names.index("offset")], trace.owns[trace.names.index("mix")][0]
    assert trace.names[root] == "" and trace.numels[offset] == 64 and trace.numels[mix] == 64 * 64
    # read outside its module's forward: the reader's, only where it is partitioned (a persistent one is resident)
    assert trace.external_if_partitioned == {(root, offset), (root, mix)}
    # returned by `offset`: its caller's either way, and DeepSpeed never releases it within a step (:386, :528)
    assert trace.external_if_persistent == {(root, offset)} and trace.returned == {offset}
    assert trace.owners(set())[root] == (offset, mix)
    assert trace.owners({offset, mix})[root] == (offset,)
    assert trace.owners({offset})[root] == (offset, mix)  # mix partitioned: read outside its module, so gathered there


def test_a_forward_that_calls_other_modules_from_one_step_to_the_next_is_refused():
    import torch

    class Alternating(torch.nn.Module):  # DeepSpeed records its trace again every step and never prefetches
        def __init__(self):
            super().__init__()
            self.one, self.two = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return (self.one if self.calls % 2 else self.two)(x)

    model = Alternating()
    with pytest.raises(ValueError, match="from one step to the next"):
        zero3.record(model, lambda: model(torch.randn(2, 4)).sum())


def test_replay_refuses_what_it_does_not_replay_and_comms_a_trace_of_another_model():
    from labkit.study import comms

    trace = zero3.ModuleTrace.from_layout([[10, 20], [30]])
    with pytest.raises(ValueError, match="zero_quantized_weights"):
        zero3.replay(trace, zero_quantized_weights=True)
    with pytest.raises(ValueError, match="do not set the stage"):
        zero3.replay(trace, stage=1)
    zero3.replay(trace, offload_optimizer={"device": "cpu"})  # the optimizer's offload changes no gather
    with pytest.raises(ValueError, match="a trace of another model"):
        comms.collectives(3, 61, 2, precision="fp32", trace=trace)
    with pytest.raises(ValueError, match="persistent_params is for a model given without a trace"):
        comms.collectives(3, 60, 2, precision="fp32", trace=trace, persistent_params=10)


def _replayed(model, **settings) -> tuple[list[list[int]], list[list[int]]]:
    import torch

    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    r = zero3.replay(zero3.record(model, lambda: (model(x) ** 2).mean()), **settings)
    return [sorted(c) for c in r.forward_calls], [sorted(c) for c in r.backward_calls]


WINDOW_0 = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}


def test_a_returned_parameter_read_again_later_is_no_readers_and_a_dict_output_counts():
    # A stranger's review (2026-11-29) found both cases wrong; the calls are DeepSpeed 0.19.8's on 2 CPU ranks
    # (gloo, step 3 = step 4), the weight's registration as DeepSpeed made it.
    import torch
    from torch import nn

    class Returns(nn.Module):
        def __init__(self, as_dict: bool = False):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(8, 8) / 8)
            self.as_dict = as_dict

        def forward(self):
            return {"w": self.weight} if self.as_dict else self.weight

    class Holder(nn.Module):  # returns `ret`'s weight to its caller, so it becomes `a`'s, flagged, never released
        def __init__(self):
            super().__init__()
            self.ret, self.lin = Returns(), nn.Linear(8, 8, bias=False)

        def forward(self, x):
            return self.lin(x) @ self.ret()

    class Reader(nn.Module):  # reads that weight again later: still gathered, so DeepSpeed registers nothing
        def __init__(self, weight):
            super().__init__()
            self.lin = nn.Linear(8, 8, bias=False)
            object.__setattr__(self, "weight_of", weight)

        def forward(self, x):
            return self.lin(x) @ self.weight_of()

    class RetRead(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.big = Holder(), nn.Linear(8, 8, bias=False)
            self.user = Reader(lambda: self.a.ret.weight)

        def forward(self, x):
            return self.big(torch.tanh(self.user(torch.tanh(self.big(torch.tanh(self.a(x)))))))

    class DictRet(nn.Module):  # DeepSpeed's post-forward hook reads a dict output's tensors too (:367-376)
        def __init__(self):
            super().__init__()
            self.d, self.lin = Returns(as_dict=True), nn.Linear(8, 8, bias=False)
            self.last = nn.Linear(8, 2, bias=False)

        def forward(self, x):
            return self.last(torch.tanh(self.lin(x) @ self.d()["w"]))

    torch.manual_seed(0)
    assert _replayed(RetRead(), **{**WINDOW_0, "stage3_max_reuse_distance": 100}) == (
        [[64], [64], [64], [64]], [[64], [64]])
    assert _replayed(DictRet(), **WINDOW_0) == ([[64], [64], [16]], [[16], [64]])


def test_record_keeps_what_the_step_did_to_the_model_and_refuses_a_lazy_one():
    import torch
    from torch import nn

    class Lazy(nn.Module):  # makes its parameter on the first call
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            if not hasattr(self, "scale"):
                self.scale = nn.Parameter(torch.ones(8))
            return self.lin(x) * self.scale

    model = Lazy()
    with pytest.raises(ValueError, match="made parameters in its forward"):
        zero3.record(model, lambda: model(torch.randn(2, 8)).sum())
    assert isinstance(model.scale, nn.Parameter) and "scale" in dict(model.named_parameters())
    zero3.record(model, lambda: model(torch.randn(2, 8)).sum())  # after a first step it records


def test_a_returned_parameter_with_accumulation_is_refused():
    from labkit.study import comms

    trace = _external_trace()
    comms.collectives(3, sum(trace.numels), 2, precision="fp32", trace=trace)
    with pytest.raises(ValueError, match="keeps gathered until the optimizer step"):
        comms.collectives(3, sum(trace.numels), 2, precision="fp32", trace=trace, grad_accum=2)

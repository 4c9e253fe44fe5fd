"""labkit.study.optimizer_bytes: the optimizer step's device traffic, counted on DeepSpeed's and torch's own step."""

from __future__ import annotations

import json

import pytest

from labkit.core import memory
from labkit.runtime import hardware as hw
from labkit.study import flops, optimizer_bytes
from labkit.study import predict as P

COMMITTED = json.loads(optimizer_bytes.OPTIMIZER_BYTES_JSON.read_text())


def _committed(stage: str, precision: str, optimizer: str | None = None) -> dict:
    optimizer = optimizer or optimizer_bytes.default_optimizer(stage)
    return next(c for c in COMMITTED["counts"] if str(c["stage"]) == stage and c["precision"] == precision
                and c["optimizer"] == optimizer)


RECOUNTS = [("0", "bf16"), ("2", "bf16"), ("3", "fp16")]  # with FusedAdam; and stage 2 bf16 with torch's Adam


@pytest.fixture(scope="module")
def recounts() -> dict[tuple[str, str, str], dict]:
    """The recounted steps on DeepSpeed's own engine, one after another in one child process:
    {(stage, precision, optimizer): count}."""
    counts = optimizer_bytes.counts_in_subprocess([(stage, precision, None) for stage, precision in RECOUNTS]
                                                  + [("2", "bf16", "torch_adam")])
    return {(str(c["stage"]), c["precision"], c["optimizer"]): c for c in counts}


def test_the_committed_counts_cover_every_stage_precision_and_optimizer_and_say_what_counted_them():
    assert COMMITTED["deepspeed"] == "0.19.8"
    keys = [(str(c["stage"]), c["precision"], c["optimizer"]) for c in COMMITTED["counts"]]
    assert len(keys) == len(set(keys))
    assert set(keys) == ({("torch", "fp32", o) for o in optimizer_bytes.PLAIN_OPTIMIZERS}
                         | {(s, p, o) for s in "0123" for p in optimizer_bytes.PRECISIONS
                            for o in memory.STEP_OPTIMIZERS})
    for count in COMMITTED["counts"]:
        assert count["bytes_per_param"] == pytest.approx(count["aten_bytes_per_param"]
                                                         + count["kernel_bytes_per_param"])
        fused = count["optimizer"] == "fused_adam"
        assert count["kernel_bytes_per_param"] == (optimizer_bytes.FUSED_ADAM_BYTES_PER_PARAM if fused else 0)
        if count["optimizer"] != "torch_sgd":  # an Adam reads 4 fp32 tensors and writes 3 at the least
            assert count["bytes_per_param"] >= optimizer_bytes.FUSED_ADAM_BYTES_PER_PARAM
    for stage in "0123":
        for precision in optimizer_bytes.PRECISIONS:
            sgd, fused, torch_adam = (_committed(stage, precision, o)["bytes_per_param"]
                                      for o in ("torch_sgd", "fused_adam", "torch_adam"))
            # one in-place pass (12 B) < FusedAdam's one kernel (28) < torch's AdamW in seven foreach passes (72)
            assert sgd < fused < torch_adam, (stage, precision)


def test_the_recorder_counts_reads_once_writes_in_place_and_no_allocation():
    import torch

    x, g = torch.ones(1000), torch.ones(1000)
    ops = {}
    for name, fn in (("mul_", lambda: x.mul_(x)), ("copy_", lambda: x.copy_(g.to(torch.bfloat16))),
                     ("addcmul_", lambda: torch._foreach_addcmul_([x], [g], [g])), ("view", lambda: x.view(10, 100)),
                     ("empty", lambda: torch.empty(1000))):
        traffic = optimizer_bytes._recorder()
        with traffic:
            fn()
        ops[name] = sum(traffic.by_op.values()) / 1000
    assert ops["mul_"] == 8  # x read once, written once
    assert ops["copy_"] == 4 + 2 + 2 + 4  # the cast: 4 read, 2 written; copy_ reads those 2 and writes x's 4 unread
    assert ops["addcmul_"] == 12  # v and g read (g once), v written: what a foreach kernel moves
    assert ops["view"] == 0 and ops["empty"] == 0  # no kernel


def test_torchs_foreach_adam_reads_its_four_tensors_and_writes_three_in_every_pass():
    count = optimizer_bytes.count_plain_step()
    assert count["bytes_per_param"] == _committed("torch", "fp32")["bytes_per_param"] == 72
    passes = count["by_op"]
    assert passes["aten._foreach_lerp_"] == 12  # exp_avg and grad read, exp_avg written
    assert passes["aten._foreach_addcdiv_"] == 16  # param, exp_avg and the denominator read, param written
    sgd = optimizer_bytes.count_plain_step("torch_sgd")  # no momentum: p -= lr g, one pass
    assert sgd["by_op"] == {"aten._foreach_add_": 12} and sgd == _committed("torch", "fp32", "torch_sgd")


@pytest.mark.slow
def test_deepspeeds_torch_adam_is_adamw_in_foreach_passes_around_the_same_step(recounts):
    # "torch_adam": true makes torch.optim.AdamW (engine.py:2380-2382), foreach as on a GPU: its passes are aten
    # ops, no kernel added; around them the same casts, norm and copy-back as FusedAdam's. Weight decay 0, as
    # labkit's runs set it: no decay pass
    count = recounts["2", "bf16", "torch_adam"]
    assert count == _committed("2", "bf16", "torch_adam")
    passes, fused = count["by_op"], _committed("2", "bf16")["by_op"]
    assert count["kernel_bytes_per_param"] == 0
    assert passes["aten._foreach_lerp_"] == 12 and passes["aten._foreach_addcdiv_"] == 16
    # exp_avg_sq is multiplied by beta2 before its addcmul_ (4 read, 4 written); seven passes in all, 72 B, what
    # plain PyTorch's Adam moves (FusedAdam's kernel: 28)
    assert passes["aten._foreach_mul_"] == 8
    adamw = ("_foreach_mul_", "_foreach_lerp_", "_foreach_addcmul_", "_foreach_sqrt", "_foreach_div_", "_foreach_add_",
             "_foreach_addcdiv_")
    assert sum(passes["aten." + op] for op in adamw) == _committed("torch", "fp32")["bytes_per_param"] == 72
    for op in ("aten.copy_", "aten.mul_", "aten._to_copy", "aten.linalg_vector_norm"):
        assert passes[op] == fused[op]


@pytest.mark.slow
@pytest.mark.parametrize("stage, precision", RECOUNTS)
def test_a_recount_on_deepspeeds_own_step_gives_the_committed_figure(recounts, stage, precision):
    count = recounts[stage, precision, optimizer_bytes.default_optimizer(stage)]
    assert count["bytes_per_param"] == pytest.approx(_committed(stage, precision)["bytes_per_param"], abs=0.01)
    assert count["kernel_bytes_per_param"] == 28
    passes = count["by_op"]
    # the fp32 partition copied back to 16 bits (4 read, 2 written), the unscale and clip in place (4 + 4)
    assert passes["aten.copy_"] == pytest.approx(6) and passes["aten.mul_"] == pytest.approx(8)
    if stage == "0":  # FP16_Optimizer: the gradients flattened to fp32 (2 read, 4 written; 8 with the cast's copy)
        assert count["optimizer_class"] == "FP16_Optimizer" and passes["aten.linalg_vector_norm"] == pytest.approx(4)
        return
    # the gradient cast to fp64 for the norm (2 read, 8 written) and to fp32 for the update (2 read, 4 written);
    # the norm reads the fp64 copy
    assert passes["aten._to_copy"] == pytest.approx(16) and passes["aten.linalg_vector_norm"] == pytest.approx(8)
    overflow = {k: v for k, v in passes.items() if k in ("aten.amax", "aten.amin", "aten.isinf", "aten.isnan",
                                                         "aten.any")}
    assert sum(overflow.values()) == pytest.approx(4 if stage == "2" else 8)  # stage 3 checks fp16 elementwise


def test_step_bytes_reads_the_committed_counts_and_refuses_what_was_not_counted(tmp_path):
    assert optimizer_bytes.step_bytes(2, "bf16") == _committed("2", "bf16")["bytes_per_param"]
    assert optimizer_bytes.step_bytes(None, "bf16") == _committed("torch", "fp32")["bytes_per_param"]  # fp32 params
    assert optimizer_bytes.step_bytes(None, "bf16", optimizer="torch_sgd") == 12
    partial = tmp_path / "counts.json"
    partial.write_text(json.dumps({"format": optimizer_bytes.FORMAT, "counts": [_committed("2", "bf16")]}))
    with pytest.raises(ValueError, match="no counted optimizer step for stage 3 in bf16 with fused_adam"):
        optimizer_bytes.step_bytes(3, "bf16", partial)
    with pytest.raises(ValueError, match="stage 2 in bf16 with torch_sgd"):
        optimizer_bytes.step_bytes(2, "bf16", partial, optimizer="torch_sgd")
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"counts": []}))
    with pytest.raises(ValueError, match="not a labkit-optimizer-bytes/2 file"):
        optimizer_bytes.step_bytes(2, "bf16", other)


def test_the_optimizer_phase_is_the_counted_traffic_of_the_owned_partition():
    gpu = hw.gpu("A100-80GB")
    work = P.TransformerWorkload(flops.Transformer(layers=2, hidden=128, heads=4, seq=64, vocab=512))
    for strategy, stage in (("torch", None), ("z0", 0), ("z2", 2), ("z3", 3)):
        p = P.predict(work, hw.Cluster(gpu=gpu, gpus_per_node=4), strategy=strategy, micro_batch=2, precision="bf16")
        owned = work.n_params / P.partition_ranks(stage, 4)
        bandwidth = gpu.memory_bytes_per_s * gpu.memory_efficiency
        assert p.optimizer_s == pytest.approx(owned * optimizer_bytes.step_bytes(stage, "bf16") / bandwidth)


def test_the_default_basic_optimizer_is_what_the_strategy_runs():
    assert optimizer_bytes.basic_optimizer(None, False) == "torch_adam"  # plain PyTorch's torch.optim.Adam
    assert optimizer_bytes.basic_optimizer(2, False) == "fused_adam"
    assert optimizer_bytes.basic_optimizer(3, True) == "cpu_adam"  # ZeRO-Offload steps on the host


@pytest.mark.parametrize("stage, offload, optimizer, says", [
    (None, False, "fused_adam", "fused_adam is DeepSpeed's"),
    (2, True, "torch_adam", "not torch_adam: drop the optimizer or the offload"),
    (1, True, "torch_sgd", "not torch_sgd"),
    (1, False, "cpu_adam", "needs the optimizer offloaded"),
    (1, False, "adam", "unknown optimizer 'adam'"),
])
def test_a_basic_optimizer_the_step_cannot_run_is_refused(stage, offload, optimizer, says):
    with pytest.raises(ValueError, match=says):
        optimizer_bytes.basic_optimizer(stage, offload, optimizer)

"""labkit.study.optimizer_bytes: the optimizer step's device traffic, counted on DeepSpeed's and torch's own step."""

from __future__ import annotations

import json

import pytest

from labkit.runtime import hardware as hw
from labkit.study import flops, optimizer_bytes
from labkit.study import predict as P

COMMITTED = json.loads(optimizer_bytes.OPTIMIZER_BYTES_JSON.read_text())


def _committed(stage: str, precision: str) -> dict:
    return next(c for c in COMMITTED["counts"] if str(c["stage"]) == stage and c["precision"] == precision)


def test_the_committed_counts_cover_every_stage_and_precision_and_say_what_counted_them():
    assert COMMITTED["deepspeed"] == "0.19.8"
    keys = {(str(c["stage"]), c["precision"]) for c in COMMITTED["counts"]}
    assert keys == {("torch", "fp32")} | {(s, p) for s in "0123" for p in optimizer_bytes.PRECISIONS}
    for count in COMMITTED["counts"]:
        assert count["bytes_per_param"] == pytest.approx(count["aten_bytes_per_param"]
                                                         + count["kernel_bytes_per_param"])
        assert count["bytes_per_param"] >= optimizer_bytes.FUSED_ADAM_BYTES_PER_PARAM


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
    count = optimizer_bytes.count_torch_adam()
    assert count["bytes_per_param"] == _committed("torch", "fp32")["bytes_per_param"] == 72
    passes = count["by_op"]
    assert passes["aten._foreach_lerp_"] == 12  # exp_avg and grad read, exp_avg written
    assert passes["aten._foreach_addcdiv_"] == 16  # param, exp_avg and the denominator read, param written


@pytest.mark.slow
@pytest.mark.parametrize("stage, precision", [("0", "bf16"), ("2", "bf16"), ("3", "fp16")])
def test_a_recount_on_deepspeeds_own_step_gives_the_committed_figure(stage, precision):
    count = optimizer_bytes.count_in_subprocess(stage, precision)
    assert count["bytes_per_param"] == pytest.approx(_committed(stage, precision)["bytes_per_param"], abs=0.01)
    assert count["kernel_bytes_per_param"] == 28
    passes = count["by_op"]
    # the fp32 partition copied back to 16 bits (4 read, 2 written), the unscale and clip in place (4 + 4)
    assert passes["aten.copy_"] == pytest.approx(6) and passes["aten.mul_"] == pytest.approx(8)
    if stage == "0":  # FP16_Optimizer: the gradients flattened to fp32 (2 read, 4 written; 8 with the cast's copy)
        assert count["optimizer"] == "FP16_Optimizer" and passes["aten.linalg_vector_norm"] == pytest.approx(4)
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
    partial = tmp_path / "counts.json"
    partial.write_text(json.dumps({"format": optimizer_bytes.FORMAT, "counts": [_committed("2", "bf16")]}))
    with pytest.raises(ValueError, match="no counted optimizer step for stage 3 in bf16"):
        optimizer_bytes.step_bytes(3, "bf16", partial)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"counts": []}))
    with pytest.raises(ValueError, match="not a labkit-optimizer-bytes/1 file"):
        optimizer_bytes.step_bytes(2, "bf16", other)


def test_the_optimizer_phase_is_the_counted_traffic_of_the_owned_partition():
    gpu = hw.gpu("A100-80GB")
    work = P.TransformerWorkload(flops.Transformer(layers=2, hidden=128, heads=4, seq=64, vocab=512))
    for strategy, stage in (("torch", None), ("z0", 0), ("z2", 2), ("z3", 3)):
        p = P.predict(work, hw.Cluster(gpu=gpu, gpus_per_node=4), strategy=strategy, micro_batch=2, precision="bf16")
        owned = work.n_params / P.partition_ranks(stage, 4)
        bandwidth = gpu.memory_bytes_per_s * gpu.memory_efficiency
        assert p.optimizer_s == pytest.approx(owned * optimizer_bytes.step_bytes(stage, "bf16") / bandwidth)

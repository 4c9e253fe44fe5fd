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


@pytest.mark.slow
@pytest.mark.parametrize("stage, precision", [("2", "bf16"), ("3", "fp16"), ("torch", "fp32")])
def test_a_recount_on_deepspeeds_own_step_gives_the_committed_figure(stage, precision):
    count = optimizer_bytes.count_in_subprocess(stage, precision)
    assert count["bytes_per_param"] == pytest.approx(_committed(stage, precision)["bytes_per_param"], abs=0.01)
    passes = count["by_op"]
    if stage == "torch":  # every pass of torch's foreach Adam is an aten op: reads p, g, m, v and writes p, m, v
        assert count["kernel_bytes_per_param"] == 0 and "aten._foreach_addcdiv_" in passes
        return
    assert count["kernel_bytes_per_param"] == 28
    # around the kernel: the gradient cast to fp64 for the norm and to fp32 for the update (2 B read, 8 + 4 written),
    # the unscale and clip in place (4 + 4), the fp32 partition copied back to 16 bits (4 read, 2 written)
    assert passes["aten._to_copy"] == pytest.approx(16) and passes["aten.mul_"] == pytest.approx(8)
    assert passes["aten.copy_"] == pytest.approx(6)


def test_step_bytes_reads_the_committed_counts_and_refuses_what_was_not_counted(tmp_path):
    assert optimizer_bytes.step_bytes(2, "bf16") == _committed("2", "bf16")["bytes_per_param"]
    assert optimizer_bytes.step_bytes(None, "bf16") == _committed("torch", "fp32")["bytes_per_param"]  # fp32 params
    partial = tmp_path / "counts.json"
    partial.write_text(json.dumps({"counts": [_committed("2", "bf16")]}))
    with pytest.raises(ValueError, match="no counted optimizer step for stage 3 in bf16"):
        optimizer_bytes.step_bytes(3, "bf16", partial)


def test_the_optimizer_phase_is_the_counted_traffic_of_the_owned_partition():
    gpu = hw.gpu("A100-80GB")
    work = P.TransformerWorkload(flops.Transformer(layers=2, hidden=128, heads=4, seq=64, vocab=512))
    for strategy, stage in (("torch", None), ("z0", 0), ("z2", 2), ("z3", 3)):
        p = P.predict(work, hw.Cluster(gpu=gpu, gpus_per_node=4), strategy=strategy, micro_batch=2, precision="bf16")
        owned = work.n_params / P.partition_ranks(stage, 4)
        bandwidth = gpu.memory_bytes_per_s * gpu.memory_efficiency
        assert p.optimizer_s == pytest.approx(owned * optimizer_bytes.step_bytes(stage, "bf16") / bandwidth)

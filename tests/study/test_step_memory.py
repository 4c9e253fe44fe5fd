"""What DeepSpeed 0.19.8's optimizer step allocates for itself, predicted (`memory.optimizer_step_bytes`) against
the real step on 1 and 2 CPU ranks (`optimizer_bytes.peaks_in_subprocesses`), and what the predictor makes of it."""

from __future__ import annotations

import pytest

from labkit.core import memory
from labkit.runtime import hardware as hw
from labkit.study import flops
from labkit.study import optimizer_bytes as ob
from labkit.study import predict as P

LAYERS = [ob.WIDTH * ob.WIDTH] * ob.LAYERS  # the measured model: 4 x Linear(1024, 1024, bias=False)
SCALARS = 256  # the step's few scalar tensors (the norm, flags): bytes the formula leaves out


FUSED_ADAM_STEPS = [
    (3, "bf16", 1_500_000, 2),    # sub-groups of 3 parameter partitions: flattened (2 B) and made fp32 (4 B)
    (3, "bf16", 500_000, 1),      # one parameter per sub-group, a view: the fp64 norm of one gradient is the peak
    (3, "fp32", 1_000_000_000, 1),  # fp32 training: the flattened copy only
    (2, "bf16", 1_000_000_000, 2),  # the whole partition at once
    (1, "fp32", 1_000_000_000, 1),
    (0, "bf16", 1_000_000_000, 2),  # FP16_Optimizer: every gradient made fp32 in a list, then flattened
]
TORCH_STEPS = [
    # torch's Adam ("torch_adam": labkit's choice on a GPU without nvcc), foreach as on a GPU
    ("torch_adam", 2, "bf16", 1_000_000_000, 2),  # the fp32 partition and sqrt(exp_avg_sq) of it: 8 B, not 6
    ("torch_adam", 3, "fp32", 1_500_000, 1),  # per sub-group of 2 parameters: their fp32 gradients and the list
    ("torch_adam", 0, "bf16", 1_000_000_000, 1),  # FP16_UnfusedOptimizer: every gradient in fp32, and the list
    ("torch_adam", 0, "fp32", 1_000_000_000, 1),  # the basic optimizer alone: the list
    ("torch_sgd", 0, "bf16", 1_000_000_000, 1),   # FP16_UnfusedOptimizer: every gradient in fp32, no flattened copy
]


@pytest.fixture(scope="module")
def measured_peaks() -> dict[tuple, list[dict]]:
    """Every step above measured on the real engine: one set of rank processes per world size, each measuring its
    steps one after another. {(optimizer, stage, precision, sub_group_size, world_size): each rank's figure}"""
    steps = [("fused_adam", *step) for step in FUSED_ADAM_STEPS] + TORCH_STEPS
    peaks = {}
    for world_size in sorted({step[-1] for step in steps}):
        mine = [step for step in steps if step[-1] == world_size]
        ranks = ob.peaks_in_subprocesses([(stage, precision, size, optimizer)
                                          for optimizer, stage, precision, size, _ in mine], world_size)
        peaks.update(zip(mine, ranks, strict=True))
    return peaks


@pytest.mark.slow
@pytest.mark.parametrize("stage, precision, sub_group_size, world_size", FUSED_ADAM_STEPS)
def test_the_optimizer_steps_own_peak_is_predicted_to_the_byte(measured_peaks, stage, precision, sub_group_size,
                                                               world_size):
    predicted = memory.optimizer_step_bytes(stage, LAYERS, world_size, precision, sub_group_size=sub_group_size)
    ranks = measured_peaks["fused_adam", stage, precision, sub_group_size, world_size]
    assert [rank["rank"] for rank in ranks] == list(range(world_size))
    for rank in ranks:
        assert (rank["stage"], rank["precision"], rank["sub_group_size"], rank["optimizer"], rank["world_size"]) == (
            stage, precision, sub_group_size, "fused_adam", world_size)
        assert rank["param_numels"] == LAYERS
        assert predicted <= rank["peak_bytes"] <= predicted + SCALARS, (rank, predicted)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer, stage, precision, sub_group_size, world_size", TORCH_STEPS)
def test_with_torchs_optimizers_the_steps_peak_is_predicted_to_the_byte(measured_peaks, optimizer, stage, precision,
                                                                       sub_group_size, world_size):
    predicted = memory.optimizer_step_bytes(stage, LAYERS, world_size, precision, sub_group_size=sub_group_size,
                                            optimizer=optimizer)
    fused = memory.optimizer_step_bytes(stage, LAYERS, world_size, precision, sub_group_size=sub_group_size)
    assert predicted != fused or (optimizer, stage, precision) == ("torch_adam", 0, "bf16")  # 8 B either way
    ranks = measured_peaks[optimizer, stage, precision, sub_group_size, world_size]
    assert [rank["rank"] for rank in ranks] == list(range(world_size))
    for rank in ranks:
        assert (rank["stage"], rank["precision"], rank["optimizer"]) == (stage, precision, optimizer)
        assert rank["param_numels"] == LAYERS
        assert predicted <= rank["peak_bytes"] <= predicted + SCALARS, (rank, predicted)


def test_the_steps_peak_follows_its_sources_rules():
    # stage 3 groups parameters until a group reaches sub_group_size (stage3.py:1210-1233)
    assert memory.optimizer_step_bytes(3, [10, 10, 10, 10], 1, "bf16", sub_group_size=15) == 6 * 20
    assert memory.optimizer_step_bytes(3, [10, 10, 10, 10], 1, "bf16", sub_group_size=30) == 6 * 30
    assert memory.optimizer_step_bytes(3, [100, 1, 1], 1, "bf16", sub_group_size=10) == 8 * 100  # a view; the norm
    assert memory.optimizer_step_bytes(3, [10, 10], 2, "fp16") == 6 * 10  # each parameter's partition: 5
    assert memory.optimizer_step_bytes(3, [10, 10, 10], 1, "bf16", sub_group_size=0) == 8 * 10  # one each (legal)
    # stages 1-2: the rank's whole partition; offload and stage 0: not counted
    assert memory.optimizer_step_bytes(2, [10, 10, 10, 10], 2, "bf16") == 6 * 20
    assert memory.optimizer_step_bytes(2, [10, 10], 2, "bf16") == 8 * 10  # one gradient's fp64 copy is the larger
    assert memory.optimizer_step_bytes(1, [10, 10], 1, "fp32") == 4 * 20
    assert memory.optimizer_step_bytes(2, [10, 10], 2, "bf16", offload_optimizer=True) == 0
    # stage 0: the whole model's gradients, not partitioned (FP16_Optimizer); in fp32 the basic optimizer: nothing
    assert memory.optimizer_step_bytes(0, [10, 10], 2, "bf16") == 8 * 20
    assert memory.optimizer_step_bytes(0, [10], 1, "fp16") == 4 * 10  # one tensor: the flatten is a view
    assert memory.optimizer_step_bytes(0, [10, 10], 1, "fp32") == 0
    # torch's Adam: its sqrt list beside the fp32 gradients it steps with, where that is more than the copies
    assert memory.optimizer_step_bytes(2, [10, 10, 10, 10], 2, "bf16", optimizer="torch_adam") == 8 * 20
    assert memory.optimizer_step_bytes(3, [10, 10], 1, "fp32", sub_group_size=0, optimizer="torch_adam") == 80  # norm
    assert memory.optimizer_step_bytes(3, [100, 1], 1, "fp32", sub_group_size=0, optimizer="torch_adam") == 8 * 100
    assert memory.optimizer_step_bytes(3, [10, 10], 1, "fp32", optimizer="torch_adam") == 8 * 20
    assert memory.optimizer_step_bytes(0, [10], 1, "fp16", optimizer="torch_adam") == 8 * 10  # no view: unfused
    assert memory.optimizer_step_bytes(0, [10, 10], 1, "fp32", optimizer="torch_adam") == 4 * 20
    assert memory.optimizer_step_bytes(2, [10, 10], 2, "bf16", offload_optimizer=True, optimizer="torch_adam") == 0
    # torch's SGD: in place, but at stage 0 in 16 bits under FP16_UnfusedOptimizer (fp32 gradients, nothing flat)
    assert memory.optimizer_step_bytes(0, [10, 10], 1, "bf16", optimizer="torch_sgd") == 4 * 20
    assert memory.optimizer_step_bytes(2, [10, 10], 1, "bf16", optimizer="torch_sgd") == 6 * 20
    for bad in (dict(stage=4), dict(precision="int8"), dict(world_size=0), dict(sub_group_size=-1),
                dict(optimizer="cpu_adam")):
        with pytest.raises(ValueError):
            memory.optimizer_step_bytes(**{**dict(stage=3, param_numels=[1], world_size=1, precision="bf16"), **bad})


def test_a_prediction_fits_only_if_its_optimizer_step_fits_too():
    # a 1.3B GPT-2 shape on one A10G at ZeRO-3: its states and a micro-batch fit, the step's flattened and fp32
    # copies of a 1e9-element sub-group on top do not; a smaller sub_group_size makes it fit, as DeepSpeed's docs
    # advise for an OOM in the step
    work = P.TransformerWorkload(flops.Transformer(layers=24, hidden=2048, heads=16, seq=512))
    a10g = hw.Cluster(gpu=hw.gpu("A10G"), gpus_per_node=1)
    one = P.predict(work, a10g, strategy="z3", micro_batch=1, precision="bf16", activation_checkpointing=True)
    assert one.step_peak_bytes > one.usable_memory_bytes > one.device_bytes
    assert not one.fits and one.max_micro_batch == 0
    small = P.predict(work, a10g, strategy="z3", micro_batch=1, precision="bf16", activation_checkpointing=True,
                      zero={"sub_group_size": 10_000_000})
    assert small.fits and small.max_micro_batch >= 1 and small.device_bytes == one.device_bytes
    numels = [n for module in work.module_layout() for n in module]
    assert one.step_peak_bytes - small.step_peak_bytes == pytest.approx(
        memory.optimizer_step_bytes(3, numels, 1, "bf16")
        - memory.optimizer_step_bytes(3, numels, 1, "bf16", sub_group_size=10_000_000))
    card = P.predicted_card(work, a10g, strategy="z3", micro_batch=1, precision="bf16", activation_checkpointing=True)
    assert "at the optimizer step" in card["ways"]["grad_accum"]["per_step"]["condition"]


def test_the_step_holds_stage_3s_reduce_bucket_and_not_the_one_stages_1_2_freed():
    """Stages 1-2 free their reduce buckets at the end of the backward (`_release_ipg_buffers`,
    stage_1_and_2.py:924-932); stage 3 keeps its own between steps."""
    work = P.TransformerWorkload(flops.Transformer(layers=4, hidden=512, heads=8, seq=128))
    node = hw.Cluster(gpu=hw.gpu("A100-80GB"), gpus_per_node=8)
    numels = [n for module in work.module_layout() for n in module]
    for stage in (0, 1, 2, 3):
        pred = P.predict(work, node, strategy=f"z{stage}", micro_batch=1, precision="bf16")
        states = memory.model_state_bytes(work.n_params, stage, 8, "bf16",
                                          persistent_params=work.persistent_params if stage == 3 else 0)
        bucket = memory.reduce_bucket_bytes(stage, "bf16") if stage == 3 else 0
        assert pred.step_peak_bytes == states["device_bytes"] + bucket + memory.optimizer_step_bytes(
            stage, numels, 8, "bf16")


def test_plain_pytorchs_adam_step_peak_is_predicted_to_the_byte():
    # torch.optim.Adam's default step on a GPU (foreach): sqrt(exp_avg_sq) of every parameter at once, fp32
    measured = ob.peak_torch_adam()
    predicted = memory.plain_adam_step_bytes(sum(measured["param_numels"]))
    assert predicted == 4 * sum(LAYERS)
    assert predicted <= measured["peak_bytes"] <= predicted + SCALARS, (measured, predicted)
    with pytest.raises(ValueError):
        memory.plain_adam_step_bytes(0)


def test_plain_pytorch_fits_only_if_its_adam_step_fits_too():
    # the same 1.3B GPT-2 shape in plain PyTorch on one A10G: 16 B per parameter and a micro-batch's activations fit,
    # Adam's sqrt(exp_avg_sq) of every parameter on top (4 B each) does not; across 2 GPUs DDP's buckets stay too
    work = P.TransformerWorkload(flops.Transformer(layers=24, hidden=2048, heads=16, seq=512))
    one = P.predict(work, hw.Cluster(gpu=hw.gpu("A10G"), gpus_per_node=1), strategy="torch", micro_batch=1,
                    precision="bf16")
    states = memory.model_state_bytes(work.n_params, 0, 1, "bf16")["device_bytes"]
    assert one.step_peak_bytes == states + 4 * work.n_params
    assert one.step_peak_bytes > one.usable_memory_bytes > one.device_bytes
    assert not one.fits and one.max_micro_batch == 0
    two = P.predict(work, hw.Cluster(gpu=hw.gpu("A100-40GB"), gpus_per_node=2), strategy="torch", micro_batch=1,
                    precision="bf16")
    assert two.step_peak_bytes == states + P.DDP_BUCKET_BYTES_PER_PARAM * work.n_params + 4 * work.n_params
    assert two.fits and two.max_micro_batch >= 1


def test_a_lab_runs_predicted_peak_counts_its_plain_optimizers_step():
    # the lab's plain loop (Example 1): torch.optim.Adam's sqrt list; its SGD (no momentum) updates in place and
    # keeps no state (labkit.core.memory's states: 8 B per parameter of moments with Adam, nothing with SGD)
    import torch

    from labkit.core.config import RunConfig
    from labkit.models.builders import param_numels
    from labkit.study import device_need

    for optimizer, own in (("adam", 4), ("sgd", 0)):
        run = RunConfig(example="pytorch", hidden=1024, depth=2, micro_batch=1, optimizer=optimizer)
        psi = sum(param_numels(run))
        states = memory.model_state_bytes(psi, 0, 1, "fp32", optimizer=optimizer)["device_bytes"]
        assert states == (4 + 4 + (8 if optimizer == "adam" else 0)) * psi  # parameters, gradients, moments
        assert device_need.optimizer_step_peak_bytes(run) == states + own * psi + device_need.DEVICE_OVERHEAD_BYTES
    params = [torch.nn.Parameter(torch.randn(64, 64)) for _ in range(2)]
    sgd = torch.optim.SGD(params, lr=1e-3, foreach=True)
    for p in params:
        p.grad = torch.randn_like(p)
    live = ob._live_bytes()
    with live:
        sgd.step()
    assert live.peak == 0


@pytest.mark.parametrize("argv", [
    ["--peaks", "not json"], ["--peaks", "[]"], ["--peaks", '[[3, "bf16", 1000]]'],
    ["--peaks", '[[3, "bf17", 1000, null]]'], ["--peaks", '[[3, "bf16", 1000, "adamw"]]'],
    ["--peaks", '[[3, "bf16", -1, null]]'],
    ["--peaks", '[["torch", "fp32", 0, null]]', "--world-size", "2", "--port", "1"],
    ["--peaks", '[[2, "bf16", 1000, null]]', "--world-size", "2"],  # no rendezvous port
    ["--peaks", '[[1, "fp32", 1000, null], [9, "fp32", 1000, null]]'],  # the second is checked before the first runs
    ["--counts", '[["4", "bf16", null]]'], ["--counts", '[["torch", "fp32", "fused_adam"]]'],
    ["--counts", '[["2", "bf16", null], ["2", "fp8", null]]'],
])
def test_a_measurement_it_cannot_make_is_refused_before_any_runs(argv, capsys):
    with pytest.raises(SystemExit) as refused:
        ob.main(argv)
    assert refused.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and "error:" in err

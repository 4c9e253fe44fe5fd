"""Unit tests of the analytic memory model (labkit.core.memory) and of the census
(labkit.rank.census) on plain PyTorch objects: no launches, no DeepSpeed engine."""

from __future__ import annotations

import math
import types
from typing import Any

import pytest
import torch
from torch import nn

from labkit.core import memory
from labkit.models.mlp import SimpleModel, count_parameters
from labkit.rank.census import take_census as model_state_bytes

PSI = 1_000_000


def states(stage: int, n: int, precision: str = "mixed", offload: bool = False, **kw: Any) -> dict[str, int]:
    return memory.model_state_bytes(PSI, stage, n, precision, offload, **kw)


def test_mixed_precision_is_2_2_12_at_stage_0() -> None:
    s = states(0, 8)
    assert (s["param_bytes"], s["grad_bytes"], s["optim_bytes"]) == (2 * PSI, 2 * PSI, 12 * PSI)
    assert s["device_bytes"] == 16 * PSI and s["host_bytes"] == 0


@pytest.mark.parametrize("precision", ["mixed", "bf16", "fp16"])
def test_zero_paper_totals_for_mixed_precisions(precision: str) -> None:
    n = 64  # the paper's example: 7.5B params, N = 64 -> 120 GB, 31.4 GB, 16.6 GB, 1.9 GB
    totals = [states(stage, n, precision)["device_bytes"] for stage in range(4)]
    assert totals[0] == 16 * PSI
    assert totals[2] == pytest.approx(2 * PSI + 14 * PSI / n, abs=2)  # P_os+g
    assert totals[3] == pytest.approx(16 * PSI / n, abs=2)  # P_os+g+p
    # The paper's P_os keeps full grads (4*Psi + 12*Psi/N); DeepSpeed 0.19.8 has already
    # dropped the grads outside the partition when backward returns, like stage 2.
    assert totals[1] == totals[2]
    assert totals[0] > totals[2] > totals[3]


def test_stage_1_partitions_only_the_optimizer_states() -> None:
    one, two = states(1, 1), states(1, 2)
    assert two["optim_bytes"] == one["optim_bytes"] // 2
    assert two["param_bytes"] == one["param_bytes"]


def test_stage_2_halves_grads_and_stage_3_halves_params() -> None:
    assert states(2, 2)["grad_bytes"] == states(2, 1)["grad_bytes"] // 2
    assert states(2, 2)["param_bytes"] == states(2, 1)["param_bytes"]
    assert states(3, 2)["param_bytes"] == states(3, 1)["param_bytes"] // 2


def test_one_rank_saves_nothing() -> None:
    base = states(0, 1)
    for stage in (1, 2, 3):
        assert states(stage, 1) == base


def test_fp32_stage_0_has_no_master_but_partitioned_stages_clone_it() -> None:
    s0, s1 = states(0, 2, "fp32"), states(1, 2, "fp32")
    assert s0["param_bytes"] == s0["grad_bytes"] == 4 * PSI
    assert s0["optim_bytes"] == 8 * PSI  # Adam moments only (K = 8)
    assert s1["optim_bytes"] == 6 * PSI  # moments + fp32 master clone, halved (K = 12)
    # So with one rank, fp32 ZeRO-1 costs 4*Psi MORE than stage 0 (measured).
    assert states(1, 1, "fp32")["device_bytes"] - states(0, 1, "fp32")["device_bytes"] == 4 * PSI


def test_sgd_keeps_the_master_and_no_moments() -> None:
    for stage in range(4):
        for precision in ("fp32", "bf16"):
            adam, sgd = states(stage, 2, precision), states(stage, 2, precision, optimizer="sgd")
            master = 0 if precision == "fp32" and stage == 0 else 4 * PSI // (2 if stage else 1)
            assert sgd["optim_bytes"] == master
            assert adam["optim_bytes"] - sgd["optim_bytes"] == 8 * PSI // (2 if stage else 1)
            assert (sgd["param_bytes"], sgd["grad_bytes"]) == (adam["param_bytes"], adam["grad_bytes"])
    assert states(2, 2, offload=True, optimizer="sgd")["host_bytes"] == (4 + 4) * PSI // 2  # master + fp32 grads
    with pytest.raises(ValueError, match="optimizer must be one of"):
        states(0, 2, optimizer="lamb")
    with pytest.raises(ValueError, match="SGD"):
        memory.model_state_bytes(PSI, 1, 2, accounting="paper", optimizer="sgd")


def test_offload_moves_optimizer_states_and_grad_partitions_to_host() -> None:
    for stage in (1, 2, 3):
        on, off = states(stage, 4), states(stage, 4, offload=True)
        assert off["optim_bytes"] == on["optim_bytes"]
        # + the fp32 grad partition; stage 3's low-precision grad partition is on the host too
        # (stage3.py: self.device = cpu under offload, grad_partitions_flat_buffer lives there).
        host_grads = 4 * PSI // 4 + (2 * PSI // 4 if stage == 3 else 0)
        assert off["host_grad_bytes"] == host_grads
        assert off["host_bytes"] == off["optim_bytes"] + host_grads
        assert off["device_bytes"] < on["device_bytes"]
        assert on["host_bytes"] == on["host_grad_bytes"] == 0
        # Only the params stay on the device.
        assert off["device_bytes"] == off["param_bytes"]
    assert states(2, 4, offload=True)["device_bytes"] == 2 * PSI
    assert states(3, 4, offload=True)["device_bytes"] == 2 * PSI // 4
    assert states(3, 4, "fp32", offload=True)["host_grad_bytes"] == (4 + 4) * PSI // 4


def test_device_plus_host_accounts_for_every_state() -> None:
    for precision in memory.PRECISIONS:
        for stage in range(4):
            for offload in ([False, True] if stage else [False]):
                s = states(stage, 4, precision, offload)
                assert s["device_bytes"] + s["host_bytes"] == s["param_bytes"] + s["grad_bytes"] + s["optim_bytes"]


def test_stage_3_persistent_params_stay_whole_on_each_rank() -> None:
    assert states(3, 2, "fp32", persistent_params=1000)["param_bytes"] == 4 * (PSI // 2 + 1000)
    assert states(3, 1, "fp32", persistent_params=1000)["param_bytes"] == 4 * PSI


@pytest.mark.parametrize("persistent", [-1000, PSI + 1])
def test_persistent_params_are_a_subset_of_the_params(persistent) -> None:
    # -1000 made stage 3's prediction 8 KB smaller than its partition; more than PSI cannot be kept whole
    with pytest.raises(ValueError, match=rf"persistent_params must be between 0 and n_params \({PSI:,}\), "
                                         rf"got {persistent}"):
        states(3, 2, "fp32", persistent_params=persistent)


def test_matches_real_deepspeed_census() -> None:
    # labkit.rank.census on DeepSpeed 0.19.8, 2 CPU ranks, MLP 100 -> 2000 -> 10 (Psi = 222010).
    psi = memory.n_params_mlp(100, 2000, 1, 10)
    persistent = memory.mlp_persistent_params(100, 2000, 1, 10)
    measured = {  # (stage, precision, offload): param, grad, optim + master
        (0, "fp32", False): (888040, 888040, 1776080),
        (3, "fp32", False): (532060, 444020, 888040 + 444020),
        (3, "bf16", False): (266030, 222010, 888040 + 444020),
        (3, "bf16", True): (266030, 666030, 888040 + 444020),
        (1, "fp32", True): (888048, 444024, 888048 + 444024),
    }
    for (stage, precision, offload), (p, g, o) in measured.items():
        pred = memory.model_state_bytes(psi, stage, 2, precision, offload, persistent_params=persistent)
        err = memory.compare({"param_bytes": p, "grad_bytes": g, "optim_bytes": o}, pred)
        assert all(abs(e) < 1e-4 for e in err.values()), (stage, precision, offload, err)


def test_stage_1_2_grads_keep_whole_params_overlapping_the_partition() -> None:
    # Measured: rank 0 kept 800000 B (all of layer 0's weight), rank 1 all 888040 B.
    assert memory.zero12_grad_elements([200000, 2000, 20000, 10], 2) == [200000, 222010]
    # 10 params of 30 on 4 ranks: partitions of 76 elements cut params 2, 5 and 7.
    assert memory.zero12_grad_elements([30] * 10, 4) == [90, 120, 90, 90]
    # Partition boundaries on param boundaries: exactly Psi/N each.
    assert memory.zero12_grad_elements([10] * 100, 4) == [250] * 4


def test_invalid_arguments_raise() -> None:
    with pytest.raises(ValueError):
        memory.model_state_bytes(PSI, 0, 2, "int8")
    with pytest.raises(ValueError):
        memory.model_state_bytes(PSI, 4, 2)
    with pytest.raises(ValueError):
        memory.model_state_bytes(PSI, 0, 2, offload_optimizer=True)
    with pytest.raises(ValueError):
        memory.n_params_mlp(100, 10, 0, 10)


@pytest.mark.parametrize("hidden,depth", [(500, 1), (64, 3), (4096, 2)])
def test_n_params_mlp_matches_the_real_module(hidden: int, depth: int) -> None:
    model = SimpleModel(input_size=100, hidden=hidden, output_size=10, depth=depth)
    assert memory.n_params_mlp(100, hidden, depth, 10) == count_parameters(model)
    small = sum(p.numel() for p in model.parameters() if p.numel() < 100_000)
    assert memory.mlp_persistent_params(100, hidden, depth, 10) == small


def test_deepspeed_estimates_runs_and_agrees_with_its_formulas() -> None:
    model = SimpleModel(input_size=100, hidden=512, output_size=10, depth=2)
    psi = count_parameters(model)
    est = memory.deepspeed_estimates(model, world_size=4)
    assert set(est) == {"zero2", "zero2_offload", "zero3", "zero3_offload", "zero3_offload_all"}
    assert est["zero2"]["device_bytes"] == 2 * psi + int(18 * psi / 4)
    assert est["zero2_offload"]["device_bytes"] == 2 * psi
    largest = 512 * 512 + 512
    assert est["zero3"]["device_bytes"] == 4 * largest + int(18 * psi / 4)
    assert est["zero3_offload_all"]["device_bytes"] == 4 * largest
    # Count-based call gives the same as the module-based one.
    assert memory.deepspeed_estimates(psi, 4, largest_layer_params=largest) == est
    # DeepSpeed's ZeRO-2 estimate is ours (mixed) plus the fp32 grad partition built in step().
    ours = memory.model_state_bytes(psi, 2, 4, "mixed")["device_bytes"]
    assert est["zero2"]["device_bytes"] == pytest.approx(ours + 4 * psi / 4, abs=2)


def test_compare_gives_signed_relative_error_and_folds_master() -> None:
    pred = memory.model_state_bytes(PSI, 1, 2, "fp32")
    census = {"param_bytes": 4 * PSI, "grad_bytes": 3 * PSI, "optim_bytes": 4 * PSI, "master_bytes": 2 * PSI}
    err = memory.compare(census, pred)
    assert err["param_bytes"] == 0.0
    assert err["grad_bytes"] == pytest.approx(0.5)
    assert err["optim_bytes"] == 0.0  # 4 + 2 (master) == 12 * PSI / 2
    assert "device_bytes" not in err
    assert memory.compare({"host_bytes": 5}, {"host_bytes": 0})["host_bytes"] == math.inf
    assert memory.compare({"host_bytes": 0}, {"host_bytes": 0})["host_bytes"] == 0.0


def test_activation_model_is_linear_in_micro_batch() -> None:
    per_sample = memory.activation_bytes_per_sample(8000, 16)
    assert per_sample == 500.0
    assert memory.activation_bytes(per_sample, 64) == 32000
    assert memory.activation_bytes(per_sample, 0) == 0
    with pytest.raises(ValueError):
        memory.activation_bytes_per_sample(8000, 0)


# --- labkit.rank.census on plain PyTorch (no DeepSpeed, no launch) -----------------------------

def _trained(optimizer_cls: type, **kw: float) -> tuple[SimpleModel, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = SimpleModel(input_size=20, hidden=64, output_size=5, depth=2)
    opt = optimizer_cls(model.parameters(), lr=1e-3, **kw)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 20)).sum().backward()
        opt.step()
    model(torch.randn(8, 20)).sum().backward()  # the census point: grads ready, before step
    return model, opt


def test_census_plain_adam_counts_4_4_8() -> None:
    model, opt = _trained(torch.optim.Adam)
    psi, n_tensors = count_parameters(model), len(list(model.parameters()))
    c = model_state_bytes(model, opt, offload_optimizer=False)
    assert c["param_bytes"] == 4 * psi and c["grad_bytes"] == 4 * psi
    assert c["optim_bytes"] == 8 * psi + 4 * n_tensors  # exp_avg, exp_avg_sq + a 0-d fp32 "step" each
    assert c["master_bytes"] == 0 and c["host_optim_bytes"] == 0 and c["buffer_bytes"] == 0
    # On the CPU accelerator the flag decides what counts as offloaded.
    host = model_state_bytes(model, opt, offload_optimizer=True)["host_optim_bytes"]
    assert host == c["optim_bytes"] + c["master_bytes"]


def test_census_sgd_momentum_and_grads_freed() -> None:
    model, opt = _trained(torch.optim.SGD, momentum=0.9)
    psi = count_parameters(model)
    assert model_state_bytes(model, opt, offload_optimizer=False)["optim_bytes"] == 4 * psi
    opt.zero_grad(set_to_none=True)
    assert model_state_bytes(model, opt, offload_optimizer=False)["grad_bytes"] == 0


class _FakeZero:
    """The attributes DeepSpeedZeroOptimizer exposes, on tiny tensors (layout checked on 0.19.8)."""

    def __init__(self, model: nn.Module, world_size: int = 2) -> None:
        params = list(model.parameters())
        self.bit16_groups_flat = [torch.cat([p.detach().reshape(-1) for p in params])]
        offset = 0
        for p in params:  # params become views of the flat buffer, as ZeRO does
            p.data = self.bit16_groups_flat[0][offset:offset + p.numel()].view_as(p)
            p.grad = None
            offset += p.numel()
        part = offset // world_size
        master = self.bit16_groups_flat[0][:part].clone().requires_grad_(True)
        self.single_partition_of_fp32_groups = [master]
        self.optimizer = torch.optim.Adam([master])
        master.grad = torch.zeros_like(master)
        self.optimizer.step()
        master.grad = None
        grads_in_partition = torch.zeros(offset)  # whole params overlapping the partition
        self.averaged_gradients = {0: [grads_in_partition[:part]]}
        self.ipg_buckets = {torch.float32: types.SimpleNamespace(buffer=[torch.empty(1000)])}


def test_census_host_grads_follow_offload_on_the_cpu_accelerator() -> None:
    model = SimpleModel(input_size=20, hidden=64, output_size=5, depth=2)
    psi = count_parameters(model)
    fake = _FakeZero(model)
    master = fake.single_partition_of_fp32_groups[0]
    master.grad = torch.zeros_like(master)  # the fp32 grad partition (host under offload)
    fake.offload_gradient_dict = {0: [master.grad[:10]]}  # views of it
    fake.accumulated_grads_in_cpu = {0: torch.zeros(100)}  # whole grads kept with accumulation > 1
    on = model_state_bytes(model, fake, offload_optimizer=False)
    off = model_state_bytes(model, fake, offload_optimizer=True)
    assert on["grad_bytes"] == off["grad_bytes"] == 4 * psi + 4 * (psi // 2) + 400
    assert on["host_grad_bytes"] == 0 and on["host_optim_bytes"] == 0
    # The model's grads_in_partition stays on the device; the master's grad and the accumulation
    # copies are where DeepSpeed's offload device is.
    assert off["host_grad_bytes"] == 4 * (psi // 2) + 400
    assert off["host_optim_bytes"] == off["optim_bytes"] + off["master_bytes"]


def test_census_stage3_offload_grad_partition_buffer_is_host() -> None:
    model = SimpleModel(input_size=20, hidden=64, output_size=5, depth=2)
    psi = count_parameters(model)
    fake = types.SimpleNamespace(param_groups=[], state={})
    fake.fp32_partitioned_groups_flat = [torch.zeros(psi // 2, requires_grad=True)]
    fake.fp32_partitioned_groups_flat[0].grad = torch.zeros(psi // 2)
    fake.grad_partitions_flat_buffer = torch.zeros(psi // 2)
    fake.optimizer = types.SimpleNamespace(param_groups=[{"params": fake.fp32_partitioned_groups_flat}], state={})
    off = model_state_bytes(model, fake, offload_optimizer=True)
    assert off["grad_bytes"] == off["host_grad_bytes"] == 2 * 4 * (psi // 2)
    assert model_state_bytes(model, fake, offload_optimizer=False)["host_grad_bytes"] == 0


def test_census_zero_layout_dedups_views_and_separates_buffers() -> None:
    model = SimpleModel(input_size=20, hidden=64, output_size=5, depth=2)
    psi = count_parameters(model)
    fake = _FakeZero(model)
    c = model_state_bytes(model, fake, offload_optimizer=False)
    assert c["param_bytes"] == 4 * psi  # one flat buffer, not one per view
    assert c["master_bytes"] == 4 * (psi // 2)
    assert c["optim_bytes"] == 8 * (psi // 2) + 4
    assert c["grad_bytes"] == 4 * psi  # a view costs its whole storage
    assert c["buffer_bytes"] == 4000


# The ZeRO paper's Figure 1: Psi = 7.5B, N_d = 64, K = 12 (GB = 1e9 bytes).
FIGURE_1_GB = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_paper_accounting_reproduces_figure_1(stage: int) -> None:
    s = memory.model_state_bytes(7_500_000_000, stage=stage, world_size=64, precision="mixed", accounting="paper")
    gb = s["device_bytes"] / 1e9
    # The figure prints one decimal: stage 3's exact 16*Psi/N = 1.875 GB shows as 1.9 (1.3% apart), so compare
    # at the figure's precision, and to 1% where the rounding allows it.
    assert round(gb, 1) == FIGURE_1_GB[stage]
    assert gb == pytest.approx(FIGURE_1_GB[stage], rel=0.01 if stage < 3 else 0.014)


def test_deepspeed_accounting_is_the_default_and_unchanged() -> None:
    psi, n = 7_500_000_000, 64
    for stage in range(4):
        default = memory.model_state_bytes(psi, stage, n, "mixed")
        assert memory.model_state_bytes(psi, stage, n, "mixed", accounting="deepspeed") == default
    # Today's numbers: stage 1 holds a grad partition after backward, so stage 1 == stage 2.
    assert memory.model_state_bytes(psi, 1, n)["device_bytes"] == round(2 * psi + 14 * psi / n)
    assert memory.model_state_bytes(psi, 1, n)["device_bytes"] == memory.model_state_bytes(psi, 2, n)["device_bytes"]
    paper = memory.model_state_bytes(psi, 1, n, accounting="paper")
    assert paper["grad_bytes"] == 2 * psi  # P_os keeps the full grads


def test_paper_accounting_refuses_what_the_paper_does_not_model() -> None:
    for kw in (dict(precision="fp32"), dict(offload_optimizer=True), dict(persistent_params=10)):
        with pytest.raises(ValueError, match="paper"):
            memory.model_state_bytes(PSI, 3, 4, **{"precision": "mixed", **kw}, accounting="paper")
    with pytest.raises(ValueError, match="accounting"):
        memory.model_state_bytes(PSI, 1, 4, accounting="zero")


def test_accountings_side_by_side_show_the_stage_1_grads_and_the_bucket() -> None:
    table = memory.accountings(7_500_000_000, 64)
    assert list(table.stage) == [0, 1, 2, 3]
    assert (table.paper_device_bytes / 1e9).round(1).tolist() == [120.0, 31.4, 16.6, 1.9]
    stage1 = table.set_index("stage").loc[1]
    assert stage1.paper_grad_bytes == 2 * 7_500_000_000 and stage1.deepspeed_grad_bytes < stage1.paper_grad_bytes
    assert "grads_in_partition" in stage1.where_deepspeed_differs
    # The 5e8-element bucket, in the grads' dtype, shown rather than left out; none at stage 0.
    assert table.reduce_bucket_bytes.tolist() == [0, 10**9, 10**9, 10**9]
    assert memory.accountings(PSI, 2, "fp32").reduce_bucket_bytes.tolist() == [0] + [2 * 10**9] * 3
    assert memory.accountings(PSI, 2, "fp32").paper_device_bytes.isna().all()
    assert memory.accountings(PSI, 2, reduce_bucket_size=1000).reduce_bucket_bytes.max() == 2000
    # overlap_comm gives stages 1-2 a second bucket (stage_1_and_2.py setup_buckets); stage 3 keeps its one
    overlapped = [memory.reduce_bucket_bytes(s, "bf16", 1000, overlap_comm=True) for s in (0, 1, 2, 3)]
    assert overlapped == [0, 4000, 4000, 2000]

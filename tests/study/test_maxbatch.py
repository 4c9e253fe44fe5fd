"""The max-batch search's logic (labkit.study.maxbatch.find_boundary) with a fake `fits` predicate: no launches.
The real path (probes that launch DeepSpeed runs against the emulated budget) is tests/study/test_sweep.py's."""

from __future__ import annotations

import pytest

from labkit.study.maxbatch import DEVICE_EVIDENCE, EMULATED_EVIDENCE, MaxBatchResult, Probe, find_boundary


def boundary_at(capacity: int):
    """A device that fits every micro-batch up to `capacity`; records what was asked."""
    asked: list[int] = []

    def fits(micro_batch: int) -> bool:
        asked.append(micro_batch)
        return micro_batch <= capacity

    return fits, asked


@pytest.mark.parametrize("capacity", [1, 2, 3, 5, 17, 63, 64, 65, 100, 777, 4095])
@pytest.mark.parametrize("start", [1, 16, 64, 1000])
def test_finds_the_exact_boundary_wherever_it_lies(capacity: int, start: int) -> None:
    fits, asked = boundary_at(capacity)
    assert find_boundary(fits, start=start, limit=10_000) == (capacity, capacity + 1)
    # Not only among the doubled sizes: the boundary and its neighbour were both probed.
    assert capacity in asked and capacity + 1 in asked
    assert len(asked) == len(set(asked))  # no size probed twice


def test_bisects_down_when_the_start_does_not_fit() -> None:
    fits, asked = boundary_at(5)
    assert find_boundary(fits, start=64, limit=1000) == (5, 6)
    assert asked[0] == 64 and asked[1] == 32


def test_stops_at_the_limit_and_when_nothing_fits() -> None:
    fits, asked = boundary_at(10**9)
    assert find_boundary(fits, start=16, limit=100) == (100, None)
    assert asked == [16, 32, 64, 100]
    fits, _ = boundary_at(0)
    assert find_boundary(fits, start=8, limit=100) == (0, 1)


def test_tolerance_stops_within_a_fraction() -> None:
    fits, asked = boundary_at(1000)
    low, high = find_boundary(fits, start=64, limit=10_000, tolerance=0.125)
    assert low <= 1000 < high and high - low <= max(1, int(low * 0.125))
    exact, exact_asked = boundary_at(1000)
    assert find_boundary(exact, start=64, limit=10_000) == (1000, 1001) and len(exact_asked) > len(asked)


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="limit"):
        find_boundary(lambda m: True, limit=0)
    with pytest.raises(ValueError, match="tolerance"):
        find_boundary(lambda m: True, limit=10, tolerance=-0.1)


def test_summary_says_an_emulated_boundary_is_no_evidence_for_the_model() -> None:
    probes = [Probe(4, "finished", 900, 400, "a", False), Probe(8, "oom", 1300, 800, "b", False)]
    emulated = MaxBatchResult("z3", 2, 1000, True, 4, 8, probes).summary_row()
    assert emulated["boundary_evidence"] == EMULATED_EVIDENCE and "no evidence" in EMULATED_EVIDENCE
    device = MaxBatchResult("z3", 2, None, False, 4, 8, probes).summary_row()
    assert device["boundary_evidence"] == DEVICE_EVIDENCE


def test_a_search_that_reached_its_limit_says_capped_and_gives_no_ratio() -> None:
    """On 8x80 GB every strategy stopped at dataset_size // world_size after ~90 launches, and
    the report divided those capped values ("plain PyTorch fits 8x ZeRO-3's micro-batch")."""
    import pandas as pd

    from labkit.study.growth import max_micro_batches
    from labkit.study.maxbatch import memory_bound
    from labkit.study.report import _maxbatch_text

    capped = MaxBatchResult("torch", 1, None, False, 65536, None, [], limit=65536, limit_reason="the dataset")
    assert capped.capped_by == "the search's limit of 65536 per rank (the dataset)"
    real = MaxBatchResult("z3", 8, None, False, 8192, 8193, [], limit=10**7)
    assert real.capped_by is None
    stopped = MaxBatchResult("z2", 8, None, False, 64, None, [], limit=10**7, stopped_by="probe failed: boom")
    assert "neither finished nor ran out of memory" in stopped.capped_by
    table = pd.DataFrame([{**r.summary_row(), "launches": 3} for r in (capped, real, stopped)])
    assert list(memory_bound(table).strategy) == ["z3"]
    text = " ".join(_maxbatch_text(table, None))
    assert "capped by the search's limit of 65536 per rank (the dataset), not memory" in text
    assert " the micro-batch of " not in text  # no "A fits N x the micro-batch of B" from a capped value
    # the card's room-per-rank line reads only memory-bound searches (was: "ZeRO-3 fits 8192 ... where plain
    # PyTorch ... fits 65536 (0.12x)")
    assert max_micro_batches(table) == {("z3", 8): 8192}
    # Files written before `capped_by`: a row without a first OOM stopped at the limit.
    old = table.drop(columns=["capped_by"])
    assert list(memory_bound(old).strategy) == ["z3"]


def test_the_limit_is_where_the_input_alone_fills_the_device(monkeypatch) -> None:
    from labkit.core.config import RunConfig
    from labkit.runtime import devices as devices_module
    from labkit.runtime.devices import Devices
    from labkit.study.maxbatch import search_limit

    template = RunConfig(example="zero3", stage=3, world_size=1, input_size=1024, dataset_size=262144)
    h100 = Devices("cuda", 8, 8, "nccl", True, True, "NVIDIA H100 80GB HBM3", 80 * 2**30)
    monkeypatch.setattr(devices_module, "detect_devices", lambda: h100)
    limit, why = search_limit(template)
    assert limit == 80 * 2**30 // 4096 and limit > template.dataset_size and "device's memory" in why
    emulated = RunConfig(example="zero3", world_size=1, device_memory_budget_bytes=6_500_000)
    assert search_limit(emulated)[0] == 6_500_000 // 400


@pytest.mark.slow
def test_the_search_passes_the_datasets_end_to_a_real_boundary(tmp_path, runs_root) -> None:
    """Real 2-step probes on the emulated capacity: the dataset holds 256 samples, the boundary lies near 1000.
    Before, the search stopped at 256 (dataset_size // world_size) and reported it as the largest fit."""
    from labkit.core.config import RunConfig
    from labkit.study.maxbatch import search

    template = RunConfig(example="pytorch", micro_batch=1, hidden=32, dataset_size=256, steps=2,
                         device_memory_budget_bytes=700_000, threads_per_rank=1)
    result = search(template, tmp_path / "search", start=256, tolerance=0.5)
    assert result.first_oom is not None and result.capped_by is None, result.summary_row()
    assert result.max_micro_batch > 256
    beyond = [p for p in result.probes if p.micro_batch > 256]
    assert beyond and all(p.status in ("finished", "oom") for p in beyond)


@pytest.mark.parametrize("profile,gib,count", [("workshop", 16, 1), ("workshop", 24, 4), ("workshop", 80, 1),
                                               ("full", 80, 8)])
@pytest.mark.parametrize("error", [0.6, 1.0, 1.5])  # the real boundary against the memory model's
def test_each_gpu_profile_reaches_a_real_boundary_in_a_few_probes(monkeypatch, profile, gib, count, error) -> None:
    """On 8x80 GB every strategy stopped at dataset_size // world_size after ~90 launches. Now the
    limit lies past any boundary and the search starts near the predicted one: a handful of probes each."""
    from labkit.runtime import devices as devices_module
    from labkit.runtime.devices import Devices
    from labkit.study.answer import PROFILES, maxbatch_templates
    from labkit.study.device_need import predicted_device_bytes
    from labkit.study.maxbatch import predicted_start, search_limit

    gpus = Devices("cuda", count, count, "nccl", True, True, "stand-in GPU", gib * 2**30)
    monkeypatch.setattr(devices_module, "detect_devices", lambda: gpus)
    for template in maxbatch_templates(PROFILES[profile]):
        limit, _ = search_limit(template)
        start = predicted_start(template, limit)
        predicted = start * 2  # within a factor 2 of the model's boundary, by construction of the start
        boundary = max(1, int(error * predicted))
        assert boundary < limit and template.dataset_size // template.world_size < limit
        fits, asked = boundary_at(boundary)
        low, high = find_boundary(fits, start=start, limit=limit, tolerance=PROFILES[profile].maxbatch_tolerance)
        assert high is not None and low <= boundary < high  # a real out-of-memory, not the limit
        assert len(asked) <= 7, (template.stage, asked)
        import dataclasses

        at_start = dataclasses.replace(template, micro_batch=start, sample_with_replacement=True)
        assert predicted_device_bytes(at_start) <= gpus.total_memory_bytes  # the start itself should fit


def test_a_gpu_whose_optimizer_step_does_not_fit_starts_the_search_at_one(monkeypatch) -> None:
    """A 67M-parameter MLP at stage 0 in bf16: 16 B per parameter of states and a micro-batch's activations fit a
    GPU the step's fp32 copies of every gradient (8 B per parameter, FP16_Optimizer) do not; so the search starts at
    1, where the model says nothing fits, instead of near the micro-step's boundary."""
    import dataclasses

    from labkit.core import memory
    from labkit.core.config import RunConfig
    from labkit.models.builders import param_numels
    from labkit.runtime import devices as devices_module
    from labkit.runtime.devices import Devices
    from labkit.study import device_need
    from labkit.study.maxbatch import predicted_start

    run = RunConfig(example="deepspeed", stage=0, precision="bf16", hidden=4096, depth=4, micro_batch=1,
                    world_size=1, dataset_size=1 << 20)
    psi = sum(param_numels(run))
    micro, step = device_need.micro_step_bytes(run), device_need.optimizer_step_peak_bytes(run)
    states = memory.model_state_bytes(psi, 0, 1, "bf16")["device_bytes"]
    assert step == states + 8 * psi + device_need.DEVICE_OVERHEAD_BYTES
    assert micro < step and device_need.predicted_device_bytes(run) == step
    capacity = (micro + step) // 2  # a micro-step of one sample fits, the step does not
    gpus = Devices("cuda", 1, 1, "nccl", True, True, "stand-in GPU", capacity)
    monkeypatch.setattr(devices_module, "detect_devices", lambda: gpus)
    assert predicted_start(run, 1 << 20) == 1
    roomy = Devices("cuda", 1, 1, "nccl", True, True, "stand-in GPU", 4 * step)
    monkeypatch.setattr(devices_module, "detect_devices", lambda: roomy)
    start = predicted_start(run, 1 << 20)
    assert start > 1 and device_need.predicted_device_bytes(dataclasses.replace(run, micro_batch=start)) <= 4 * step

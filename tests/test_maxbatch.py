"""The max-batch search's logic (labkit.study.maxbatch.find_boundary) with a fake `fits` predicate: no launches.
The real path (probes that launch DeepSpeed runs against the emulated budget) is tests/test_sweep.py's."""

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

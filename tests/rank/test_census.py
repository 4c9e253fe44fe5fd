"""The census a rank keeps between steps and the emulated device capacity on CPU (labkit.rank.census.RankMemory,
check_emulated_capacity)."""

from __future__ import annotations

import pytest
import torch

from labkit.rank.census import RankMemory, check_emulated_capacity

CENSUS = {"param_bytes": 400, "grad_bytes": 400, "optim_bytes": 800, "master_bytes": 0,
          "host_optim_bytes": 800, "host_grad_bytes": 0, "buffer_bytes": 10_000}


def test_the_budget_counts_model_states_on_the_device_and_activations_not_offloaded_states_nor_buffers():
    check_emulated_capacity(1000, 0, CENSUS, 200)  # 400 + 400 + 200 fit; the host's 800 and the buffers do not count
    with pytest.raises(torch.OutOfMemoryError, match=r"rank 3 needs 1001 bytes .* 201 activation .* budget is 1000"):
        check_emulated_capacity(1000, 3, CENSUS, 201)


def test_no_budget_no_check():
    check_emulated_capacity(None, 0, CENSUS, 10**12)


def test_the_check_counts_the_activation_peak_of_earlier_steps():
    RankMemory(budget_bytes=900, rank=0).check(CENSUS, 50)  # 800 + 50: fits on a first step
    memory = RankMemory(budget_bytes=900, rank=0)
    memory.update(CENSUS, 200)  # an earlier step saved 200 activation bytes
    with pytest.raises(torch.OutOfMemoryError, match="needs 1000 bytes"):
        memory.check(CENSUS, 50)  # this step saved 50 so far, but the peak so far is 200: 800 + 200 > 900


def test_the_census_kept_is_the_last_one_taken_and_the_activation_bytes_their_peak():
    memory = RankMemory(budget_bytes=None, rank=0)
    memory.update(CENSUS, 300)
    memory.update({"param_bytes": 1}, 100)
    assert (memory.census, memory.activation_bytes) == ({"param_bytes": 1}, 300)

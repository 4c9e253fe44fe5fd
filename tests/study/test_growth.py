"""Where the measured batches place the critical batch (labkit.study.growth.place_critical_batch), and the
LR study read from the results (its own points, not the other ways')."""

from __future__ import annotations

import pandas as pd
import pytest

from labkit.study.growth import PLACE_BATCHES, critical_batch, place_critical_batch
from labkit.study.noise_scale import critical_batch_fit

JITTER = (1.06, 0.95, 1.04, 0.96, 1.05, 0.94, 1.03)


def _fit(batches, b_crit, s_min=10.0):
    steps = [s_min * (1 + b_crit / b) * f for b, f in zip(batches, JITTER, strict=False)]
    fit = critical_batch_fit(batches, steps)
    return {**fit, "batches": list(batches)}


def test_three_batch_sizes_cannot_place_b_crit_beyond_them():
    """The old reference: 32, 128, 512 and a fit of ~1000: above the largest batch, not an interval."""
    fit = _fit([32, 128, 512], 1000)
    placed = place_critical_batch(fit)
    assert placed["where"] == "above" and not placed["placed"]
    assert placed["text"].startswith("B_crit above the largest batch measured (512); these data cannot place it")
    below = place_critical_batch(_fit([32, 128, 512], 8))
    assert below["where"] == "below" and below["text"].startswith("B_crit below the smallest batch measured (32)")


def test_enough_batch_sizes_on_both_sides_pin_it_with_an_interval():
    batches = [32, 64, 128, 256, 512, 1024, 2048]
    assert len(batches) >= PLACE_BATCHES
    placed = place_critical_batch(_fit(batches, 300))
    assert placed["where"] == "within" and placed["placed"]
    assert placed["text"].startswith("B_crit ~ ") and "90% bootstrap interval" in placed["text"]
    # Inside the range but from three batch sizes (8 distinct bootstrap resamples): not pinned.
    few = place_critical_batch(_fit([32, 256, 2048], 300))
    assert few["where"] == "within" and not few["placed"] and "cannot place it more closely" in few["text"]


def test_the_lr_study_and_the_fit_read_the_studys_own_points():
    """The stage-0 study at every batch and rule; the grad_accum way's points at the same batches and the
    1-rank points are not part of it."""
    rows = []
    for batch, steps in ((32, 180), (64, 95), (128, 50), (256, 30), (512, 18)):
        for rule, extra in (("sqrt", 0), ("none", 10), ("linear", 5)):
            rows.append({"strategy": "z0", "growth": "micro_batch" if batch in (32, 128, 512) else None,
                         "world_size": 2, "micro_batch": batch // 2, "grad_accum": 1, "global_batch": batch,
                         "lr_scaling": rule, "status": "finished", "steps_to_target": steps + extra})
    rows.append({**rows[0], "growth": "grad_accum", "micro_batch": 64, "grad_accum": 4, "global_batch": 512,
                 "steps_to_target": 2})  # another way's point: must not become the study's best at 512
    rows.append({**rows[0], "growth": "ranks", "world_size": 1, "global_batch": 64, "steps_to_target": 1})
    fit = critical_batch(pd.DataFrame(rows))
    assert fit["batches"] == [32, 64, 128, 256, 512]
    assert fit["steps"] == [180, 95, 50, 30, 18] and set(fit["lr_scalings"]) == {"sqrt"}
    assert fit["placement"]["where"] in ("within", "above")
    assert fit["b_crit"] == pytest.approx(critical_batch_fit(fit["batches"], fit["steps"])["b_crit"])


def test_a_results_table_filtered_to_no_rows_gives_empty_tables_with_their_columns():
    """`results[results.world_size > 100]` in a notebook cell: in_growth read the empty mask as a list of column names
    (pandas' KeyError 'strategy'), and growth_table came back without columns for the next cell to select."""
    from pathlib import Path

    from labkit.study import card, growth

    results = pd.read_csv(Path(__file__).resolve().parents[2] / "data" / "reference-ci" / "results.csv")
    full = growth.growth_table(results, "ranks")
    assert len(full) > 0
    empty = results[results.world_size > 10**6]
    assert growth.in_growth(empty, "ranks").empty
    table = growth.growth_table(empty, "ranks")
    assert table.empty and list(table.columns) == list(full.columns)
    assert card.regime(empty, None) is None
    bare = growth.growth_table(pd.DataFrame(), "ranks")  # no columns at all: AttributeError 'status' before
    assert bare.empty and list(bare.columns) == list(full.columns)

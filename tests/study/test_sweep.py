"""The answer's machinery: sweep (resumable), max-batch search, noise scale, memory model, report.

Real runs are shared: one session fixture launches, side by side, a 4-point sweep (ZeRO stages
0-3 on 2 ranks, with gradient-noise probes), a 3-point memory sweep on the CI profile's model
(ZeRO-2, ZeRO-2 and ZeRO-3 with optimizer offload), the same model with torch's SGD (6 points: plain
PyTorch, stages 0, 1 and 3, stage 0 in bf16, ZeRO-2 with offload), a max-batch search under an emulated
capacity and one stop-at-target run; every test below reads them.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pandas as pd
import pytest
import torch

from labkit import Run, RunConfig
from labkit.study.maxbatch import search
from labkit.study.noise_scale import aggregate, critical_batch_from_steps, noise_scale, unbiased_estimates
from labkit.study.sweep import Sweep, plan, point_key, split_batch

# A model whose flat parameter vector splits exactly at a tensor boundary into two halves
# (129*64+64 = 64*64+64 + 64*64+64 = 8320), so ZeRO-1/2 hold exactly Psi/2 of the gradients:
# DeepSpeed keeps the whole gradient of a tensor that straddles the partition boundary, which
# the ZeRO paper's (and labkit.core.memory's) Psi/N does not model.
ALIGNED = dict(input_size=129, hidden=64, depth=2, output_size=64, dataset_size=512, micro_batch=16)
# The CI profile's model: its flat vector does NOT split at a tensor boundary (the 512x512 weight
# straddles it), so ZeRO-1/2 keep far more than Psi/2 of the gradients.
CI_MODEL = dict(input_size=100, hidden=512, depth=2, output_size=10, dataset_size=512)
MAXBATCH_MODEL = dict(input_size=100, hidden=64, depth=1, output_size=10, dataset_size=1024)
BOUNDARY = 5  # the emulated capacity below is set so that micro-batch 5 fits and 6 does not


def _budget_for(boundary: int) -> int:
    """States (labkit.core.memory) + activations (counted in-process like the worker) at boundary + 0.5."""
    from labkit.core import memory
    from labkit.models.mlp import SimpleModel
    from labkit.rank.trainers import PlainTrainer, count_saved_activations

    config = RunConfig(example="pytorch", micro_batch=1, **MAXBATCH_MODEL)
    trainer = PlainTrainer(SimpleModel(config.input_size, config.hidden, config.output_size, config.depth), config,
                           torch.device("cpu"))
    counted = []
    for micro_batch in (1, 2):
        with count_saved_activations() as saved:
            trainer.forward(torch.randn(micro_batch, config.input_size), torch.zeros(micro_batch, dtype=torch.long))
        counted.append(saved.bytes)
    per_sample, constant = counted[1] - counted[0], 2 * counted[0] - counted[1]
    n_params = memory.n_params_mlp(config.input_size, config.hidden, config.depth, config.output_size)
    states = memory.model_state_bytes(n_params, 0, 1, "fp32")["device_bytes"]
    return int(states + constant + per_sample * (boundary + 0.5))


@pytest.fixture(scope="session")
def launched(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    points = plan(["z0", "z1", "z2", "z3"], [32], [2],
                  base=dict(steps=4, noise_scale_every=2, **{k: v for k, v in ALIGNED.items() if k != "micro_batch"}))
    template = RunConfig(example="pytorch", device_memory_budget_bytes=_budget_for(BOUNDARY), **MAXBATCH_MODEL)
    stop_config = RunConfig(example="pytorch", hidden=128, micro_batch=64, steps=300, lr=4e-3, dataset_size=2048,
                            target_loss=1.6, stop_at_target=True, noise_scale_every=3)
    # Two steps: the census of step 2 sees the optimizer states created by step 1.
    memory_points = plan(["z2", "z2-offload", "z3-offload"], [32], [2], base=dict(steps=2, **CI_MODEL))
    # The same with torch's SGD (no momentum, no state): what is left is DeepSpeed's fp32 master, where it has one.
    sgd_points = plan(["torch", "z0", "z1", "z3", "z2-offload"], [32], [2],
                      base=dict(steps=2, optimizer="sgd", **CI_MODEL))
    sgd_points.append(RunConfig(example="deepspeed", stage=0, precision="bf16", world_size=2, micro_batch=16,
                                steps=2, optimizer="sgd", **CI_MODEL))

    def sweep():
        # Untimed: these points check bytes and records, not step times, so they may share cores.
        first = Sweep(points, root / "sweep", parallel=4, progress=False, timed=False)
        return first, first.run()

    def memory_sweep():
        return Sweep(memory_points, root / "memory", parallel=3, progress=False, timed=False).run()

    def sgd_sweep():
        return Sweep(sgd_points, root / "sgd", parallel=2, progress=False, timed=False).run()

    def stop_run():
        run = Run(stop_config, root=root / "stop").start()
        run.wait(timeout=600)
        return run

    with ThreadPoolExecutor(max_workers=5) as pool:
        sweep_job = pool.submit(sweep)
        memory_job = pool.submit(memory_sweep)
        sgd_job = pool.submit(sgd_sweep)
        maxbatch_job = pool.submit(search, template, root / "maxbatch", start=2)
        stop_job = pool.submit(stop_run)
        first, table = sweep_job.result()
        return {"root": root, "points": points, "first": first, "table": table, "maxbatch": maxbatch_job.result(),
                "template": template, "stop": stop_job.result(), "memory": memory_job.result(),
                "sgd": sgd_job.result()}


# -- the sweep --------------------------------------------------------------------------------------
def test_plan_splits_batches_and_dedupes():
    assert split_batch(512, 2) == (256, 1)
    assert split_batch(512, 2, max_micro_batch=100) == (64, 4)
    assert split_batch(30, 4) is None
    points = plan(["torch", "z3"], [32, 64], [1, 2], base=dict(hidden=32, dataset_size=512))
    # torch runs at one rank only (once); z3 at both world sizes.
    assert [(p.example, p.world_size, p.global_batch) for p in points] == [
        ("pytorch", 1, 32), ("pytorch", 1, 64), ("zero3", 1, 32), ("zero3", 1, 64), ("zero3", 2, 32), ("zero3", 2, 64)]
    assert len({point_key(p) for p in points}) == len(points)


@pytest.mark.slow
def test_sweep_runs_points_into_a_tidy_table(launched):
    table = launched["table"]
    assert len(table) == 4 and launched["first"].launched == 4
    assert table.status.tolist() == ["finished"] * 4
    assert table.strategy.tolist() == ["z0", "z1", "z2", "z3"]
    assert (launched["root"] / "sweep" / "results.csv").is_file()
    for column in ("median_step_time_s", "samples_per_s", "time_per_epoch_s", "param_bytes", "peak_rss_bytes",
                   "model_state_bytes", "activation_bytes", "run_id"):
        assert table[column].notna().all(), column
    assert (table.global_batch == 32).all() and (table.micro_batch == 16).all()
    # Gradient-noise probes ran at steps 2 and 4 on every ZeRO stage (ZeRO-3 gathers its partitions).
    assert (table.noise_probes == 2).all() and table.noise_trace.notna().all()
    # Every rank saw the same data and weights: identical probes across stages.
    assert table.noise_g2.max() == pytest.approx(table.noise_g2.min(), rel=1e-2)


@pytest.mark.slow
def test_sweep_resumes_without_new_launches(launched):
    root = launched["root"] / "sweep"
    again = Sweep(launched["points"], root, parallel=4, progress=False, timed=False)
    table = again.run()
    assert again.launched == 0
    assert table.run_id.tolist() == launched["table"].run_id.tolist()
    # Interrupted before the CSV was written: the run directories alone are enough.
    (root / "results.csv").unlink()
    third = Sweep(launched["points"], root, parallel=4, progress=False, timed=False)
    assert third.run().status.tolist() == ["finished"] * 4 and third.launched == 0
    assert {point_key(p) for p in launched["points"]} == set(pd.read_csv(root / "results.csv").key)


@pytest.mark.slow
def test_points_measured_by_an_older_labkit_are_not_reused(launched, tmp_path):
    import shutil

    from labkit.core.files import read_json
    from labkit.study.sweep import MEASUREMENT_VERSION, POINT_FILE

    point = launched["points"][0]
    key = point_key(point)
    assert key != point_key(point, MEASUREMENT_VERSION - 1)
    source = next(d for d in (launched["root"] / "sweep" / "runs").iterdir()
                  if (read_json(d / POINT_FILE) or {}).get("key") == key)
    old = tmp_path / "old" / "runs" / source.name
    shutil.copytree(source, old)
    (old / POINT_FILE).unlink()  # run directories from before the measurement version have no point file
    assert Sweep([point], tmp_path / "old", progress=False).known_rows({key}) == {}
    shutil.copy(source / POINT_FILE, old / POINT_FILE)
    assert list(Sweep([point], tmp_path / "old", progress=False).known_rows({key})) == [key]


@pytest.mark.slow
def test_memory_model_matches_measured_states_within_5_percent(launched):
    from labkit.core import memory

    shape = [ALIGNED[k] for k in ("input_size", "hidden", "depth", "output_size")]
    n_params = memory.n_params_mlp(*shape)
    for row in launched["table"].to_dict("records"):
        stage = int(row["stage"])
        persistent = memory.mlp_persistent_params(*shape) if stage == 3 else 0
        predicted = memory.model_state_bytes(n_params, stage, 2, "fp32", False, persistent_params=persistent)
        measured = {k: row[k] for k in ("param_bytes", "grad_bytes", "optim_bytes", "master_bytes")}
        errors = memory.compare(measured, predicted)
        assert set(errors) >= {"param_bytes", "grad_bytes", "optim_bytes"}
        assert all(abs(e) <= 0.05 for e in errors.values()), (stage, measured, predicted, errors)


@pytest.mark.slow
def test_sgd_census_matches_the_memory_model_no_moments_and_deepspeeds_master(launched):
    """torch's SGD keeps no optimizer state: the model states are Adam's less 8 B per (partitioned) parameter, the
    fp32 master that DeepSpeed keeps at stages 1-3 and in 16 bits (FP16_UnfusedOptimizer at stage 0) left."""
    from labkit.core import memory

    shape = [CI_MODEL[k] for k in ("input_size", "hidden", "depth", "output_size")]
    n_params = memory.n_params_mlp(*shape)
    table = launched["sgd"]
    assert len(table) == 6 and (table.status == "finished").all(), table[["strategy", "precision", "status"]]
    for row in table.itertuples():
        stage = 0 if pd.isna(row.stage) else int(row.stage)
        offload = bool(row.offload_optimizer) and str(row.offload_optimizer) != "False"
        persistent = memory.mlp_persistent_params(*shape) if stage == 3 else 0
        predicted = memory.model_state_bytes(n_params, stage, int(row.world_size), row.precision, offload,
                                             persistent_params=persistent, optimizer="sgd")
        assert row.optim_bytes == 0, row  # optimizer.state is empty
        master = 0 if row.precision == "fp32" and stage == 0 else 4 * n_params / (2 if stage else 1)
        assert row.master_bytes == pytest.approx(master, abs=16), row
        census = {"param_bytes": row.param_bytes, "optim_bytes": row.master_bytes,
                  "host_bytes": row.host_optim_bytes + row.host_grad_bytes}
        errors = memory.compare(census, predicted)
        assert set(errors) == {"param_bytes", "optim_bytes", "host_bytes"}
        assert all(abs(e) < 1e-4 for e in errors.values()), (row.strategy, row.precision, census, predicted, errors)
        adam = memory.model_state_bytes(n_params, stage, int(row.world_size), row.precision, offload,
                                        persistent_params=persistent)
        assert adam["optim_bytes"] - predicted["optim_bytes"] == pytest.approx(8 * n_params / (2 if stage else 1),
                                                                               abs=2)
    # The answer's memory table predicts them with the run's optimizer (one row per strategy and world size)
    from labkit.study.answer import memory_table

    memory_rows = memory_table(table, {**CI_MODEL, "optimizer": "sgd"})
    assert len(memory_rows) == 5 and (memory_rows.error_optim_bytes.abs() < 1e-4).all(), memory_rows
    # DeepSpeed's estimators count Adam's moments: beside SGD runs they are left out, beside Adam's they are there
    assert "deepspeed_estimate_device_bytes" not in memory_rows
    assert memory_table(table, CI_MODEL).deepspeed_estimate_device_bytes.notna().any()


@pytest.mark.slow
def test_zero1_halves_optimizer_state_and_zero3_the_partitioned_parameters_per_rank(launched):
    """What each stage partitions, read off the sweep's 2-rank points (states per rank, as the census counts)."""
    from labkit.core import memory

    table = launched["table"].set_index("strategy")
    assert table.loc["z0", "optim_bytes"] > 0
    assert table.loc["z1", "optim_bytes"] == pytest.approx(table.loc["z0", "optim_bytes"] / 2, rel=0.02)
    # ZeRO-3 partitions every parameter (each rank holds half of each) and keeps those below
    # stage3_param_persistence_threshold whole beside their partition (all of the aligned model's are below it).
    shape = [CI_MODEL[k] for k in ("input_size", "hidden", "depth", "output_size")]
    whole = 4 * memory.n_params_mlp(*shape)
    persistent = 4 * memory.mlp_persistent_params(*shape)
    assert whole - persistent >= 4 * 512 * 512
    z3 = launched["memory"].set_index("strategy").loc["z3-offload", "param_bytes"]
    assert z3 - persistent == pytest.approx(whole / 2, rel=0.02)


@pytest.mark.slow
def test_memory_table_predicts_stage_1_2_grads_from_deepspeeds_layout(launched):
    from labkit.study.answer import memory_table

    model = {k: v for k, v in ALIGNED.items() if k != "micro_batch"}
    table = memory_table(launched["table"], model).set_index("strategy")
    for strategy in ("z1", "z2"):
        row = table.loc[strategy]
        assert row.predicted_layout_grad_bytes == row.measured_grad_bytes, row
    assert table.loc[["z0", "z3"], "predicted_layout_grad_bytes"].isna().all()  # only stages 1/2 keep whole params
    # On the CI model the partition boundary cuts the 512x512 weight: the layout prediction (whole
    # grads of every param overlapping the rank's slice) is what rank 1 holds, far from Psi/N.
    row = memory_table(launched["memory"], CI_MODEL).set_index("strategy").loc["z2"]
    assert row.measured_grad_bytes == row.predicted_layout_grad_bytes, row
    assert row.measured_grad_bytes > 1.5 * row.predicted_grad_bytes, row


@pytest.mark.slow
def test_offload_census_matches_the_memory_model_on_device_and_host(launched):
    """Optimizer offload keeps the optimizer states, the fp32 master and the grad partitions (at
    ZeRO-3 the low-precision one too) on the host: only the params count as device bytes."""
    from labkit.core import memory

    shape = [CI_MODEL[k] for k in ("input_size", "hidden", "depth", "output_size")]
    n_params = memory.n_params_mlp(*shape)
    table = launched["memory"].set_index("strategy")
    assert (table.status == "finished").all(), table.status
    for strategy, stage in (("z2-offload", 2), ("z3-offload", 3)):
        row = table.loc[strategy]
        persistent = memory.mlp_persistent_params(*shape) if stage == 3 else 0
        predicted = memory.model_state_bytes(n_params, stage, 2, "fp32", True, persistent_params=persistent)
        states = row.param_bytes + row.grad_bytes + row.optim_bytes + row.master_bytes
        census = {"param_bytes": row.param_bytes, "grad_bytes": row.grad_bytes,
                  "optim_bytes": row.optim_bytes + row.master_bytes, "host_grad_bytes": row.host_grad_bytes,
                  "host_bytes": row.host_optim_bytes + row.host_grad_bytes,
                  "device_bytes": states - row.host_optim_bytes - row.host_grad_bytes}
        errors = memory.compare(census, predicted)
        assert set(errors) == {"param_bytes", "grad_bytes", "optim_bytes", "host_grad_bytes", "host_bytes",
                               "device_bytes"}
        # Stage 1/2 pad their partitions to a multiple of 2N elements: a few bytes.
        assert all(abs(e) < 1e-4 for e in errors.values()), (strategy, census, predicted, errors)
        assert row.host_optim_bytes == row.optim_bytes + row.master_bytes > 0
        assert row.host_grad_bytes == row.grad_bytes > 0  # no grad stays on the device
        # The sweep's device column (what the emulated capacity counts) holds params + activations only.
        assert row.device_bytes == row.param_bytes + row.activation_bytes


# -- max-batch search -------------------------------------------------------------------------------
@pytest.mark.slow
def test_maxbatch_finds_the_emulated_boundary(launched):
    from labkit.core import memory

    result = launched["maxbatch"]
    assert result.emulated and result.budget_bytes == launched["template"].device_memory_budget_bytes
    assert (result.max_micro_batch, result.first_oom) == (BOUNDARY, BOUNDARY + 1)
    # Doubling 2, 4, 8 (OOM), then bisection 6 (OOM), 5.
    assert [p.micro_batch for p in result.probes] == [2, 4, 8, 6, 5] and result.launches == 5
    assert [p.fits for p in result.probes] == [True, True, False, False, True]
    # Consistent with the memory numbers: the counted bytes straddle the budget at the boundary, the
    # measured states equal labkit.core.memory's prediction, and the linear activation model predicts it.
    assert result.consistent()
    at_max = next(p for p in result.probes if p.micro_batch == BOUNDARY)
    at_oom = next(p for p in result.probes if p.micro_batch == BOUNDARY + 1)
    assert at_max.device_bytes <= result.budget_bytes < at_oom.device_bytes
    n_params = memory.n_params_mlp(*[MAXBATCH_MODEL[k] for k in ("input_size", "hidden", "depth", "output_size")])
    # (torch's Adam also keeps a 4-byte step counter per tensor: 16 bytes here.)
    assert result.state_bytes == pytest.approx(memory.model_state_bytes(n_params, 0, 1, "fp32")["device_bytes"], abs=64)
    assert result.predicted_max_micro_batch == BOUNDARY
    # ...which it must: the emulated boundary is that count enforced, and maxbatch.csv says so.
    assert "no evidence" in result.summary_row()["boundary_evidence"]


@pytest.mark.slow
def test_points_that_did_not_finish_have_no_throughput(launched):
    from labkit.study.sweep import row_from_run

    rows = [row_from_run(d) for d in (launched["root"] / "maxbatch" / "runs").iterdir()]
    ooms = [r for r in rows if r["status"] == "oom"]
    fits = [r for r in rows if r["status"] == "finished"]
    assert ooms and fits
    # An OOM probe ran a step or two of lazy allocations: no throughput, no epoch time from it.
    assert all(r["samples_per_s"] is None and r["time_per_epoch_s"] is None for r in ooms)
    assert all(r["samples_per_s"] > 0 and r["time_per_epoch_s"] > 0 for r in fits)


@pytest.mark.slow
def test_maxbatch_search_replays_cached_probes(launched):
    again = search(launched["template"], launched["root"] / "maxbatch", start=2)
    assert again.max_micro_batch == BOUNDARY and again.launches == 5 and again.new_launches == 0


# -- stop at target (worker) ------------------------------------------------------------------------
@pytest.mark.slow
def test_stop_at_target_ends_the_run_at_the_target(launched):
    run = launched["stop"]
    summary = run.summary
    assert run.status == "finished", summary["cause"]
    assert summary["steps_to_target"] is not None
    assert summary["steps_completed"] == summary["steps_to_target"] < 300
    done = next(r for r in run.records()[0] if r["event"] == "done")
    assert done["stopped_at_target"] is True and done["steps"] == summary["steps_completed"]
    probes = [r for r in run.records()[0] if r.get("grad_norm_big_sq") is not None]
    assert [r["step"] for r in probes] == list(range(3, summary["steps_completed"] + 1, 3))
    assert all(r["noise_b_small"] == 32 and r["noise_b_big"] == 64 for r in probes)


# -- noise scale (pure) -----------------------------------------------------------------------------
def test_noise_scale_estimator_recovers_synthetic_noise():
    """Per-example gradients G + e with Cov(e) = diag(sigma^2): B_simple = sum(sigma^2) / |G|^2."""
    generator = torch.Generator().manual_seed(0)
    dim = 50
    true_grad = torch.randn(dim, generator=generator, dtype=torch.float64) * 0.1
    sigma = torch.rand(dim, generator=generator, dtype=torch.float64) + 0.5
    expected = float(sigma.pow(2).sum() / true_grad.pow(2).sum())
    b_small, b_big = 8, 64
    measurements = []
    for _ in range(400):
        examples = true_grad + sigma * torch.randn(b_big, dim, generator=generator, dtype=torch.float64)
        small = examples[:b_small].mean(0).pow(2).sum().item()
        big = examples.mean(0).pow(2).sum().item()
        measurements.append((small, big, b_small, b_big))
    pooled = aggregate(measurements)
    assert pooled.n == 400
    assert pooled.trace == pytest.approx(float(sigma.pow(2).sum()), rel=0.05)
    assert pooled.g2 == pytest.approx(float(true_grad.pow(2).sum()), rel=0.15)
    assert pooled.b_simple == pytest.approx(expected, rel=0.15)


def test_unbiased_estimates_invert_the_expectation_exactly():
    g2, trace = 2.0, 300.0
    small, big = g2 + trace / 10, g2 + trace / 100  # E|G_B|^2 = |G|^2 + tr(Sigma)/B
    assert unbiased_estimates(small, big, 10, 100) == pytest.approx((g2, trace))
    assert noise_scale(small, big, 10, 100) == pytest.approx(150.0)
    with pytest.raises(ValueError):
        unbiased_estimates(small, big, 100, 10)


def test_critical_batch_fit_recovers_the_empirical_model():
    s_min, b_crit = 40.0, 256.0
    batches = [32, 64, 128, 256, 512, 1024]
    fit = critical_batch_from_steps(batches, [s_min * (1 + b_crit / b) for b in batches])
    assert fit["b_crit"] == pytest.approx(b_crit) and fit["s_min"] == pytest.approx(s_min)
    assert critical_batch_from_steps([64], [10]) is None


# -- report (pure) ----------------------------------------------------------------------------------
DATASET = 8192  # samples per epoch of the table below
# (strategy, growth, ranks, micro-batch, accumulation, median step s, steps to target): the shape of
# data/reference-ci/results.csv. Points two ways share carry both ("grad_accum+micro_batch+ranks"); ZeRO-3 on one
# rank runs out of the emulated capacity at micro-batch 64, where plain PyTorch and ZeRO-0 fit.
REPORT_POINTS = [
    ("torch", "micro_batch", 1, 16, 1, 0.0010, 350),
    ("torch", "micro_batch+ranks", 1, 64, 1, 0.0017, 100),
    ("torch", "micro_batch", 1, 256, 1, 0.0051, 24),
    ("z0", "ranks", 1, 64, 1, 0.0021, 88),
    ("z0", "micro_batch", 2, 16, 1, 0.0045, 180),
    ("z0", "grad_accum+micro_batch+ranks", 2, 64, 1, 0.0054, 48),
    ("z0", "micro_batch", 2, 256, 1, 0.0100, 16),
    ("z0", "grad_accum", 2, 64, 4, 0.0114, 16),
    ("z0", "grad_accum", 2, 64, 16, 0.0267, 30),
    ("z2", "micro_batch", 2, 16, 1, 0.0080, 180),
    ("z2", "micro_batch", 2, 256, 1, 0.0175, 16),
    ("z3", "micro_batch", 2, 16, 1, 0.0120, 180),
    ("z3", "grad_accum+micro_batch+ranks", 2, 64, 1, 0.0121, 48),
    ("z3", "micro_batch", 2, 256, 1, 0.0156, 16),
    ("z3", "grad_accum", 2, 64, 4, 0.0377, 16),
    ("z3", "grad_accum", 2, 64, 16, 0.1248, 30),
    ("z3", "ranks", 1, 64, 1, None, None),  # out of memory
]


def _results_frame(step_times: dict | None = None) -> pd.DataFrame:
    """A results.csv as labkit.study.sweep writes it (the columns the report reads), from REPORT_POINTS;
    `step_times` = {(strategy, ranks, micro-batch, accumulation): median step s} overrides a point's."""
    rows = []
    for strategy, growth, ranks, micro, accum, step, steps in REPORT_POINTS:
        step = (step_times or {}).get((strategy, ranks, micro, accum), step)
        batch, done = ranks * micro * accum, step is not None
        rows.append({
            "key": f"{strategy}-w{ranks}-m{micro}-a{accum}", "strategy": strategy, "growth": growth,
            "world_size": ranks, "micro_batch": micro, "grad_accum": accum, "global_batch": batch,
            "threads_per_rank": 1, "concurrent_runs": 0, "lr_scaling": "sqrt", "warmup_samples": 1024,
            "warmup_steps": max(1, 1024 // batch), "target_loss": 0.8, "target_measured_on": "eval_loss",
            "status": "finished" if done else "oom",
            "median_step_time_s": step, "samples_per_s": batch / step if done else None,
            "time_per_epoch_s": step * DATASET / batch if done else None, "steps_to_target": steps,
            "epochs_to_target": steps * batch / DATASET if done else None,
            "compute_time_to_target_s": steps * step if done else None,
            "train_time_to_target_s": steps * step * 1.05 if done else None,
            "time_to_target_s": 4.0 + steps * step * 1.1 if done else None,
            "final_loss": 0.79 if done else None, "eval_loss": 0.795 if done else None,
            "model_state_bytes": 5.1e6 / (ranks if strategy == "z3" else 1), "activation_bytes": 4500.0 * micro,
            "device_bytes": 5.1e6 / (ranks if strategy == "z3" else 1) + 4500.0 * micro,
            "device_budget_bytes": 6.5e6, "peak_rss_bytes": 4e8, "run_id": f"run-{strategy}-w{ranks}-b{batch}"})
    return pd.DataFrame(rows)


def _at(results: pd.DataFrame, strategy: str, ranks: int, micro: int, accum: int = 1) -> pd.Series:
    return results[(results.strategy == strategy) & (results.world_size == ranks) & (results.micro_batch == micro)
                   & (results.grad_accum == accum)].iloc[0]


def _time_to_target_ratio(results: pd.DataFrame, strategy: str) -> float:
    """The micro-batch way's time to target, micro-batch 256 over 16 on 2 ranks: steps x median step time."""
    first, last = _at(results, strategy, 2, 16), _at(results, strategy, 2, 256)
    return (last.steps_to_target * last.median_step_time_s) / (first.steps_to_target * first.median_step_time_s)


def test_report_conclusions_are_computed_from_the_numbers(tmp_path):
    import html

    from labkit.study.report import build_report, conclusions, figures

    results = _results_frame()
    text = "\n".join(conclusions(results))
    # Credit over the micro-batch way: ZeRO-2 changed the time to target by stage 0's factor, ZeRO-3 by more.
    z0, z2, z3 = (_time_to_target_ratio(results, s) for s in ("z0", "z2", "z3"))
    z3_vs_z0 = _at(results, "z3", 2, 256).compute_time_to_target_s / _at(results, "z0", 2, 256).compute_time_to_target_s
    assert (f"Credit (a bigger micro-batch on fixed ranks): stage 0 alone changed the time to target {z0:.2f}x; "
            f"ZeRO-2 {z2:.2f}x changed it by the same factor (within 10%): that change belongs to the bigger batch "
            f"and data parallelism, not to ZeRO; ZeRO-3 {z3:.2f}x (fell further than stage 0's) (at the largest "
            f"batch still {z3_vs_z0:.2f}x stage 0's time to target): a smaller ratio than stage 0's.") in text
    engine = _at(results, "z0", 1, 64).median_step_time_s / _at(results, "torch", 1, 64).median_step_time_s
    assert f"plain PyTorch loop at the same micro-batch 64: {engine:.2f}x the step time" in text
    # An OOM is set beside what fit at the same per-rank micro-batch and ranks.
    assert ("At micro-batch 64 per rank on 1 rank(s), ZeRO-3 ran out of memory (emulated device capacity 6.50 MB "
            "per rank) while plain PyTorch, ZeRO-0 (DDP) fit at the same micro-batch and ranks.") in text
    # Change the numbers, the text follows: a slower ZeRO-3 at micro-batch 256 falls less than stage 0.
    slower = _results_frame({("z3", 2, 256, 1): 0.0300})
    slower_text = "\n".join(conclusions(slower))
    z3_slower = _time_to_target_ratio(slower, "z3")
    assert f"ZeRO-3 {z3_slower:.2f}x (fell less than stage 0's): a larger ratio than stage 0's" in slower_text
    assert "fell further" not in slower_text and f"{z3_slower:.2f}x" not in text

    # The micro-batch way's figure plots each strategy's step times at its global batches.
    figs = dict(figures(results))
    way = "Growing the batch by a bigger micro-batch on fixed ranks"
    assert set(figs) == {"Growing the batch by more ranks at a fixed per-rank micro-batch", way,
                         "Growing the batch by more gradient accumulation at a fixed micro-batch and ranks",
                         "Credit: each DeepSpeed point's step time against stage 0 and plain PyTorch"}
    step_time = next(t for t in figs[way].data if t.name == "ZeRO-3" and t.xaxis == "x")
    assert list(step_time.x) == [32, 128, 512]
    assert list(step_time.y) == [_at(results, "z3", 2, m).median_step_time_s for m in (16, 64, 256)]

    path = build_report(results, tmp_path / "report.html", machine={"cpu_model": "test CPU", "cpu_cores": 2,
                                                                     "parallel": 1}, devices=None)
    page = path.read_text()
    assert "Plotly.newPlot" in page and "plotly.js" in page.lower()  # figures with the library embedded
    assert "<script src=" not in page                                 # nothing fetched: works offline
    assert "The answer card (answer_card.json)" in page
    first, last = _at(results, "z3", 2, 16), _at(results, "z3", 2, 256)
    under = (f"ZeRO-3: global batch 32 -> 512 (micro-batch 16 -> 256 on 2 rank(s)): time per step slower "
             f"({last.median_step_time_s / first.median_step_time_s:.2f}x)")
    assert page.index(html.escape(way)) < page.index(html.escape(under))  # the way's sentences under its figure
    assert html.escape(f"stage 0 alone changed the time to target {z0:.2f}x") in page and "run-z3-w2-b512" in page
    assert path.stat().st_size < 5_000_000


def test_report_with_every_table(tmp_path):
    from labkit.study.report import TABLE_COLUMNS, build_report

    results = _results_frame()
    noise = pd.DataFrame([{"strategy": "z0", "global_batch": 32, "lr_scaling": "sqrt", "step": s,
                           "loss": 2.0 - s / 50, "grad_norm_small_sq": 1.0 + 100 / 16,
                           "grad_norm_big_sq": 1.0 + 100 / 32, "noise_b_small": 16, "noise_b_big": 32,
                           "noise_scale": 100.0} for s in range(2, 60, 2)])
    maxbatch = pd.DataFrame([{"strategy": "torch", "world_size": 1, "budget_bytes": 6.5e6, "emulated_capacity": True,
                              "max_micro_batch": 150, "max_global_batch": 150, "first_oom": 160, "launches": 6,
                              "new_launches": 6, "predicted_max_micro_batch": 155, "consistent": True,
                              "analytic_max_micro_batch": 140},
                             {"strategy": "z3", "world_size": 2, "budget_bytes": 6.5e6, "emulated_capacity": True,
                              "max_micro_batch": 300, "max_global_batch": 600, "first_oom": 320, "launches": 7,
                              "new_launches": 7, "predicted_max_micro_batch": 310, "consistent": True,
                              "analytic_max_micro_batch": 290}])
    text = build_report(results, tmp_path / "r.html", noise=noise, maxbatch=maxbatch, devices=None).read_text()
    assert "B_simple = tr(Sigma)/|G|^2 ~ 100 samples" in text and "it ranged 100-100" in text
    assert "ZeRO-3 fits 2.0x the micro-batch of plain PyTorch" in text
    assert "13 launches for 2 strategies" in text
    assert "<h2>Results (results.csv)</h2>" in text and "<h2>Max-batch search (maxbatch.csv)</h2>" in text
    assert all(f"<th>{c}</th>" in text for c in TABLE_COLUMNS if c in results)


def test_report_refuses_results_without_a_growth_column(tmp_path):
    from labkit.study.report import build_report, conclusions, figures

    older = _results_frame().drop(columns="growth")  # an older labkit's results.csv
    ci = {"name": "ci"}
    for draw in (lambda: conclusions(older, profile=ci), lambda: figures(older, profile=ci),
                 lambda: build_report(older, tmp_path / "out" / "report.html", profile=ci, devices=None)):
        with pytest.raises(ValueError, match=r"no `growth` column.*Re-run `python -m labkit answer --profile ci`"):
            draw()
    assert not (tmp_path / "out").exists()  # refused before anything was written
    with pytest.raises(ValueError, match=r"--profile NAME"):  # no profile given: the flag still named
        conclusions(older)


def test_report_memory_and_maxbatch_text_follow_the_numbers():
    from labkit.study.report import _maxbatch_text, _memory_text

    def memory_row(strategy, stage, grad_error, layout_error=None, persistent=0):
        return {"strategy": strategy, "world_size": 2, "stage": stage, "offload_optimizer": False,
                "persistent_params": persistent, "measured_device_bytes": 4e6 if stage == 0 else 2e6,
                "error_param_bytes": 0.0, "error_grad_bytes": grad_error, "error_optim_bytes": 0.0,
                "error_layout_grad_bytes": layout_error}

    explained = pd.DataFrame([memory_row("z0", 0, 0.0), memory_row("z2", 2, 0.96, 0.0),
                              memory_row("z3", 3, 0.0, persistent=57354)])
    text = " ".join(_memory_text(explained))
    assert "ZeRO-2: DeepSpeed keeps the whole gradient of a parameter that straddles" in text
    assert "57354 parameters in small tensors stay whole" in text
    # A grad deviation the layout does not predict gets no layout story; no persistent params, no threshold.
    unexplained = pd.DataFrame([memory_row("z0", 0, 0.0), memory_row("z2", 2, 0.96, 0.5), memory_row("z3", 3, 0.3)])
    text = " ".join(_memory_text(unexplained))
    assert "straddles" not in text and "ZeRO-2, ZeRO-3: not explained by the partition layout" in text
    assert "persistence threshold" not in text

    maxbatch = pd.DataFrame([{"strategy": "torch", "world_size": 1, "budget_bytes": 6e6, "emulated_capacity": True,
                              "max_micro_batch": 288, "first_oom": 320, "launches": 7},
                             {"strategy": "z3", "world_size": 2, "budget_bytes": 6e6, "emulated_capacity": True,
                              "max_micro_batch": 640, "first_oom": 641, "launches": 8}])
    text = " ".join(_maxbatch_text(maxbatch, None))
    assert "plain PyTorch x1: largest fit 288, first OOM 320 per rank (the boundary lies in 288-319" in text
    assert "ZeRO-3 x2: 640 per rank (1280 global; 641 ran out of memory)" in text

"""The learner's own model (import strings) and the built-in GPT, in real 2-rank DeepSpeed runs."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from labkit import Run, RunConfig
from labkit.core.config import ConfigError
from labkit.core.records import rank_file, read_records
from labkit.models import builders
from labkit.study.sweep import point_key, strategy_of
from tests.conftest import REPO, run_together

OWN = dict(model="tests.own_model:build_model", data="tests.own_model:build_dataset",
           loss="tests.own_model:loss_fn")
GPT_CI = dict(model="gpt", hidden=64, depth=2, input_size=64, dataset_size=1024, lr=3e-3)


def _steps(run_dir, rank=0):
    return [r for r in read_records(rank_file(run_dir, rank)) if r["event"] == "step"]


@pytest.mark.parametrize("fields,field_name", [
    (dict(model="not an import string"), "model"),
    (dict(model="tests.own_model:build_model"), "data"),  # an import string needs its dataset
    (dict(data="tests.own_model"), "data"),
    (dict(loss="tests.own_model:loss fn"), "loss"),
])
def test_malformed_import_strings_are_refused_by_the_config(fields, field_name):
    with pytest.raises(ConfigError) as error:
        RunConfig(**fields)
    assert error.value.field == field_name


@pytest.mark.slow
@pytest.mark.parametrize("fields,field_name,words", [
    (dict(OWN, model="tests.no_such_module:build_model"), "model", "No module named 'tests.no_such_module'"),
    (dict(OWN, data="tests.own_model:no_such_builder"), "data", "no_such_builder"),
    (dict(OWN, loss="tests.own_model:not_callable"), "loss", "not a callable"),
])
def test_unimportable_strings_fail_before_launch(fields, field_name, words, runs_root):
    run = Run(RunConfig(example="zero3", world_size=2, micro_batch=8, steps=2, **fields))
    with pytest.raises(ConfigError) as error:
        run.start()
    assert error.value.field == field_name and words in str(error.value)
    assert run.run_dir is None and not runs_root.exists()  # nothing launched, nothing written


def test_a_module_found_nowhere_is_refused_without_the_child(monkeypatch):
    """The child imports torch and every string's module (seconds); a missing top-level module needs none of it."""
    from types import SimpleNamespace

    from labkit.models import builders

    def no_child(*args, **kwargs):
        raise AssertionError("the child was started")

    config = RunConfig(example="zero3", model="gpt", data="no_such_top_level_module.sub:build_dataset")
    monkeypatch.setattr(builders, "subprocess", SimpleNamespace(run=no_child))  # this module's child only
    with pytest.raises(ConfigError) as error:
        builders.check_importable(config)
    assert error.value.field == "data"
    assert str(error.value).endswith("cannot import no_such_top_level_module.sub:build_dataset: "
                                     "ModuleNotFoundError: No module named 'no_such_top_level_module'")


def test_the_quick_look_defers_to_the_child_where_an_import_hook_or_a_customize_file_could_find_it(tmp_path,
                                                                                                     monkeypatch):
    """A finder on sys.meta_path (a setuptools editable install's, labkit's own here) finds modules no path entry
    holds; a sitecustomize on the child's path could install one this process lacks: neither is refused unseen."""
    import importlib.util
    import sys

    from labkit.models.builders import _findable

    class Hook:
        def find_spec(self, name, path, target=None):
            return importlib.util.spec_from_loader(name, loader=None) if name == "hooked_module_only" else None

    assert not _findable("hooked_module_only", [str(tmp_path)])
    monkeypatch.setattr(sys, "meta_path", [*sys.meta_path, Hook()])
    assert _findable("hooked_module_only", [str(tmp_path)]) and not _findable("nowhere_module", [str(tmp_path)])
    (tmp_path / "sitecustomize.py").write_text("")
    assert _findable("nowhere_module", [str(tmp_path)])


def test_the_seed_texts_model_on_its_own_data_is_not_checked_in_a_child(monkeypatch):
    """Nothing of the learner's to import: no child (a fast test, so conftest fails it if one starts), where
    `labkit predict --model mlp` started one; a data or loss string of theirs beside it still is."""
    from labkit.models import builders

    monkeypatch.setattr(builders, "_checked", {})  # an earlier test's passed check would skip the child anyway
    builders.check_importable(RunConfig(example="deepspeed"))
    with pytest.raises(ConfigError, match="cannot import nowhere_module:make"):
        builders.check_importable(RunConfig(example="deepspeed", data="nowhere_module:make"))  # refused before a child


@pytest.mark.slow
def test_a_module_edited_after_its_check_is_checked_again(tmp_path, monkeypatch):
    """A learner's module passes, then they break it in the notebook: the next launch's check sees it."""
    from labkit.models.builders import check_importable

    module = tmp_path / "edited_model.py"
    module.write_text("def build_model(config):\n    raise NotImplementedError\n")
    # On the child's import path only, as the ranks' would be (not this process's sys.path): the quick
    # look for a missing module must look there too.
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    config = RunConfig(example="zero3", model="edited_model:build_model", data=OWN["data"])
    check_importable(config)
    module.write_text("def build_model(config):\n    return undefined_name(\n")  # a syntax error
    with pytest.raises(ConfigError, match="cannot import edited_model:build_model: SyntaxError"):
        check_importable(config)


@pytest.mark.slow
def test_own_model_data_and_loss_train_under_zero2(tmp_path):
    out = tmp_path / "own"
    result = subprocess.run(
        [sys.executable, "-m", "labkit", "run", "--example", "offload", "--world-size", "2", "--micro-batch", "16",
         "--steps", "12", "--lr", "0.02", "--input-size", "12", "--hidden", "32", "--dataset-size", "512",
         "--model", OWN["model"], "--data", OWN["data"], "--loss", OWN["loss"], "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=500)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["status"] == "finished"
    steps = _steps(out)
    assert len(steps) == 12
    losses = [r["loss"] for r in steps]
    assert sum(losses[-3:]) < sum(losses[:3])  # the MSE of the regression falls (the default loss would fail)
    done = read_records(rank_file(out, 0))[-1]
    assert done["n_params"] == 12 * 32 + 32 + 32 + 1


@pytest.mark.slow
def test_sweep_and_max_batch_search_train_the_learners_model(tmp_path):
    """The sweep and the max-batch search pass the import strings to every rank they launch."""
    from labkit.study.maxbatch import search
    from labkit.study.sweep import Sweep

    own = dict(input_size=12, hidden=32, dataset_size=512, lr=0.02, steps=6, **OWN)
    n_params = 12 * 32 + 32 + 32 + 1
    points = [RunConfig(example="deepspeed", stage=0, world_size=2, micro_batch=8, **own),
              RunConfig(example="zero3", world_size=2, micro_batch=8, **own)]
    # Untimed: this checks what the ranks trained, not step times, so the two points may share the cores.
    results = Sweep(points, tmp_path / "sweep", parallel=2, progress=False, timed=False).run()
    assert (results.status == "finished").all(), results[["strategy", "status", "cause"]]
    assert (results.n_params == n_params).all() and set(results.strategy) == {"z0", "z3"}
    # Emulated capacity on: every probe is a real run of the learner's model (states ~2 KB, so all fit).
    result = search(RunConfig(example="zero3", world_size=2, device_memory_budget_bytes=10**9, **own),
                    tmp_path / "maxbatch", start=2, limit=8)
    assert result.max_micro_batch == 8 and [p.micro_batch for p in result.probes] == [2, 4, 8]
    probes = sorted(path.parent for path in (tmp_path / "maxbatch").rglob("config.json"))
    assert len(probes) == 3
    for run_dir in probes:
        config = json.loads((run_dir / "config.json").read_text())
        assert (config["model"], config["data"], config["loss"]) == (OWN["model"], OWN["data"], OWN["loss"])
        assert read_records(rank_file(run_dir, 0))[-1]["n_params"] == n_params


@pytest.mark.slow
def test_gpt_trains_on_python_source_under_zero3(runs_root):
    # Warmup as in the answer's profile: without it Adam at 3e-3 may spike (seen at step 12).
    config = RunConfig(example="zero3", world_size=2, micro_batch=8, steps=12, census_every=4, warmup_steps=3,
                       **GPT_CI)
    run = Run(config).start()
    assert run.wait(timeout=600) == "finished", run.cause
    steps = _steps(run.run_dir)
    # MFU counts the GPT's FLOPs as DeepSpeed's profiler measured them: ~6 x params per token, not per sample.
    ready = next(r for r in read_records(rank_file(run.run_dir, 0)) if r["event"] == "ready")
    assert 6 * ready["n_params"] * 64 < ready["train_flops_per_sample"] < 12 * ready["n_params"] * 64
    assert ready["device_name"] and ready["accelerator"] == "cpu"  # what `labkit predict --from` reads a GPU run by
    summary = run.summary
    assert summary["achieved_flops"] == pytest.approx(ready["train_flops_per_sample"] * summary["samples_per_s"])
    assert steps[0]["loss"] == pytest.approx(math.log(256), abs=0.6)  # a uniform guess over 256 bytes
    losses = [r["loss"] for r in steps]
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0  # byte statistics learned: real language modelling
    # ZeRO-3 keeps every parameter of this small model whole (all <= 1e5 elements): the memory model's
    # persistence threshold on the real shapes predicts the census.
    numels = builders.param_numels(config)
    from labkit.core.memory import model_state_bytes

    predicted = model_state_bytes(sum(numels), 3, 2, "fp32", persistent_params=builders.persistent_params(numels))
    assert steps[-1]["param_bytes"] == predicted["param_bytes"]


def test_gpt_dataset_is_next_byte_prediction_on_the_standard_library():
    from labkit.models import gpt

    config = RunConfig(**GPT_CI)
    dataset = builders.build_dataset(config)
    inputs, labels = dataset[5]
    assert len(dataset) == 1024 and inputs.shape == labels.shape == (64,)
    assert inputs.dtype.is_floating_point is False and int(inputs.max()) < 256
    assert bool((inputs[1:] == labels[:-1]).all())  # labels are the inputs shifted by one byte
    assert bytes(inputs.tolist()) in gpt.corpus()
    assert builders.build_dataset(config)[5][0].equal(inputs)  # deterministic


def test_param_numels_come_from_the_meta_device_and_match_the_real_model():
    import torch

    for config in (RunConfig(), RunConfig(**GPT_CI), RunConfig(input_size=12, hidden=32, **OWN)):
        torch.manual_seed(0)
        real = [p.numel() for p in builders.build_model(config).parameters()]
        assert builders.param_numels(config) == real
    mlp = RunConfig(hidden=512, depth=2)
    from labkit.core.memory import mlp_persistent_params

    assert builders.persistent_params(builders.param_numels(mlp)) == mlp_persistent_params(100, 512, 2, 10)
    # The threshold is the run's own: DeepSpeed's default, or the user's stage3_param_persistence_threshold.
    assert mlp.zero_settings().param_persistence_threshold == 100_000
    lowered = RunConfig(hidden=512, depth=2, ds_overrides={"zero_optimization": {
        "stage3_param_persistence_threshold": 1_000}})
    assert lowered.zero_settings().param_persistence_threshold == 1_000
    threshold = lowered.zero_settings().param_persistence_threshold
    assert builders.persistent_params(builders.param_numels(lowered), threshold) == (
        mlp_persistent_params(100, 512, 2, 10, threshold=1_000))


def test_default_model_keeps_old_point_keys():
    config = RunConfig(example="zero3")
    old_form = {k: v for k, v in config.to_dict().items() if k not in ("model", "data", "loss")}
    assert point_key(config) == point_key(old_form)
    assert point_key(RunConfig(example="zero3", **GPT_CI)) != point_key(config)


def test_answer_switches_to_gpt_with_one_parameter():
    from labkit.study.answer import PROFILES, maxbatch_templates, points, with_model

    profile = with_model(PROFILES["ci"], "gpt")
    assert profile.name == "ci-gpt"
    configs = points(profile) + maxbatch_templates(profile)
    assert configs and all(c.model == "gpt" and c.hidden == 64 for c in configs)
    # The GPT's own emulated capacity (answer.GPT_PROFILES): hundreds of MB, its activations being ~1 MB a sample.
    assert profile.cpu_budget_bytes > 256 * 1_000_000 and profile.maxbatch_tolerance == 0
    # Its grid keeps the LR (the rule its own LR study picks), where the MLP's grid scales it by the square root;
    # only the LR study's strategy tries the other rules.
    assert profile.grid_lr_scaling == "none" and PROFILES["ci"].grid_lr_scaling == "sqrt"
    study = profile.lr_study_strategy
    assert {c.lr_scaling for c in points(profile) if strategy_of(c) != study} == {"none"}
    assert with_model(PROFILES["smoke"], "gpt").model["hidden"] == 32
    with pytest.raises(ConfigError, match="not for 'workshop'"):
        with_model(PROFILES["workshop"], "gpt")
    own = with_model(PROFILES["ci"], OWN["model"], OWN["data"], OWN["loss"])
    assert all(c.data == OWN["data"] and c.loss == OWN["loss"] for c in points(own))
    # The MLP on the learner's data or loss: its own results directory, the MLP's settings otherwise.
    for data, loss, name in ((OWN["data"], None, "ci-mlp-tests.own_model.build_dataset"),
                             (None, OWN["loss"], "ci-mlp-tests.own_model.loss_fn")):
        mlp = with_model(PROFILES["ci"], data=data, loss=loss)
        assert mlp.name == name and all(c.model == "mlp" and c.hidden == PROFILES["ci"].model["hidden"]
                                            for c in points(mlp))
        assert all(c.data == data and c.loss == loss for c in points(mlp))


@pytest.mark.slow
def test_panel_shows_a_bad_import_string_and_launches_nothing(runs_root):
    from labkit.ui.panel import LabPanel

    panel = LabPanel(example="zero3", world_size=2, micro_batch=8, steps=2)
    panel.controls["model"].value = "tests.own_model:build_model"
    assert "data" in panel.message.value  # the config itself names the missing dataset
    panel.controls["data"].value = "tests.own_model:no_such_builder"
    assert panel.launch() is None
    assert "data: cannot import tests.own_model:no_such_builder" in panel.message.value
    assert panel.run is None and not runs_root.exists()
    panel.controls["data"].value = "tests.own_model:build_dataset"
    assert panel.config().data == "tests.own_model:build_dataset"


# -- script mode ---------------------------------------------------------------------------------
SCRIPT = str(REPO / "tests" / "scripts" / "ds_train.py")


SCRIPT_RUNS = {  # name: the script's arguments; each a 2-rank `labkit run --script` of 6 steps
    "recorded": ["--record"],
    "failing": ["--fail-rank", "1", "--fail-step", "3"],
    "teardown": ["--record", "--abort-rank", "1"],
    "abort": ["--record", "--abort-rank", "1", "--abort-step", "3"],
}


@pytest.fixture(scope="module")
def script_runs(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path, dict]]:
    """The CLI's script runs, started together and awaited: {name: (result, run directory, summary)}."""
    root = tmp_path_factory.mktemp("scripts")
    commands = {name: dict(args=[sys.executable, "-m", "labkit", "run", "--script", SCRIPT, "--world-size", "2",
                                 "--steps", "6", "--out", str(root / name), "--", "--steps", "6", *script_args],
                           cwd=REPO)
                for name, script_args in SCRIPT_RUNS.items()}
    return {name: (result, root / name, json.loads((root / name / "summary.json").read_text()))
            for name, result in run_together(commands, timeout=500).items()}


def test_script_with_one_record_line_streams_its_steps(script_runs):
    result, out, summary = script_runs["recorded"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert summary["status"] == "finished" and summary["steps_completed"] == 6
    for rank in (0, 1):
        steps = _steps(out, rank)
        assert [r["step"] for r in steps] == list(range(1, 7))
        assert all(r["loss"] > 0 and r["rss_bytes"] > 0 and r["step_time_s"] > 0 for r in steps)
    assert summary["final_loss"] is not None and summary["median_step_time_s"] is not None


@pytest.mark.slow
def test_unmodified_script_is_seen_from_outside_and_its_failure_named(script_runs):
    result, out, summary = script_runs["failing"]
    assert result.returncode == 1
    assert summary["status"] == "failed"
    assert "rank 1" in summary["cause"] and "ValueError: bad batch at step 3" in summary["cause"]
    # No labkit line in the script: the guard's samples still show each rank alive, with its memory.
    for rank in (0, 1):
        records = read_records(rank_file(out, rank))
        assert records[0]["event"] == "start" and records[0]["script"] is True
        samples = [r for r in records if r["event"] == "sample"]
        assert samples and all(r["rss_bytes"] > 10_000_000 for r in samples)
        assert not _steps(out, rank)
    from tests.conftest import run_processes

    assert not run_processes(out)  # no orphans


@pytest.mark.slow
def test_script_aborting_in_teardown_after_a_clean_exit_finishes_with_a_warning(script_runs):
    # Rank 1 aborts after every atexit hook, labkit's exit record included: what the C++ teardown abort
    # ("terminate called without an active exception") does to plain 2-rank DeepSpeed scripts now and then.
    result, out, summary = script_runs["teardown"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert summary["status"] == "finished" and summary["steps_completed"] == 6
    assert json.loads((out / "rank1.exit").read_text()) == {"rank": 1, "pid": _exit_pid(out, 1), "returncode": -6,
                                                             "teardown_abort": True}
    # (Rank 0 may meet the real teardown abort too: then a second warning, its own.)
    warning = next(w for w in summary["warnings"] if w.startswith("rank 1: "))
    assert warning.startswith("rank 1: killed by SIGABRT after its script exited cleanly")
    assert "terminate called without an active exception" in warning and "warning: rank 1" in result.stderr


def _exit_pid(out, rank):
    return next(r["pid"] for r in read_records(rank_file(out, rank)) if r["event"] == "exit")


@pytest.mark.slow
def test_script_aborting_mid_training_fails(script_runs):
    result, out, summary = script_runs["abort"]
    assert result.returncode == 1
    assert summary["status"] == "failed" and summary["warnings"] == []
    assert summary["cause"] == ("rank 1: killed by SIGABRT before its script exited cleanly (last step recorded: 3; "
                                "no exit record with status 0)")
    assert not [r for r in read_records(rank_file(out, 1)) if r["event"] in ("exit", "done")]


@pytest.mark.slow
def test_unmodified_script_is_charted_from_outside_and_an_abort_at_exit_not_excused(runs_root):
    """Without labkit.record the guard knows only the return code: a SIGABRT at exit is a failure, whose
    cause says why. Its memory samples are charted live, and its summary has no labkit fields."""
    from labkit.launch.summary import NOT_FOR_SCRIPTS
    from labkit.ui.dashboard import Dashboard

    config = RunConfig(script=SCRIPT, script_args=["--steps", "6", "--abort-rank", "1"], world_size=2, steps=6)
    run = Run(config).start()
    dash = Dashboard(run, refresh_s=0.1)
    assert run.wait(timeout=300) == "failed"
    assert dash.join(timeout=30)
    # Rank 1's abort at exit (or rank 0's real teardown abort, should it come first).
    assert re.match(r"rank [01]: killed by SIGABRT \(the script calls no labkit.record, so labkit cannot tell",
                    run.cause), run.cause
    memory = dash.figures["memory"]
    assert [t.name for t in memory.data] == ["rank 0 RSS (sampled)", "rank 1 RSS (sampled)"]
    for rank, trace in enumerate(memory.data):
        samples = [r for r in read_records(rank_file(run.run_dir, rank)) if r["event"] == "sample"]
        assert len(trace.x) == len(samples) >= 2 and all(y > 10 for y in trace.y)  # MiB of a live Python + torch
        assert list(trace.x) == [r["time_s"] for r in samples]
    assert memory.layout.xaxis.title.text.startswith("time")
    summary = run.summary
    assert summary["mode"] == "script" and summary["script"] == SCRIPT
    assert not set(NOT_FOR_SCRIPTS) & set(summary)
    for rank in ("0", "1"):
        assert summary["per_rank"][rank]["memory_samples"] >= 2
        assert summary["per_rank"][rank]["peak_rss_bytes"] > 10_000_000


@pytest.mark.slow
def test_stop_ends_a_script_run_without_orphans_and_keeps_its_records(runs_root):
    from labkit.launch import proctree

    config = RunConfig(script=SCRIPT, script_args=["--steps", "100000", "--record", "--sleep-s", "0.1"],
                       world_size=2, steps=100_000)
    run = Run(config).start()
    deadline = time.monotonic() + 300
    while run.progress() < 3 and time.monotonic() < deadline and not run.done:
        time.sleep(0.2)
    assert run.progress() >= 3, (run.run_dir / "supervisor.log").read_text()
    # The script's own processes need not name the run directory: take the supervisor's whole tree.
    tree = proctree.descendants(run._supervisor_pid(), itself=False)
    assert len(tree) >= 4  # launcher, 2 guards, 2 scripts
    assert run.stop() == "stopped"
    alive = [p for p in tree if proctree.alive(p)]
    assert not alive, [p.cmdline() for p in alive]
    summary = run.summary
    assert summary["status"] == "stopped" and summary["mode"] == "script" and summary["steps_completed"] >= 3
    for rank in (0, 1):
        assert len(_steps(run.run_dir, rank)) >= 3  # what the script recorded before Stop is kept


# What ends the process after every atexit hook: the abort, or the SIGSEGV it turns into when faulthandler
# dumps a finalized interpreter (CI: "Fatal Python error: Aborted", then "Segmentation fault").
_CRASHES = {"abort": ("os.abort", -6), "segv": ("lambda: os.kill(os.getpid(), signal.SIGSEGV)", -11)}


@pytest.mark.slow
@pytest.mark.parametrize("crash", list(_CRASHES))
@pytest.mark.parametrize("ending,verdict", [
    ("", "teardown_abort"),                         # clean Python exit, then the crash in teardown
    ("sys.exit(3)", "failed"),                      # a non-zero exit status, then the crash
    ("raise ValueError('late')", "failed"),         # an uncaught exception, then the crash
    ("os.abort()", "failed"),                       # an abort before the interpreter's exit
])
def test_exit_record_holds_the_python_level_exit_status(tmp_path, ending, verdict, crash):
    """labkit.record's exit hook in a real interpreter that crashes (SIGABRT or SIGSEGV) after its atexit hooks."""
    import os
    import textwrap

    from labkit.rank.script import judge_exit

    hook, signalled = _CRASHES[crash]
    code = textwrap.dedent(f"""
        import atexit, faulthandler, os, signal, sys
        atexit.register({hook})  # first registered, last run: after labkit's exit record
        atexit.register(lambda: print("faulthandler on:", faulthandler.is_enabled(), flush=True))
        import labkit
        labkit.record(step=1, loss=1.0)
        {ending}
    """)
    child = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "LABKIT_RUN_DIR": str(tmp_path), "RANK": "0", "PYTHONPATH": str(REPO),
                                "PYTHONFAULTHANDLER": "1"})  # as the rank guard runs scripts
    assert child.returncode == (-6 if ending == "os.abort()" else signalled), child.stderr
    exits = [r for r in read_records(rank_file(tmp_path, 0)) if r["event"] == "exit"]
    expected = {"": [0], "sys.exit(3)": [3], "raise ValueError('late')": [1], "os.abort()": []}[ending]
    assert [r["status"] for r in exits] == expected
    pid = exits[0]["pid"] if exits else 0
    assert judge_exit(tmp_path, 0, pid, child.returncode) == verdict
    # After a clean exit record only C++ teardown is left: faulthandler is off so it cannot turn an abort
    # into a crash of its own; after a failure it stays on, for the stacks.
    if ending != "os.abort()":
        assert f"faulthandler on: {ending != ''}" in child.stdout


# -- DeepSpeed's monitors and export-metrics -------------------------------------------------------
def _scalars(event_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(event_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.mark.slow
def test_tensorboard_monitor_gets_labkits_fields_and_export_metrics_converts_a_run(tmp_path):
    out = tmp_path / "monitored"
    result = subprocess.run(
        [sys.executable, "-m", "labkit", "run", "--example", "zero3", "--world-size", "2", "--micro-batch", "16",
         "--steps", "4", "--dataset-size", "256", "--out", str(out),
         "--ds-override", '{"tensorboard": {"enabled": true, "job_name": "tb"}, '
                          '"csv_monitor": {"enabled": true, "job_name": "csv"}}'],
        cwd=REPO, capture_output=True, text=True, timeout=500)
    assert result.returncode == 0, result.stderr[-3000:]
    live = _scalars(out / "monitor" / "tb")  # written by DeepSpeed's monitor on rank 0, during the run
    losses = [r["loss"] for r in _steps(out, 0)]
    assert [v for _, v in live["labkit/loss"]] == pytest.approx(losses)
    assert "Train/Samples/lr" in live  # DeepSpeed's own event, next to labkit's
    assert (out / "monitor" / "csv" / "labkit_step_time_s.csv").is_file()

    exported = tmp_path / "tb"
    result = subprocess.run([sys.executable, "-m", "labkit", "export-metrics", str(out), "--tensorboard",
                             str(exported), "--csv", str(tmp_path / "csv")], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        scalars = _scalars(exported / f"rank{rank}")
        steps = _steps(out, rank)
        assert scalars["labkit/loss"] == [(r["step"], pytest.approx(r["loss"])) for r in steps]
        assert "labkit/rss_bytes" in scalars
        rows = (tmp_path / "csv" / f"rank{rank}.csv").read_text().splitlines()
        assert rows[0].startswith("step,") and len(rows) == 1 + len(steps)


def test_monitor_keys_are_checked_by_deepspeeds_own_model():
    RunConfig(ds_overrides={"tensorboard": {"enabled": True}, "wandb": {"enabled": False}, "comet": {}})
    with pytest.raises(ConfigError, match="tensorboard"):
        RunConfig(ds_overrides={"tensorboard": {"enabled": True, "no_such_option": 1}})
    with pytest.raises(ConfigError, match="plain PyTorch"):
        RunConfig(example="pytorch", ds_overrides={"csv_monitor": {"enabled": True}})


# -- command line habits -----------------------------------------------------------------------------
@pytest.mark.slow
def test_runs_lists_as_csv_and_json(tmp_path):
    from labkit.launch.history import COLUMNS

    outputs = {}
    for fmt in ("csv", "json"):
        result = subprocess.run([sys.executable, "-m", "labkit", "runs", "--format", fmt, "--root", str(tmp_path)],
                                cwd=REPO, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        outputs[fmt] = result.stdout
    assert outputs["csv"].splitlines()[0].split(",")[:3] == list(COLUMNS)[:3]  # the header, even with no runs
    assert json.loads(outputs["json"]) == []


def test_answer_strict_exit_code_names_unfinished_points(capsys):
    import pandas as pd

    from labkit.study.answer import strict_exit_code

    results = pd.DataFrame([{"strategy": "z3", "global_batch": 32, "status": "finished"},
                            {"strategy": "z2", "global_batch": 512, "status": "oom"}])
    assert strict_exit_code(results, strict=True) == 1
    assert "z2 global batch 512: oom" in capsys.readouterr().err
    assert strict_exit_code(results, strict=False) == 0
    assert strict_exit_code(results[results.status == "finished"], strict=True) == 0


@pytest.mark.slow
def test_help_lists_choices_examples_and_exit_codes():
    from labkit.cli import build_parser

    text = build_parser().format_help()
    assert "exit codes:" in text and "labkit run --script train.py" in text
    # The console script pip installed beside this interpreter, as a user types it.
    labkit_script = Path(sys.executable).parent / "labkit"
    assert labkit_script.is_file(), "pip install -e . puts a `labkit` console script beside python"
    run_help = subprocess.run([str(labkit_script), "run", "--help"], cwd=REPO, capture_output=True,
                              text=True, timeout=120).stdout
    assert "{fp32,bf16,fp16}" in run_help and "--model" in run_help and "--script" in run_help
    # Every subcommand's help ends with the examples and exit codes, and every option says what it means.
    assert "exit codes:" in run_help and "labkit answer --profile ci" in run_help
    assert "RunConfig." not in run_help and re.search(r"--stop-at-target\s+end the run", run_help)
    # A model the profile has no sizes for is bad input (exit 2, named), not a traceback.
    bad = subprocess.run([str(labkit_script), "answer", "--profile", "workshop", "--model", "gpt", "--out",
                          str(REPO / "runs" / "never-written")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "error: model: 'gpt' has sizes for the profiles" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr and not (REPO / "runs" / "never-written").exists()


def test_deepspeed_itself_checks_the_whole_config_before_launch():
    from labkit.core.ds_config import deepspeed_checked

    config = RunConfig(example="zero3", world_size=2, micro_batch=8)
    assert deepspeed_checked(config.ds_config(), 2).train_batch_size == 16
    # Refused by DeepSpeed's own checks (not a list in labkit): both precisions at once, a ZeRO field's type.
    with pytest.raises(ConfigError, match="bfloat16 and fp16"):
        RunConfig(example="zero3", ds_overrides={"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    with pytest.raises(ConfigError, match="stage3_max_live_parameters") as error:
        RunConfig(example="zero3", ds_overrides={"zero_optimization": {"stage3_max_live_parameters": "many"}})
    assert error.value.field == "ds_overrides.zero_optimization"


def test_progress_bar_names_the_phase():
    from labkit.launch.phase import run_phase

    assert run_phase(set(), 0, 20) == "starting processes"
    assert run_phase({"start"}, 0, 20).startswith("initializing")
    building = "Using envvar\nBuilding extension module cpu_adam...\nninja: ..."
    assert run_phase({"start"}, 0, 20, building).startswith("building ops")
    assert run_phase({"start"}, 0, 20, building + "\nLoading extension module cpu_adam...").startswith("initializing")
    assert run_phase({"start", "ready"}, 0, 20) == "first step"
    assert run_phase({"start", "ready", "step"}, 7, 20) == "step 7/20"
    # Script mode: no ready record; the guard's memory samples say the script is alive.
    assert run_phase({"start"}, 0, 20, script=True) == "script starting"
    assert run_phase({"start", "sample"}, 0, 20, script=True).startswith("script running")
    assert run_phase({"start", "sample"}, 0, 20, building, script=True).startswith("building ops")

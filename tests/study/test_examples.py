"""The corrected examples (notebooks/examples/) and what sets them beside the source text (labkit.study.examples).

The fast tests check the line-by-line comparison and the DeepSpeed configs; the slow ones run each
script for real, once: Example 3 on 2 ranks with the command a learner types, Example 2 (ZeRO-Offload)
on 1 rank, Example 1 under labkit and plainly with python.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from labkit import Run, RunConfig
from labkit.study import examples, lessons
from tests.conftest import run_together

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "notebooks" / "examples"


# -- the comparison ------------------------------------------------------------------------
def test_a_changed_line_is_paired_with_its_correction_and_unrelated_lines_are_not():
    text = "import torch\n\nx = load(64)\ny = f(x)\nprint(y)\n"
    script = "import torch\n\nx = load(batch)\nlabkit.record(step=1)\ny = f(x)\nprint(y)\n"
    diff = examples.compare(text, script, [("labkit", "one line per step"), ("load", "the batch is an argument")])
    changes = [([line for _, line in b.text], [line for _, line in b.script], b.reason) for b in diff.changes]
    assert changes == [(["x = load(64)"], ["x = load(batch)"], "the batch is an argument"),
                       ([], ["labkit.record(step=1)"], "one line per step")]
    assert diff.unexplained == []


def test_a_change_without_a_reason_is_listed_and_the_first_matching_reason_wins():
    diff = examples.compare("a = 1\nb = 2\n", "a = 1\nb = 3\nc = 4\n",
                            [("b = ", "first"), ("b = 3", "second")])
    assert [b.reason for b in diff.changes] == ["first", None]  # "c = 4" is unlike "b = 2": a row of its own
    assert diff.unexplained == ["+ c = 4"]


def test_indentation_blank_lines_and_comment_only_pairing():
    text = "def f():\n   return 1\n\n\nvalue = 2\n"
    script = "def f():\n    return 1\nvalue = 2\n"
    assert examples.compare(text, script, []).changes == []  # 3 vs 4 spaces and blank lines are no change


def test_unchanged_runs_are_elided_and_imports_shown_as_one_change():
    same = "".join(f"line_{i} = {i}\n" for i in range(10))
    diff = examples.compare("import os\nimport torch\nfrom x import y\n" + same,
                            "import argparse\nimport torch\nfrom x import z\n" + same, [])
    assert len(diff.changes) == 1  # the imports around an unchanged one read as one change
    assert [line for _, line in diff.changes[0].script] == ["import argparse", "import torch", "from x import z"]
    html = diff._repr_html_()
    assert "8 more lines, the same on both sides" in html and "(no reason given)" in html


@pytest.mark.parametrize("number", [1, 2, 3])
def test_every_change_to_each_example_has_its_reason(number):
    diff = examples.side_by_side(number)
    assert diff.changes and diff.unexplained == []
    shown = diff._repr_html_()
    assert "examples/" + examples.SCRIPTS[number] in shown and "<code>" in shown


def test_the_source_text_holds_three_examples_verbatim():
    assert "config_params=config" in examples.source_code(2)
    assert '"stage": 1, # ZeRO stage 1, which is equivalent to ZeRO-Offload' in examples.source_code(2)
    assert "import os" in examples.source_code(3)
    with pytest.raises(ValueError, match="Examples 1-3"):
        examples.source_code(4)


# -- the DeepSpeed configs -----------------------------------------------------------------
@pytest.mark.parametrize("name", ["ex2_ds_config.json", "ex3_ds_config.json"])
@pytest.mark.parametrize("ranks", [1, 2, 8])
def test_deepspeed_accepts_the_corrected_configs_on_any_number_of_ranks(name, ranks):
    config = json.loads((EXAMPLES / name).read_text())
    assert "train_batch_size" not in config  # derived: micro x accumulation x ranks
    assert config["optimizer"]["params"]["weight_decay"] == 0  # the same update whichever Adam DeepSpeed picks
    verdict = lessons.deepspeed_batch_check(config, ranks)
    assert verdict.startswith("DeepSpeed accepts"), verdict
    assert f"train_batch_size {64 * ranks} = micro 64 x accumulation 1 x {ranks} rank(s)" in verdict


def test_example2_is_stage2_with_the_optimizer_offloaded_and_example3_is_stage3():
    offload = json.loads((EXAMPLES / "ex2_ds_config.json").read_text())["zero_optimization"]
    assert offload["stage"] == 2 and offload["offload_optimizer"]["device"] == "cpu"
    assert json.loads((EXAMPLES / "ex3_ds_config.json").read_text())["zero_optimization"] == {"stage": 3}


def test_script_config_is_the_command_a_learner_types(tmp_path):
    with pytest.raises(ValueError, match=re.escape("args is a list of arguments, e.g. ['--hidden', '64'], got the "
                                                   "string '--hidden 64'")):  # was passed letter by letter
        examples.script_config("ex3_zero3.py", world_size=2, steps=20, args="--hidden 64")
    config = examples.script_config("ex3_zero3.py", world_size=2, steps=20, args=["--hidden", "64"])
    assert config.script == str(EXAMPLES / "ex3_zero3.py") and config.world_size == 2 and config.steps == 20
    assert examples.command_line(config) == ("labkit run --script notebooks/examples/ex3_zero3.py --world-size 2 "
                                             "--steps 20 -- --hidden 64 --steps 20")
    variant = examples.config_variant("ex3_ds_config.json", tmp_path, bf16={"enabled": True})
    assert json.loads(variant.read_text())["bf16"] == {"enabled": True}
    assert json.loads((EXAMPLES / "ex3_ds_config.json").read_text())["bf16"] == {"enabled": False}  # untouched


def test_script_twin_trains_what_the_script_would(tmp_path):
    """The twin reads the script's arguments and the DeepSpeed config it would load (the committed one, or the
    copy --deepspeed_config names)."""
    plain = examples.script_twin(examples.script_config("ex3_zero3.py", world_size=2, steps=8))
    assert (plain.example, plain.stage, plain.precision, plain.micro_batch, plain.grad_accum) == (
        "zero3", 3, "fp32", 64, 1)
    assert (plain.hidden, plain.depth, plain.dataset_size, plain.world_size, plain.steps) == (500, 1, 1000, 2, 8)
    variant = examples.config_variant("ex3_ds_config.json", tmp_path, bf16={"enabled": True},
                                      gradient_accumulation_steps=2)
    sized = examples.script_twin(examples.script_config("ex3_zero3.py", world_size=1, steps=4, args=[
        "--hidden", "256", "--depth", "3", "--num-samples", "4096", "--deepspeed_config", str(variant)]))
    assert (sized.precision, sized.grad_accum, sized.hidden, sized.depth, sized.dataset_size) == (
        "bf16", 2, 256, 3, 4096)
    assert plain.optimizer == sized.optimizer == "adam"
    for params, held in (({"lr": 0.01}, "sgd"), ({"lr": 0.01, "momentum": 0.9}, "adam")):  # momentum: a state
        sgd = examples.config_variant("ex3_ds_config.json", tmp_path / held,
                                      optimizer={"type": "SGD", "params": params})
        twin = examples.script_twin(examples.script_config("ex3_zero3.py", world_size=1, steps=4,
                                                           args=["--deepspeed_config", str(sgd)]))
        assert twin.optimizer == held
    offload = examples.script_twin(examples.script_config("ex2_zero_offload.py", world_size=1, steps=4))
    assert (offload.example, offload.stage, offload.offload_optimizer) == ("offload", 2, True)
    pytorch = examples.script_twin(examples.script_config("ex1_pytorch.py", world_size=1, steps=4,
                                                          args=["--batch-size", "128"]))
    assert (pytorch.example, pytorch.micro_batch) == ("pytorch", 128)
    with pytest.raises(ValueError, match="no twin for script"):
        examples.script_twin(RunConfig(script=str(EXAMPLES / "simple_model.py")))


@pytest.mark.parametrize("name", sorted(examples.SCRIPTS.values()))
def test_script_defaults_are_the_scripts_own(name):
    source = (EXAMPLES / name).read_text()
    for option, default in examples.SCRIPT_DEFAULTS.items():
        declared = re.search(rf'add_argument\("--{option}", type=int, default=(\d+)', source)
        if declared:  # Example 1 has --batch-size, the DeepSpeed scripts take it from their config
            assert int(declared[1]) == default, (name, option)
        else:
            assert option == "batch-size" and name in examples.SCRIPT_DS_CONFIGS, (name, option)


# -- real runs (one per script) --------------------------------------------------------------
def _steps(run_dir: Path, rank: int) -> list[int]:
    lines = (run_dir / f"rank{rank}.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if r.get("event") == "step"]


@pytest.fixture(scope="module")
def example_runs(tmp_path_factory) -> dict:
    """The three examples' runs, started together and awaited: Example 3 as the README types it (the CLI from the
    repository's root, the run store redirected, not the command), Examples 2 and 1 under labkit, and Example 1
    plainly with python in an empty directory (no launcher, no --local_rank, no LABKIT_RUN_DIR)."""
    root = tmp_path_factory.mktemp("examples")
    ex2 = Run(examples.script_config("ex2_zero_offload.py", world_size=1, steps=8), root=root / "ex2").start()
    ex1 = Run(examples.script_config("ex1_pytorch.py", world_size=1, steps=30), root=root / "ex1").start()
    (root / "elsewhere").mkdir()
    done = run_together({
        "ex3": dict(args=[str(Path(sys.executable).parent / "labkit"), "run", "--script",
                          "notebooks/examples/ex3_zero3.py", "--world-size", "2", "--", "--steps", "20"],
                    cwd=REPO, env={**os.environ, "LABKIT_RUNS_DIR": str(root / "ex3")}),
        "plain": dict(args=[sys.executable, str(EXAMPLES / "ex1_pytorch.py"), "--steps", "15"], cwd=root / "elsewhere",
                      env={k: v for k, v in os.environ.items() if k != "LABKIT_RUN_DIR"}),
    }, timeout=600)
    ex2.wait(timeout=600)
    ex1.wait(timeout=600)
    return {"ex3": (done["ex3"], root / "ex3"), "ex2": ex2, "ex1": ex1, "plain": (done["plain"], root / "elsewhere")}


@pytest.mark.slow
def test_example3_runs_on_two_ranks_as_written_from_the_repo_root(example_runs):
    result, store = example_runs["ex3"]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (run_dir,) = store.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["mode"] == "script"
    for rank in (0, 1):
        assert _steps(run_dir, rank) == list(range(1, 21))  # one labkit.record per optimizer step
    run = Run.load(run_dir)
    log = lessons.rank_log_text(run)
    assert "2 rank(s), global batch 128, 7 steps per epoch" in log  # DistributedSampler: 1000 // 2 // 64
    losses = examples.epoch_losses(run)
    assert list(losses["step"]) == [7, 14, 20]
    assert losses["held-out loss"].iloc[-1] < losses["held-out loss"].iloc[0]  # the teacher's labels are learnt


@pytest.mark.slow
def test_example2_offloads_to_deepspeeds_cpu_adam_on_one_rank(example_runs):
    run = example_runs["ex2"]
    assert run.status == "finished", run.cause
    assert _steps(run.run_dir, 0) == list(range(1, 9))
    assert re.search(r"1 rank\(s\), global batch 64, 15 steps per epoch, optimizer DeepSpeedCPUAdam",
                     lessons.rank_log_text(run))


@pytest.mark.slow
def test_example1_runs_under_labkit_and_plainly_with_python(example_runs):
    run = example_runs["ex1"]
    assert run.status == "finished", run.cause
    assert _steps(run.run_dir, 0) == list(range(1, 31))
    losses = examples.epoch_losses(run)
    assert list(losses["step"]) == [15, 30] and losses["held-out loss"].is_monotonic_decreasing
    # Plainly: no launcher, no --local_rank, and labkit.record a no-op (nothing written anywhere).
    plain, elsewhere = example_runs["plain"]
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert re.fullmatch(r"Epoch 1, step 15: training loss [\d.]+, held-out loss [\d.]+\n", plain.stdout)
    assert list(elsewhere.iterdir()) == []

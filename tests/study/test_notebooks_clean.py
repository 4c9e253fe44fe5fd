"""Every notebook is committed clean and follows the lesson template.

Clean: no outputs and no execution counts (results belong to the machine that ran them, and
diffs stay readable). Template: a Jupyter kernelspec, exactly one cell tagged `parameters`
(papermill injects its values after it), and a first markdown cell opening with "What you'll
do", "What you'll learn" and "What you'll need", in that order.
Executing the notebooks is nbval's job (`pytest --nbval-lax notebooks`), not this file's.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))
KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}


def test_the_lesson_notebooks_exist():
    names = {path.name for path in NOTEBOOKS}
    for name in ("00-setup.ipynb", "01-pytorch-baseline.ipynb", "02-zero-offload.ipynb",
                 "03-zero3-multi-gpu.ipynb", "04-the-answer.ipynb", "04a-learning-rate.ipynb"):
        assert name in names


@pytest.fixture(params=NOTEBOOKS, ids=[path.name for path in NOTEBOOKS])
def notebook(request: pytest.FixtureRequest) -> nbformat.NotebookNode:
    nb = nbformat.read(request.param, as_version=4)
    nbformat.validate(nb)
    return nb


def test_no_outputs_or_execution_counts(notebook: nbformat.NotebookNode):
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"cell {index} has outputs: clear them before committing"
            assert cell.execution_count is None, f"cell {index} has an execution count"


def test_kernelspec(notebook: nbformat.NotebookNode):
    assert notebook.metadata.get("kernelspec") == KERNELSPEC


def test_exactly_one_parameters_cell(notebook: nbformat.NotebookNode):
    tagged = [cell for cell in notebook.cells if "parameters" in cell.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{len(tagged)} cells tagged 'parameters'"
    assert tagged[0].cell_type == "code"
    assert "current_profile()" in tagged[0].source, "the parameters cell must read the profile (LABKIT_PROFILE)"


def test_opens_with_what_youll_do_learn_need(notebook: nbformat.NotebookNode):
    first = notebook.cells[0]
    assert first.cell_type == "markdown"
    assert first.source.lstrip().startswith("#"), "the first cell starts with the notebook's title"
    positions = [first.source.find(f"**What you'll {word}:**") for word in ("do", "learn", "need")]
    assert all(p >= 0 for p in positions), "the opening names what you'll do, learn and need (bold, with a colon)"
    assert positions == sorted(positions), "the opening says do, learn, need in that order"


# Notebooks that teach. 04 and 05 were being reworked on other branches when this
# check came in; strict xfail makes this test fail as soon as they gain the section, so the
# mark is removed then.
_EXERCISES_PENDING: set[str] = set()


@pytest.mark.parametrize("path", [pytest.param(path, id=path.name, marks=pytest.mark.xfail(
    strict=True, reason="exercises not written yet")) if path.name in _EXERCISES_PENDING else
    pytest.param(path, id=path.name) for path in NOTEBOOKS])
def test_ends_with_exercises_each_with_a_solution_or_check(path: Path):
    last = nbformat.read(path, as_version=4).cells[-1]
    assert last.cell_type == "markdown" and "## Exercises" in last.source, "the last cell is an '## Exercises' section"
    exercises = [line for line in last.source.split("## Exercises", 1)[1].splitlines()
                 if re.match(r"\d+\. ", line)]
    assert 2 <= len(exercises) <= 4, f"{len(exercises)} exercises: 2-4 expected"
    answers = last.source.count("<details>") + last.source.count("lessons.check(")
    assert answers >= len(exercises), "each exercise has a collapsed <details> solution or a check to run"


@pytest.mark.parametrize("path", [path for path in NOTEBOOKS if path.name not in _EXERCISES_PENDING],
                         ids=lambda path: path.name)
def test_claims_are_checked_in_sight(path: Path):
    """Assertions stay (nbval needs them) but print a "Check:" line: `lessons.check`, not a bare assert."""
    notebook = nbformat.read(path, as_version=4)
    bare = [index for index, cell in enumerate(notebook.cells)
            if cell.cell_type == "code"
            and any(line.lstrip().startswith("assert ") for line in cell.source.splitlines())]
    assert not bare, f"cells {bare} assert without a visible Check: line (use lessons.check)"

"""Every notebook is committed clean and follows the lesson template.

Clean: no outputs and no execution counts (results belong to the machine that ran them, and
diffs stay readable). Template: a Jupyter kernelspec, exactly one cell tagged `parameters`
(papermill injects its values after it), and a first markdown cell opening with "What you'll
do", "What you'll learn" and "What you'll need", in that order.
Executing the notebooks is nbval's job (`pytest --nbval-lax notebooks`), not this file's.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}


def test_the_lesson_notebooks_exist():
    names = {path.name for path in NOTEBOOKS}
    for name in ("00-setup.ipynb", "01-pytorch-baseline.ipynb", "02-zero-offload.ipynb",
                 "03-zero3-multi-gpu.ipynb", "04-the-answer.ipynb"):
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

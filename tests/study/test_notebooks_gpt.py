"""Notebooks 04, 04a and 05 switch to the byte-level GPT with one parameter (`LABKIT_MODEL=gpt`).

`make test` executes every notebook on the MLP (`--nbval-lax notebooks`); this runs the three that
follow `MODEL` once more with the GPT, each in its own nbval session (the three at once), so that every check in them
(04 and 04a: the committed `data/reference-ci-gpt` read and checked cell by cell, 04a's five LR runs training the
MLP, the one model they have settings for; 05: a live GPT run) holds for the second model too.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, run_together

NOTEBOOKS = ("04-the-answer.ipynb", "04a-learning-rate.ipynb", "05-live-panel.ipynb")


@pytest.fixture(scope="module")
def gpt_sessions(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """The three nbval sessions, started together and awaited."""
    commands = {}
    for name in NOTEBOOKS:
        runs = tmp_path_factory.mktemp(name.split("-")[0]) / "runs"
        env = {**os.environ, "LABKIT_MODEL": "gpt", "LABKIT_PROFILE": "ci", "LABKIT_RUNS_DIR": str(runs)}
        env.pop("LABKIT_RESULTS_DIR", None)  # 04 must read the GPT's own committed results
        commands[name] = dict(args=[sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
                                    str(REPO / "notebooks" / name)], cwd=REPO, env=env)
    return run_together(commands, timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_on_the_gpt(name: str, gpt_sessions):
    done = gpt_sessions[name]
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout

"""Notebooks 04, 04a and 05 switch to the byte-level GPT with one parameter (`LABKIT_MODEL=gpt`).

`make test` executes every notebook on the MLP (`--nbval-lax notebooks`); this runs the three that
follow `MODEL` once more with the GPT, each in its own nbval session, so that every check in them
(04 and 04a: the committed `data/reference-ci-gpt` read and checked cell by cell, 04a's five LR runs training the
MLP, the one model they have settings for; 05: a live GPT run) holds for the second model too.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.slow
@pytest.mark.parametrize("name", ["04-the-answer.ipynb", "04a-learning-rate.ipynb", "05-live-panel.ipynb"])
def test_notebook_runs_on_the_gpt(name: str, tmp_path):
    env = {**os.environ, "LABKIT_MODEL": "gpt", "LABKIT_PROFILE": "ci", "LABKIT_RUNS_DIR": str(tmp_path / "runs")}
    env.pop("LABKIT_RESULTS_DIR", None)  # 04 must read the GPT's own committed results
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
                           str(REPO / "notebooks" / name)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout

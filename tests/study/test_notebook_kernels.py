"""A notebook's kernel that dies before its first reply is started once more, and only once (conftest.py at the
repository root, `retrying_kernel_start`): real nbval sessions on a kernel spec whose kernel exits at start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from conftest import KERNEL_STARTS
from tests.conftest import REPO

# A kernel that exits at its first `deaths` starts (counted in a file), then runs ipykernel as usual.
KERNEL = """\
import os, pathlib, sys
starts = pathlib.Path(sys.argv[1])
with starts.open("a") as f:
    f.write("start\\n")
if len(starts.read_text().splitlines()) <= int(sys.argv[2]):
    sys.stderr.write("this kernel exits at start on purpose\\n")
    sys.exit(3)
os.execv(sys.executable, [sys.executable, "-m", "ipykernel_launcher", "-f", sys.argv[3]])
"""


def nbval_session(tmp_path: Path, deaths: int) -> tuple[subprocess.CompletedProcess, int]:
    spec = tmp_path / "jupyter" / "kernels" / "exits-at-start"
    spec.mkdir(parents=True)
    (tmp_path / "kernel.py").write_text(KERNEL)
    starts = tmp_path / "starts"
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, str(tmp_path / "kernel.py"), str(starts), str(deaths), "{connection_file}"],
        "display_name": "exits at start", "language": "python"}))
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("assert 1 + 1 == 2")])
    nbformat.write(notebook, tmp_path / "one-cell.ipynb")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest", "--nbval-lax",
         "--nbval-kernel-name", "exits-at-start", str(tmp_path / "one-cell.ipynb")],
        cwd=REPO, env={**os.environ, "JUPYTER_PATH": str(tmp_path / "jupyter")},
        capture_output=True, text=True, timeout=300)
    return done, len(starts.read_text().splitlines())


@pytest.mark.slow
def test_a_kernel_that_dies_at_start_is_started_once_more_and_says_why(tmp_path: Path):
    done, starts = nbval_session(tmp_path, deaths=1)
    assert done.returncode == 0, done.stdout[-3000:]
    assert starts == 2
    assert "died before its first reply" in done.stdout
    assert "this kernel exits at start on purpose" in done.stdout  # the dead kernel's stderr, kept


@pytest.mark.slow
def test_a_kernel_that_keeps_dying_fails_the_notebook_after_the_last_start(tmp_path: Path):
    done, starts = nbval_session(tmp_path, deaths=KERNEL_STARTS)
    assert done.returncode != 0
    assert starts == KERNEL_STARTS
    assert f"died before its first reply {KERNEL_STARTS} times" in done.stdout
    assert "this kernel exits at start on purpose" in done.stdout  # the last dead kernel's stderr too

"""pyproject.toml is the single source of versions; environment.yml must agree with it."""

from __future__ import annotations

import re
import subprocess
import tomllib

import pytest

from tests.conftest import REPO


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ]", requirement, maxsplit=1)[0].lower()


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        wanted += extra
    pinned = {_name(r): r.replace(" ", "") for r in wanted}
    listed = {}
    for line in (REPO / "environment.yml").read_text().splitlines():
        match = re.match(r"\s+- ([A-Za-z0-9_.\-\[\]]+\s*[<>=!~]=?.*)$", line)
        if match and not line.strip().startswith("- python") and line.strip()[2:] != "pip":
            listed[_name(match.group(1))] = match.group(1).replace(" ", "")
    assert listed == pinned


def test_torch_is_a_range_and_the_tested_versions_are_constraints():
    """A torch range, so NGC and cloud images keep their CUDA torch; the tested pins in constraints.txt."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    torch = next(d for d in deps if _name(d) == "torch")
    assert ">=" in torch and "==" not in torch
    assert any(d.startswith("deepspeed==0.19.") for d in deps)
    pins = (REPO / "constraints.txt").read_text().split()
    assert "torch==2.13.0" in pins and any(p.startswith("deepspeed==0.19.") for p in pins)
    assert "constraints.txt" in (REPO / "Makefile").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("goal,variables,message", [
    ("gpu-reference", ["STEP=bogus"], "STEP=bogus: must be check, notebooks, answer or all"),
    ("gpu-reference", ["JOBS=0"], "JOBS=0: must be a number of notebooks at once, 1 or more"),  # was taken as 1
    ("gpu-reference", ["JOBS=abc"], "JOBS=abc: must be"),
    ("test", ["TEST_WORKERS=abc"], "TEST_WORKERS=abc: must be a number of pytest-xdist workers"),
    ("test", ["TEST_WORKERS=-3"], "TEST_WORKERS=-3: must be"),  # xdist took it
    ("lab", ["LAB_PORT=abc"], "LAB_PORT=abc: must be a TCP port, 1 to 65535"),
    ("lab", ["LAB_PORT=70000"], "LAB_PORT=70000: must be a TCP port"),
    ("wheelhouse", ["NODE_PACKAGES=typo"], "NODE_PACKAGES=typo: no such readable file"),
    ("wheelhouse", ["WHEEL_PYTHON=abc"], "WHEEL_PYTHON=abc: must be the node's CPython as major.minor"),
])
def test_make_refuses_a_bad_variable_before_any_prerequisite_runs(goal, variables, message):
    """Checked as make reads the Makefile: before `install`, `ops` (op builds of 30-90 s) and `lint` (minutes)
    ran only for the tool at the end to refuse it. `-n`: nothing runs even if the check were missing."""
    done = subprocess.run(["make", "-n", "--no-print-directory", goal, *variables], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert done.stdout == "", done.stdout  # not one prerequisite's command


@pytest.mark.slow
@pytest.mark.parametrize("goal,variables", [
    *(("gpu-reference", [f"STEP={step}", "JOBS=3"]) for step in ("check", "notebooks", "answer", "all")),
    ("test", ["TEST_WORKERS=0"]), ("test", ["TEST_WORKERS=auto"]), ("lab", ["LAB_PORT=8889"]),
    ("wheelhouse", ["WHEEL_PYTHON=3.12", "NODE_PACKAGES=constraints.txt"]),
    ("wheelhouse-proof", []),  # its sub-make's NODE_PACKAGES is written by its earlier lines, which -n skips
])
def test_make_takes_the_variables_good_values(goal, variables):
    from labkit.study.gpu_reference import STEPS

    assert set(STEPS) == {"check", "notebooks", "answer"}  # the Makefile's STEP check lists them
    done = subprocess.run(["make", "-n", "--no-print-directory", goal, *variables], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr

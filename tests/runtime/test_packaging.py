"""pyproject.toml is the single source of versions; environment.yml must agree with it."""

from __future__ import annotations

import re
import tomllib

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

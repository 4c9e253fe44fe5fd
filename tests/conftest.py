"""Shared fixtures: real runs write into a per-test directory, and no process may outlive a test."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))


@pytest.fixture
def runs_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "runs"
    monkeypatch.setenv("LABKIT_RUNS_DIR", str(root))
    return root


def run_processes(run_dir: Path) -> list[psutil.Process]:
    """Every live process whose command line names this run directory."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and str(run_dir) in " ".join(proc.info["cmdline"] or []):
                found.append(proc)
        except psutil.Error:
            continue
    return found

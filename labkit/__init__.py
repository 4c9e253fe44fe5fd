"""DeepSpeed Batch Lab: launch real DeepSpeed runs, watch every rank, keep what they recorded."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from labkit.core.config import ConfigError, RunConfig
    from labkit.launch.history import load_run, runs
    from labkit.launch.run import Run
    from labkit.rank.script import record

__all__ = ["ConfigError", "Run", "RunConfig", "load_run", "record", "runs"]

# Imported on first use (PEP 562): every rank imports `labkit`, and `import labkit.rank.worker` must load nothing of
# the parent side (launch), the widgets (ui) or the studies; nor does a rank need pandas (the run history).
_PUBLIC = {
    "ConfigError": "labkit.core.config",
    "RunConfig": "labkit.core.config",
    "Run": "labkit.launch.run",
    "record": "labkit.rank.script",
    "runs": "labkit.launch.history",
    "load_run": "labkit.launch.history",
}


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")

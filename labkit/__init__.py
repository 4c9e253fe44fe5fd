"""DeepSpeed Batch Lab: launch real DeepSpeed runs, watch every rank, keep what they recorded."""

from labkit.config import ConfigError, RunConfig
from labkit.history import load_run, runs
from labkit.run import Run

__all__ = ["ConfigError", "Run", "RunConfig", "load_run", "runs"]

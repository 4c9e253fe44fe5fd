"""DeepSpeed Batch Lab: launch real DeepSpeed runs, watch every rank, keep what they recorded."""

from labkit.launch.config import ConfigError, RunConfig
from labkit.launch.run import Run
from labkit.launch.script import record

__all__ = ["ConfigError", "Run", "RunConfig", "load_run", "record", "runs"]


def __getattr__(name: str):
    # pandas is imported on first use only: every rank, guard and supervisor imports labkit,
    # and none of them needs the run history.
    if name in ("runs", "load_run"):
        from labkit.launch import history

        return getattr(history, name)
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")

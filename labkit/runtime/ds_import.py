"""DeepSpeed's first import, once per process, under one lock.

DeepSpeed's package has circular imports (`deepspeed.runtime.zero` <-> `deepspeed.runtime.engine`).
Imported for the first time from several threads at once (a sweep's thread pool, the test suite's,
a kernel whose first `RunConfig` is made in a widget's thread), Python's per-module import locks
deadlock (`_DeadlockError`) and every later import in that process fails with "partially initialized
module". Every labkit entry that imports DeepSpeed calls `import_deepspeed()` first: one thread
imports the whole package, the others wait, and later imports find it in `sys.modules`.
"""

from __future__ import annotations

import threading

_LOCK = threading.Lock()


def import_deepspeed() -> None:
    """Import DeepSpeed and the submodules labkit uses, fully, before any other thread touches them."""
    if _imported:
        return
    with _LOCK:
        if _imported:
            return
        # Imported for the side effect: each module lands in sys.modules. All five bind the one name
        # `deepspeed`, so only the last counts as unused.
        import deepspeed  # (imports deepspeed.runtime.engine and, through it, runtime.zero)
        import deepspeed.accelerator
        import deepspeed.runtime.zero.config
        import deepspeed.runtime.zero.stage3
        import deepspeed.runtime.zero.stage_1_and_2  # noqa: F401 -- imported for the side effect (above)
        _imported.append(True)


_imported: list[bool] = []

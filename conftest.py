"""Settings for everything pytest collects here, notebooks included (tests/conftest.py serves tests/ only)."""

from __future__ import annotations

import tempfile
import warnings

# nbval waits a hard-coded 5 s for each output message once a cell has replied. In CI, on the 2-core
# machine, one came later than that (notebook 04's cell that launches five DeepSpeed runs, while
# other tests ran): a failure that says nothing about the notebook.
NBVAL_OUTPUT_TIMEOUT_S = 120

# A notebook's kernel that dies before its first reply is started once more, on new ports. jupyter_client picks a
# kernel's TCP ports by binding and releasing them before the kernel binds them, so another process (a DeepSpeed
# run's gloo sockets, another kernel starting) can take one in between and the kernel exits before any cell runs
# (jupyter/jupyter_client#276, whose maintainers suggest this restart): a failure that says nothing about the
# notebook (once in 17 fresh-clone CI runs).
KERNEL_STARTS = 2


def pytest_collection_modifyitems(items) -> None:
    import pytest

    for item in items:
        if type(item).__name__ == "IPyNbCell":
            item.output_timeout = NBVAL_OUTPUT_TIMEOUT_S
            item.add_marker(pytest.mark.slow)  # a notebook runs in a kernel, its own process


def pytest_configure(config) -> None:
    try:
        from nbval import kernel
    except ImportError:  # nbval is a test extra
        return
    if not getattr(kernel.start_new_kernel, "labkit_retries", False):
        kernel.start_new_kernel = retrying_kernel_start(kernel.start_new_kernel)


def retrying_kernel_start(start):
    """nbval's `start_new_kernel`, tried up to KERNEL_STARTS times while the kernel dies before its first reply;
    each dead kernel's stderr (which nbval discards) is kept to say why."""

    def start_new_kernel(*args, **kwargs):
        discarded = kwargs.pop("stderr", None)  # nbval's own os.devnull handle
        if discarded is not None:
            discarded.close()
        for attempt in range(1, KERNEL_STARTS + 1):
            # A file the kernel keeps writing to after ours is closed: what a kernel writes to its own stderr (not
            # its cells' output) for the rest of its life, freed when it exits.
            with tempfile.TemporaryFile(mode="w+") as stderr:
                try:
                    return start(*args, **{**kwargs, "stderr": stderr})
                except RuntimeError as error:
                    if "died before replying" not in str(error):
                        raise
                    stderr.seek(0)
                    why = f"{error}; its stderr: {stderr.read()[-2000:].strip() or '(empty)'}"
                    if attempt == KERNEL_STARTS:
                        raise RuntimeError(f"a Jupyter kernel died before its first reply {attempt} times: {why}") \
                            from error
                    warnings.warn(f"a Jupyter kernel died before its first reply ({why}); starting a new one",
                                  stacklevel=2)
        raise AssertionError("unreachable")

    start_new_kernel.labkit_retries = True  # type: ignore[attr-defined]
    return start_new_kernel

"""Settings for everything pytest collects here, notebooks included (tests/conftest.py serves tests/ only)."""

from __future__ import annotations

# nbval waits a hard-coded 5 s for each output message once a cell has replied. In CI, on the 2-core
# machine, one came later than that (notebook 04's cell that launches five DeepSpeed runs, while
# other tests ran): a failure that says nothing about the notebook.
NBVAL_OUTPUT_TIMEOUT_S = 120


def pytest_collection_modifyitems(items) -> None:
    import pytest

    for item in items:
        if type(item).__name__ == "IPyNbCell":
            item.output_timeout = NBVAL_OUTPUT_TIMEOUT_S
            item.add_marker(pytest.mark.slow)  # a notebook runs in a kernel, its own process

"""Browser-test configuration: registers the ``browser`` marker (also listed in pyproject; re-adding is harmless)."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "browser: drives JupyterLab in headless Chromium")

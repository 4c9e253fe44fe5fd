"""Browser-test configuration: the ``browser`` marker and the ``chromium`` fixture.

Without Playwright or a Chromium the browser tests skip, unless LABKIT_BROWSER_REQUIRED is set
(CI sets it): then they fail, so a CI run can never pass with the browser tests silently skipped.
"""

from __future__ import annotations

import os

import pytest

from . import harness


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "browser: drives JupyterLab in headless Chromium")


def browser_required() -> bool:
    return os.environ.get("LABKIT_BROWSER_REQUIRED", "") not in ("", "0")


@pytest.fixture
def chromium() -> str:
    """The Chromium the harness will drive; skips (or fails, if required) when there is none."""

    def unavailable(reason: str):
        if browser_required():
            pytest.fail(f"{reason} (LABKIT_BROWSER_REQUIRED is set)", pytrace=False)
        pytest.skip(f"{reason} (set LABKIT_BROWSER_REQUIRED=1 to fail instead)")

    try:
        import playwright.sync_api  # noqa: F401
    except ImportError as exc:
        unavailable(f"Playwright is not importable: {exc}")
    try:
        return harness.chromium_executable()
    except harness.BrowserUnavailable as exc:
        unavailable(str(exc))

"""Smoke test of the browser harness: a FigureWidget filled from a background thread, seen by Chromium."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
import pytest

from . import harness

ARTIFACTS = Path(__file__).parent / "artifacts"  # gitignored (tests/browser/artifacts/)

SETUP_CELL = """\
import sys, threading, time
import numpy as np
import ipywidgets as W
import plotly.graph_objects as go
"""

# The worker appends a point twice per second for ~3 s, then says "finished".
# batch_update with whole numpy arrays; NOT hold_sync(), which silently drops FigureWidget updates.
WIDGET_CELL = """\
fig = go.FigureWidget(data=[go.Scatter(x=[], y=[], mode="lines+markers", name="loss")])
go_button = W.Button(description="Go")
status = W.Label(value="idle")
kernel = W.Label(value="kernel: " + sys.executable)
UPDATE_CHART = {update_chart}

def worker():
    xs, ys = [], []
    for step in range(6):
        xs.append(step)
        ys.append(float(np.exp(-step / 3)))
        if UPDATE_CHART:
            with fig.batch_update():
                fig.data[0].x = np.array(xs)
                fig.data[0].y = np.array(ys)
        time.sleep(0.5)
    status.value = "finished"

go_button.on_click(lambda _: threading.Thread(target=worker, daemon=True).start())
W.VBox([go_button, status, kernel, fig])
"""


def write_notebook(path: Path, update_chart: bool = True) -> None:
    nb = nbformat.v4.new_notebook()
    # Without a kernelspec JupyterLab would ask for a kernel (the harness also auto-starts the default).
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nb.cells = [
        nbformat.v4.new_code_cell(SETUP_CELL),
        nbformat.v4.new_code_cell(WIDGET_CELL.format(update_chart=update_chart)),
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


def run_smoke(root: Path, update_chart: bool = True, screenshot_name: str = "smoke.png") -> None:
    write_notebook(root / "notebooks" / "smoke.ipynb", update_chart=update_chart)
    with harness.jupyter_lab(root) as lab, harness.browser_page(
        lab, "notebooks/smoke.ipynb", failure_screenshot=ARTIFACTS / f"failure-{screenshot_name}"
    ) as page:
        harness.run_all_cells(page, timeout_s=120)
        # The kernel is the interpreter running the tests (the venv), not some other python3.
        assert f"kernel: {sys.executable}" in harness.widget_texts(page)
        harness.wait_for_charts(page, 1)
        assert harness.plotly_traces(page) == [[
            {"name": "loss", "type": "scatter", "n_points": 0, "length": 0, "x_len": 0, "y_len": 0}
        ]]  # fmt: skip

        harness.click_button(page, "Go")
        harness.wait_for_text(page, "finished", timeout_s=60, exact=True)
        # plotly redraws asynchronously after the last update: allow a moment, then check.
        harness.wait_for_points(page, min_points=5, timeout_s=10)
        charts = harness.plotly_traces(page, with_values=True)
        assert len(charts) == 1 and len(charts[0]) == 1, charts
        trace = charts[0][0]
        assert trace["name"] == "loss"
        assert trace["n_points"] >= 5, trace
        assert trace["x"][:3] == [0, 1, 2], trace
        harness.screenshot(page, ARTIFACTS / screenshot_name, scroll_to=".js-plotly-plot")


@pytest.mark.slow
@pytest.mark.browser
def test_figurewidget_fills_from_background_thread(tmp_path: Path, chromium: str) -> None:
    t0 = time.monotonic()
    run_smoke(tmp_path)
    print(f"browser smoke test: {time.monotonic() - t0:.1f}s")
    assert (ARTIFACTS / "smoke.png").stat().st_size > 10_000

"""End to end in a real browser: notebook 05's panel launches a real 2-rank DeepSpeed run, the live
charts fill with every rank's points, a second run is stopped and leaves no process, past runs overlay.

Screenshots: tests/browser/artifacts/panel.png (after the first run) and panel-compare.png (overlay).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from labkit.dashboard import overlay_label
from tests.conftest import REPO, run_processes

from . import harness

ARTIFACTS = Path(__file__).parent / "artifacts"  # gitignored
NOTEBOOK = "notebooks/05-live-panel.ipynb"
RUN_TIMEOUT_S = 600  # process start + DeepSpeed init take 10 s on an idle machine, minutes on a busy one


def rank_traces(chart: list[dict], rank: int) -> list[dict]:
    """The traces of one rank in a chart ("rank 0", "rank 0 RSS", "rank 0 peak RSS", ...)."""
    return [t for t in chart if t["name"] == f"rank {rank}" or t["name"].startswith(f"rank {rank} ")]


def status_text(page) -> str:
    return next((t for t in harness.widget_texts(page) if t.startswith("status:")), "")


def charts_filled(page, steps: int) -> bool:
    charts = harness.plotly_traces(page)
    return len(charts) >= 2 and all(
        traces and all(t["n_points"] == steps for t in traces)
        for chart in charts[:2] for traces in (rank_traces(chart, 0), rank_traces(chart, 1)))


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.25)


@pytest.mark.browser
def test_panel_launches_plots_stops_and_compares(tmp_path: Path) -> None:
    pytest.importorskip("playwright.sync_api")
    if harness.chromium_executable() is None and not os.environ.get("LABKIT_BROWSER_REQUIRED"):
        pytest.skip("no Chromium at $LABKIT_CHROMIUM or /usr/bin/chromium (set LABKIT_BROWSER_REQUIRED=1 to fail)")
    runs_root = tmp_path / "runs"
    env = {"PYTHONPATH": str(REPO), "LABKIT_RUNS_DIR": str(runs_root), "LABKIT_PROFILE": "ci"}
    t0 = time.monotonic()
    with harness.jupyter_lab(REPO, env=env) as lab:
        with harness.browser_page(lab, NOTEBOOK, viewport=(1400, 1300),
                                  failure_screenshot=ARTIFACTS / "failure-panel.png") as page:
            harness.run_all_cells(page, timeout_s=180)
            assert status_text(page) == "status: idle"
            assert [len(chart) for chart in harness.plotly_traces(page)] == [0, 0, 0, 0]  # nothing launched yet

            # -- run 1: Launch, follow it to the end ------------------------------------------
            harness.click_button(page, "Launch")
            harness.wait_for_text(page, "status: starting", timeout_s=60)
            harness.wait_kernel_idle(page, timeout_s=30)  # the charts update from a thread: the kernel is free
            harness.wait_for_text(page, "status: finished", timeout_s=RUN_TIMEOUT_S)
            finished = status_text(page)
            steps = int(re.search(r"finished (\d+)/\1 steps", finished).group(1))
            run1 = finished.rsplit(" · ", 1)[-1]
            assert (runs_root / run1 / "summary.json").is_file(), finished

            # Every rank's throughput and memory, each step plotted (plotly redraws after the last message).
            try:
                wait_until(lambda: charts_filled(page, steps), 15, "every rank's points in the charts")
            except AssertionError:
                raise AssertionError(f"charts not filled with {steps} points per rank trace: "
                                     f"{harness.plotly_traces(page)}") from None
            throughput, memory, state, loss = harness.plotly_traces(page, with_values=True)
            assert [t["name"] for t in throughput] == ["global", "rank 0", "rank 1"]
            assert throughput[0]["n_points"] == steps and min(throughput[0]["y"]) > 0
            assert all(min(t["y"]) > 0 for t in memory)  # MiB per rank (RSS on CPU, allocated + peak on GPU)
            params = next(t for t in state if t["name"] == "params")
            assert params["x"] == ["rank 0", "rank 1"] and min(params["y"]) > 0
            assert loss[0]["n_points"] == steps
            page.locator(".js-plotly-plot").first.scroll_into_view_if_needed(timeout=5000)
            harness.screenshot(page, ARTIFACTS / "panel.png")

            # -- run 2: Launch, Stop while its ranks start, no process left -------------------
            harness.click_button(page, "Launch")
            wait_until(lambda: len([p for p in runs_root.iterdir() if p.name != run1]) == 1, 60, "run 2's directory")
            run2 = next(p for p in runs_root.iterdir() if p.name != run1)
            wait_until(lambda: any("labkit.worker" in " ".join(p.cmdline()) for p in run_processes(run2)),
                       120, "run 2's ranks to start")
            harness.click_button(page, "Stop")
            harness.wait_for_text(page, "status: stopped", timeout_s=60)
            assert run2.name in status_text(page)
            # The supervisor is the last to go, right after it writes summary.json.
            deadline = time.monotonic() + 15
            while run_processes(run2) and time.monotonic() < deadline:
                time.sleep(0.25)
            assert run_processes(run2) == [], [p.cmdline() for p in run_processes(run2)]

            # -- compare: overlay run 1 from the run store -----------------------------------
            page.locator(".widget-select-multiple select").select_option(label=f"{run1} (finished)")
            harness.click_button(page, "Overlay")
            label = overlay_label(run1)
            wait_until(lambda: any(t["name"] == f"{label} · global" and t["n_points"] == steps
                                   for t in harness.plotly_traces(page)[0]), 15, "run 1's overlay")
            history = " ".join(harness.widget_texts(page, ".widget-output"))
            assert run1 in history and run2.name in history and "stopped" in history
            page.locator(".js-plotly-plot").first.scroll_into_view_if_needed(timeout=5000)
            harness.screenshot(page, ARTIFACTS / "panel-compare.png")
    print(f"panel browser test: {time.monotonic() - t0:.1f}s")
    assert (ARTIFACTS / "panel.png").stat().st_size > 10_000

"""End to end in a real browser: notebook 05's panel launches a real DeepSpeed run, the live charts fill
with every rank's points, a second (long) run is stopped and leaves no process, past runs overlay.

Screenshots: tests/browser/artifacts/panel.png (after the first run) and panel-compare.png (overlay).
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import pytest

from labkit.launch.run import FINAL_STATUSES
from labkit.ui.dashboard import overlay_label
from tests.conftest import REPO, run_processes

from . import harness

ARTIFACTS = Path(__file__).parent / "artifacts"  # gitignored
NOTEBOOK = "notebooks/05-live-panel.ipynb"
RUN_TIMEOUT_S = 600  # process start + DeepSpeed init take 10 s on an idle machine, minutes on a busy one
# A redraw after the kernel's work (reading a run back, plotting its steps): ~1 s idle; the suite's other worker
# building or training beside it made an overlay take over 15 s once (CI, 2026-11-28)
REDRAW_TIMEOUT_S = 60
LONG_STEPS = 100_000  # run 2: long enough that Stop always finds it running, on any machine
FINAL = re.compile(rf"^status: ({'|'.join(FINAL_STATUSES)})\b")


def rank_traces(chart: list[dict], rank: int) -> list[dict]:
    """The traces of one rank in a chart ("rank 0", "rank 0 RSS", "rank 0 allocated", ...)."""
    return [t for t in chart if t["name"] == f"rank {rank}" or t["name"].startswith(f"rank {rank} ")]


def status_text(page) -> str:
    return next((t for t in harness.widget_texts(page) if t.startswith("status:")), "")


def wait_until(condition, timeout_s: float, what) -> None:
    """Poll `condition`; `what` (a string or a callable giving one) says what was awaited."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what() if callable(what) else what}")
        time.sleep(0.25)


def wait_final_status(page, timeout_s: float) -> str:
    """The status line once it shows any final status (finished, stopped, failed, oom, hung)."""
    wait_until(lambda: FINAL.match(status_text(page)), timeout_s,
               lambda: f"a final status; status line now: {status_text(page)!r}")
    return status_text(page)


def chart_problems(charts: list[list[dict]], steps: int, world: int) -> list[str]:
    """What keeps the throughput, memory and loss charts from showing `steps` finite points per trace."""
    if len(charts) != 4:
        return [f"{len(charts)} charts, expected 4"]
    throughput, memory, _, loss = charts
    problems = []
    expected = ["global"] + [f"rank {rank}" for rank in range(world)]
    if [t["name"] for t in throughput] != expected:
        problems.append(f"throughput traces {[t['name'] for t in throughput]}, expected {expected}")
    for rank in range(world):
        if not rank_traces(memory, rank):
            problems.append(f"no memory trace for rank {rank} among {[t['name'] for t in memory]}")
    for chart, traces in (("throughput", throughput), ("memory", memory), ("loss", loss)):
        problems += [f"{chart} {t['name']!r}: {t['n_points']} finite points of {steps}"
                     for t in traces if t["n_points"] != steps]
    return problems


def run_dir_of(runs_root: Path, status: str) -> Path:
    """The run directory a status line names (its last " · " part)."""
    run_dir = runs_root / status.rsplit(" · ", 1)[-1]
    assert (run_dir / "config.json").is_file(), status
    return run_dir


@pytest.mark.slow
@pytest.mark.browser
def test_panel_launches_plots_stops_and_compares(tmp_path: Path, chromium: str) -> None:
    runs_root = tmp_path / "runs"
    # PYTHONPATH: the kernel, and the ranks it launches, import this checkout's labkit.
    env = {"PYTHONPATH": str(REPO), "LABKIT_RUNS_DIR": str(runs_root), "LABKIT_PROFILE": "ci"}
    t0 = time.monotonic()
    with harness.jupyter_lab(REPO, env=env) as lab, harness.browser_page(lab, NOTEBOOK, viewport=(1400, 1300),
                              failure_screenshot=ARTIFACTS / "failure-panel.png") as page:
        harness.run_all_cells(page, timeout_s=180)
        assert harness.kernel_output(page, "import labkit; print(labkit.__file__)").strip() == \
                str(REPO / "labkit" / "__init__.py")
        assert status_text(page) == "status: idle"
        harness.wait_for_charts(page, 4)
        assert [len(chart) for chart in harness.plotly_traces(page)] == [0, 0, 0, 0]  # nothing launched yet
        # Every control's label reads in full (a description wider than its box is cut with an ellipsis).
        cut = page.evaluate("() => [...document.querySelectorAll('.widget-label')].filter(e => e.offsetParent "
                            "!== null && e.scrollWidth > e.clientWidth).map(e => e.textContent)")
        assert cut == [], f"control labels cut off: {cut}"

        # -- run 1: Launch, follow it to the end ------------------------------------------
        harness.click_button(page, "Launch")
        wait_until(lambda: status_text(page) not in ("", "status: idle"), 60, "the status line to leave idle")
        harness.wait_kernel_idle(page, timeout_s=30)  # the charts update from a thread: the kernel is free
        finished = wait_final_status(page, RUN_TIMEOUT_S)
        run1 = run_dir_of(runs_root, finished)
        config = json.loads((run1 / "config.json").read_text())
        steps, world = config["steps"], config["world_size"]
        assert finished.startswith(f"status: finished {steps}/{steps} steps"), finished
        assert world >= 1 and (run1 / "summary.json").is_file()

        # Every rank's throughput and memory, each step plotted (plotly redraws after the last message).
        wait_until(lambda: not chart_problems(harness.plotly_traces(page), steps, world), REDRAW_TIMEOUT_S,
                   lambda: f"every trace filled: {chart_problems(harness.plotly_traces(page), steps, world)}")
        throughput, memory, state, loss = harness.plotly_traces(page, with_values=True)
        for trace in throughput + memory:  # samples/s; MiB per rank (RSS on CPU, allocated + peak on GPU)
            assert all(math.isfinite(v) and v > 0 for v in trace["y"]), trace
        assert all(math.isfinite(v) for v in loss[0]["y"]), loss
        params = next(t for t in state if t["name"] == "params")
        assert params["x"] == [f"rank {rank}" for rank in range(world)] and min(params["y"]) > 0, params
        page.locator(".js-plotly-plot").first.scroll_into_view_if_needed(timeout=5000)
        harness.screenshot(page, ARTIFACTS / "panel.png")

        # -- run 2: a long run, stopped while it trains; no process left -----------------
        harness.set_text_widget(page, "steps", str(LONG_STEPS))
        harness.click_button(page, "Launch")
        # Until the kernel handles the click, the status line still shows run 1's final status.
        wait_until(lambda: run1.name not in status_text(page) and (
            status_text(page).startswith("status: running step") or FINAL.match(status_text(page))),
            RUN_TIMEOUT_S, lambda: f"run 2 to train; status line now: {status_text(page)!r}")
        running = status_text(page)
        assert re.match(rf"status: running step \d+/{LONG_STEPS} · ", running), running
        run2 = run_dir_of(runs_root, running)
        assert run2 != run1 and any("labkit.rank.worker" in " ".join(p.cmdline()) for p in run_processes(run2))
        harness.click_button(page, "Stop")
        stopped = wait_final_status(page, 120)
        assert stopped.startswith("status: stopped at step") and run2.name in stopped, stopped
        assert json.loads((run2 / "summary.json").read_text())["status"] == "stopped"
        # The supervisor is the last to go, right after it writes summary.json.
        wait_until(lambda: run_processes(run2) == [], 15,
                   lambda: f"run 2's processes to end: {[p.cmdline() for p in run_processes(run2)]}")

        # -- compare: overlay run 1 from the run store -----------------------------------
        page.locator(".widget-select-multiple select").select_option(label=f"{run1.name} (finished)")
        harness.click_button(page, "Overlay")
        label = overlay_label(run1.name)
        wait_until(lambda: any(t["name"] == f"{label} · global" and t["n_points"] == steps
                               for t in harness.plotly_traces(page)[0]), REDRAW_TIMEOUT_S, "run 1's overlay")
        history = " ".join(harness.widget_texts(page, ".widget-output"))
        assert run1.name in history and run2.name in history and "stopped" in history
        page.locator(".js-plotly-plot").first.scroll_into_view_if_needed(timeout=5000)
        harness.screenshot(page, ARTIFACTS / "panel-compare.png")
    print(f"panel browser test: {time.monotonic() - t0:.1f}s; screenshots {ARTIFACTS / 'panel.png'}, "
          f"{ARTIFACTS / 'panel-compare.png'}")
    assert (ARTIFACTS / "panel.png").stat().st_size > 10_000

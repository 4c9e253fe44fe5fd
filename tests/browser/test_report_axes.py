"""report.html in a real Chromium: every chart's axis ranges fit its data.

The report is built from the committed reference results (data/reference-ci) by today's report code, opened
from disk, and each plotly chart is read back from the page (``el._fullLayout`` axes, ``el._fullData`` traces,
``layout.shapes``).  An axis passes when its range covers the data and is not more than a few spans wider: an
annotation placed in the wrong units (the LR-scaling chart's axis to 10^279) fails it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from labkit.study.report import build_report

pytestmark = pytest.mark.browser

REFERENCE = Path(__file__).resolve().parents[2] / "data" / "reference-ci"

# For each chart: {axis name: {"type", "range", "values"}}; values are the data of the traces drawn against
# the axis (bar bases added) and the positions of the shapes (vertical/horizontal lines) in data units.
_JS_AXES = """() => [...document.querySelectorAll('.js-plotly-plot')].map((el) => {
  const title = el.closest('div').parentElement.previousElementSibling?.textContent || '';
  const L = el._fullLayout, out = {};
  const axisKey = (ref) => (ref[0] === 'x' ? 'xaxis' : 'yaxis') + ref.slice(1);
  const add = (key, vals) => { if (L[key]) { (out[key] = out[key] || []).push(...vals); } };
  const nums = (a) => (a ? Array.from(a).map(Number).filter(Number.isFinite) : []);
  for (const t of el._fullData) {
    if (t.visible !== true) continue;
    add(axisKey(t.xaxis || 'x'), nums(t.x));
    let ys = nums(t.y);
    if (t.type === 'bar' && t.base !== undefined) {
      const b = Array.isArray(t.base) || ArrayBuffer.isView(t.base) ? Array.from(t.base).map(Number) : [];
      ys = ys.concat(Array.from(t.y).map((y, i) => Number(y) + (b[i] || 0)));
    }
    add(axisKey(t.yaxis || 'y'), ys);
  }
  for (const s of L.shapes || []) {
    if (/^x\\d*$/.test(s.xref)) add(axisKey(s.xref), nums([s.x0, s.x1]));
    if (/^y\\d*$/.test(s.yref)) add(axisKey(s.yref), nums([s.y0, s.y1]));
  }
  const axes = {};
  for (const key of Object.keys(L).filter((k) => /^[xy]axis\\d*$/.test(k))) {
    axes[key] = {type: L[key].type, range: L[key].range.map(Number), values: out[key] || []};
  }
  return {title, axes};
})"""


def axis_problem(axis: dict) -> str | None:
    """Why this axis range does not fit its data, or None.  Ranges of log axes are in log10 units."""
    kind, values = axis["type"], axis["values"]
    if kind not in ("linear", "log") or not values:
        return None  # category/date axes and empty axes carry no numeric claim
    if kind == "log":
        values = [math.log10(v) for v in values if v > 0]
        if not values:
            return None
    lo_range, hi_range = sorted(axis["range"])
    lo, hi = min(values), max(values)
    span = max(hi - lo, abs(hi) * 0.1, 1e-9)
    slack = 1e-6 * span
    if lo < lo_range - slack or hi > hi_range + slack:
        return f"data [{lo:.4g}, {hi:.4g}] outside the range [{lo_range:.4g}, {hi_range:.4g}]"
    if hi_range - lo_range > 3 * span:
        return f"range [{lo_range:.4g}, {hi_range:.4g}] is more than 3x the data span [{lo:.4g}, {hi:.4g}]"
    return None


def test_axis_problem_catches_a_runaway_log_axis() -> None:
    # The check itself: the broken LR chart's x axis (log10 range 0..279) against batches 32..512.
    broken = {"type": "log", "range": [0.0, 279.0], "values": [32, 64, 512]}
    assert "more than 3x" in axis_problem(broken)
    assert axis_problem({"type": "log", "range": [1.4, 2.8], "values": [32, 64, 512]}) is None
    assert "outside" in axis_problem({"type": "linear", "range": [0, 10], "values": [1, 20]})


def _reference_report(out: Path) -> Path:
    read = lambda name: pd.read_csv(REFERENCE / name) if (REFERENCE / name).is_file() else None  # noqa: E731
    machine = json.loads((REFERENCE / "machine.json").read_text())
    return build_report(read("results.csv"), out / "report.html", maxbatch=read("maxbatch.csv"),
                        probes=read("maxbatch_probes.csv"), memory=read("memory.csv"),
                        activation=read("activation.csv"), noise=read("noise.csv"), machine=machine,
                        profile={"name": machine.get("profile")})


@pytest.mark.slow
def test_every_report_chart_has_sane_axes(chromium: str, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    from .harness import CHROMIUM_ARGS

    report = _reference_report(tmp_path)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(report.as_uri())
            page.wait_for_function("() => [...document.querySelectorAll('.js-plotly-plot')].length > 0 && "
                                   "[...document.querySelectorAll('.js-plotly-plot')].every((e) => e._fullLayout)",
                                   timeout=60_000)
            charts = page.evaluate(_JS_AXES)
            page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
        finally:
            browser.close()
    assert not errors, errors
    titles = [c["title"] for c in charts]
    assert len(charts) >= 5 and any(t.startswith("LR scaling and critical batch") for t in titles), titles
    problems = [f"{c['title']} / {name}: {why}" for c in charts for name, axis in c["axes"].items()
                if (why := axis_problem(axis))]
    assert not problems, "\n".join(problems)

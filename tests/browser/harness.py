"""Drive a real JupyterLab in headless Chromium from pytest.

Typical use::

    with jupyter_lab(repo_root, env={"LABKIT_X": "1"}) as lab:
        with browser_page(lab, "notebooks/x.ipynb", failure_screenshot=art / "fail.png") as page:
            run_all_cells(page)
            click_button(page, "Launch")
            wait_for_text(page, "finished", timeout_s=300)
            charts = plotly_traces(page)      # [[{"name": ..., "n_points": <finite y values>}, ...], ...]
            screenshot(page, art / "done.png")

Design notes (the why):

* The server runs with isolated JUPYTER_{CONFIG,DATA,RUNTIME}_DIR and JUPYTERLAB_{SETTINGS,WORKSPACES}_DIR
  in a temp dir, so nothing from ~/.jupyter or ~/.local leaks in (no stray kernelspecs, no restored layouts)
  and our settings (no news toast, no autosave, no windowing, no kernel picker) always apply.
* The kernelspec ``python3`` found is the venv's (``<venv>/share/jupyter/kernels/python3``, argv[0]
  ``"python"``), and jupyter_client replaces a bare ``python`` with the server's ``sys.executable``: since
  the server is started with *this* interpreter, the kernel is this interpreter too.
* Autosave is off and checkpoints go to the temp dir, so running a repo notebook never writes to the repo.
* ``--LabApp.expose_app_in_browser`` gives ``window.jupyterapp``; we use the app's own commands and models
  (``notebook:run-all-cells``, kernel status, cell outputs) instead of brittle keyboard/menu driving.
* Kernels are started by jupyter_client in their *own* session (``start_new_session=True``), so killing the
  server's process group alone would orphan them. Shutdown is: REST ``/api/shutdown`` (graceful, stops
  kernels), then SIGTERM/SIGKILL on the server's group, then SIGKILL on every descendant seen before.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

# Playwright is imported lazily in browser_page() so that importing this module (e.g. during
# collection with `-m "not browser"`) works where Playwright is not installed.

CHROMIUM_ARGS: list[str] = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

#: Text-bearing ipywidgets: Label (``.widget-label``), HTML/HTMLMath (``.widget-html-content``),
#: slider/progress readouts. A Button is ``button.jupyter-widgets.widget-button``.
WIDGET_TEXT_SELECTOR = ".widget-label, .widget-html-content, .widget-htmlmath-content, .widget-readout"
WIDGET_BUTTON_SELECTOR = "button.jupyter-widgets.widget-button"

# JupyterLab user settings written into the isolated settings dir.
LAB_SETTINGS: dict[str, dict[str, Any]] = {
    # No "Would you like to receive official Jupyter news?" toast, no update check.
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false",
        "checkForUpdates": False,
    },
    # windowingMode "none": every cell stays in the DOM (the default virtualises off-screen cells, so a
    # chart scrolled out of view could be missing). autoStartDefaultKernel: never show the kernel picker.
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {
        "windowingMode": "none",
        "autoStartDefaultKernel": True,
    },
    # Never write outputs back into the notebook under test.
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
}


class HarnessError(RuntimeError):
    """The lab/browser did not get to the expected state."""


class CellExecutionError(HarnessError):
    """A notebook cell raised while running all cells."""


class BrowserUnavailable(HarnessError):
    """No Chromium to drive (the tests skip on it unless LABKIT_BROWSER_REQUIRED is set)."""


@dataclass
class Lab:
    """A running JupyterLab server (see :func:`jupyter_lab`)."""

    url: str  # base URL with trailing slash, e.g. "http://127.0.0.1:41234/"
    token: str
    port: int
    proc: subprocess.Popen[bytes]
    root_dir: Path
    log_path: Path
    home: Path  # isolated JUPYTER_* dirs live here
    _descendants: dict[int, psutil.Process] = field(default_factory=dict, repr=False)

    def api(self, path: str, method: str = "GET", timeout_s: float = 10.0) -> Any:
        """Call the server's REST API (``path`` like ``"api/kernels"``) and return decoded JSON."""
        req = urllib.request.Request(
            self.url + path,
            method=method,
            headers={"Authorization": f"token {self.token}"},
            data=b"" if method != "GET" else None,
        )
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            body = resp.read()
        return json.loads(body) if body else None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def remember_descendants(self) -> None:
        """Record all current descendants (kernels and whatever they spawned) for the final cleanup."""
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                self._descendants.setdefault(child.pid, child)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _write_settings(settings_dir: Path) -> None:
    for rel, data in LAB_SETTINGS.items():
        path = settings_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2))


def _wait_ready(lab: Lab, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if lab.proc.poll() is not None:
            raise HarnessError(f"jupyter lab exited with {lab.proc.returncode}:\n{lab.log_text()[-4000:]}")
        try:
            lab.api("api/status", timeout_s=2.0)
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            time.sleep(0.25)
    raise HarnessError(f"jupyter lab not ready after {timeout_s}s:\n{lab.log_text()[-4000:]}")


def _shutdown(lab: Lab, grace_s: float = 15.0) -> None:
    lab.remember_descendants()
    if lab.proc.poll() is None:
        # Graceful: the server shuts its kernels down (they live in their own sessions).
        with contextlib.suppress(Exception):
            lab.api("api/shutdown", method="POST", timeout_s=5.0)
        with contextlib.suppress(subprocess.TimeoutExpired):
            lab.proc.wait(timeout=grace_s)
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        if lab.proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(lab.proc.pid, sig)  # the server was started with start_new_session=True
        with contextlib.suppress(subprocess.TimeoutExpired):
            lab.proc.wait(timeout=wait_s)
    # Anything that outlived the server (a kernel stuck in a C call, a grandchild in its own session).
    # psutil.Process remembers the create time, so a recycled pid is never hit.
    leftovers = [p for p in lab._descendants.values() if p.is_running()]
    for p in leftovers:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(leftovers, timeout=5.0)


@contextlib.contextmanager
def jupyter_lab(
    root_dir: Path,
    env: Mapping[str, str] | None = None,
    startup_timeout_s: float = 60.0,
    extra_args: list[str] | None = None,
) -> Iterator[Lab]:
    """Start JupyterLab on 127.0.0.1 with a random token on a free port; stop it (and all kernels) on exit.

    ``env`` is layered over ``os.environ`` for the server *and* its kernels (that is how a test passes
    settings to the notebook code). The server log is echoed to stderr if the block raises.
    """
    root_dir = Path(root_dir).resolve()
    home = Path(tempfile.mkdtemp(prefix="labkit-lab-"))
    settings_dir = home / "lab-settings"
    _write_settings(settings_dir)
    full_env = dict(os.environ)
    full_env.update(
        {
            "JUPYTER_CONFIG_DIR": str(home / "config"),
            "JUPYTER_DATA_DIR": str(home / "data"),
            "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
            "JUPYTERLAB_SETTINGS_DIR": str(settings_dir),
            "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"),
            "JUPYTER_PREFER_ENV_PATH": "1",  # the venv's kernelspec/extensions win over user-level ones
            "PYDEVD_DISABLE_FILE_VALIDATION": "1",  # silences a debugpy warning in every kernel start
        }
    )
    full_env.pop("JUPYTER_PATH", None)
    full_env.update(env or {})
    log_path = home / "jupyter-lab.log"

    lab: Lab | None = None
    try:
        for _attempt in range(3):  # the free port can be grabbed between probe and bind: retry
            port = _free_port()
            token = secrets.token_hex(24)
            cmd = [
                sys.executable, "-m", "jupyterlab",
                "--no-browser",
                "--allow-root",  # harmless when not root; required in root containers
                "--ServerApp.ip=127.0.0.1",
                f"--ServerApp.port={port}",
                "--ServerApp.port_retries=0",
                f"--IdentityProvider.token={token}",
                f"--ServerApp.root_dir={root_dir}",
                "--ServerApp.terminals_enabled=False",
                "--LabApp.news_url=None",
                "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
                "--LabApp.expose_app_in_browser=True",
                # Absolute dir: checkpoints go to the temp home, not <notebook dir>/.ipynb_checkpoints.
                f"--FileCheckpoints.checkpoint_dir={home / 'checkpoints'}",
                *(extra_args or []),
            ]  # fmt: skip
            log = log_path.open("ab")
            proc = subprocess.Popen(
                cmd,
                cwd=root_dir,
                env=full_env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group, so we can signal the whole server
            )
            log.close()
            lab = Lab(f"http://127.0.0.1:{port}/", token, port, proc, root_dir, log_path, home)
            try:
                _wait_ready(lab, startup_timeout_s)
                break
            except HarnessError:
                if proc.poll() is not None and "already in use" in lab.log_text():
                    continue
                raise
        else:
            raise HarnessError(f"could not bind a port:\n{lab.log_text()[-4000:] if lab else ''}")
        yield lab
    except BaseException:
        if lab is not None:
            print(f"----- jupyter lab log ({log_path}) -----\n{lab.log_text()[-8000:]}", file=sys.stderr)
        raise
    finally:
        if lab is not None:
            _shutdown(lab)
        shutil.rmtree(home, ignore_errors=True)


def chromium_executable() -> str:
    """Chromium to drive: $LABKIT_CHROMIUM, else /usr/bin/chromium, else ``chromium`` on PATH.

    Never Playwright's bundled browser: it cannot be downloaded here, and its error would only
    say ``playwright install``. Raises :class:`BrowserUnavailable` naming where it looked.
    """
    override = os.environ.get("LABKIT_CHROMIUM")
    if override:
        if Path(override).is_file() and os.access(override, os.X_OK):
            return override
        raise BrowserUnavailable(f"LABKIT_CHROMIUM={override} is not an executable file")
    for candidate in ("/usr/bin/chromium", shutil.which("chromium")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise BrowserUnavailable("no Chromium found at /usr/bin/chromium or as `chromium` on PATH: install Debian's "
                             "chromium (apt-get install chromium) or set LABKIT_CHROMIUM to its path")


# --- JS snippets, all acting on the notebook that is the current widget in the main area -----------

_JS_NOTEBOOK_READY = """(path) => {
  const app = window.jupyterapp;
  const w = app && app.shell && app.shell.currentWidget;
  if (!w || !w.context || w.context.path !== path || !w.content || !w.sessionContext) return false;
  const s = w.sessionContext;
  return !!(w.context.isReady && s.isReady && s.session && s.session.kernel
            && s.session.kernel.status === 'idle' && s.session.kernel.connectionStatus === 'connected');
}"""

_JS_KERNEL_IDLE = """() => {
  const w = window.jupyterapp.shell.currentWidget;
  const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
  return !!k && k.status === 'idle';
}"""

_JS_DIALOG_TEXT = """() => {
  const d = document.querySelector('.jp-Dialog');
  return d ? d.innerText : null;
}"""

# Starts run-all without awaiting (a long cell would outlive page.evaluate); result lands in a global.
_JS_START_RUN_ALL = """() => {
  window.__labkitRunAll = undefined;
  window.jupyterapp.commands.execute('notebook:run-all-cells')
    .then(ok => { window.__labkitRunAll = ok ? 'ok' : 'failed'; },
          err => { window.__labkitRunAll = 'error: ' + err; });
}"""

_JS_CELL_ERRORS = """() => {
  const nb = window.jupyterapp.shell.currentWidget.content;
  const errs = [];
  nb.widgets.forEach((cell, i) => {
    const outs = cell.model.outputs;
    if (!outs) return;
    for (let j = 0; j < outs.length; j++) {
      const o = outs.get(j).toJSON();
      if (o.output_type === 'error') errs.push(`cell ${i}: ${o.ename}: ${o.evalue}`);
    }
  });
  return errs;
}"""

_JS_EXEC_COUNTS = """() => window.jupyterapp.shell.currentWidget.content.widgets
  .filter(c => c.model.type === 'code').map(c => c.model.executionCount)"""

_JS_TEXTS = """(sel) => {
  const root = window.jupyterapp.shell.currentWidget.node;
  return Array.from(root.querySelectorAll(sel)).map(e => (e.innerText || e.textContent || '').trim());
}"""

_JS_WAIT_TEXT = """([sel, text, exact]) => {
  const root = window.jupyterapp.shell.currentWidget.node;
  return Array.from(root.querySelectorAll(sel)).some(e => {
    const t = (e.innerText || e.textContent || '').trim();
    return exact ? t === text : t.includes(text);
  });
}"""

# Plotly charts: FigureWidget (anywidget) and fig.show() (jupyterlab-plotly mime renderer) both end in a
# div.js-plotly-plot (the "graph div", gd). gd.data is the trace list as given: FigureWidget x/y are Array
# or typed arrays (numpy floats arrive as Float64Array), but fig.show() leaves numpy data as undecoded
# {dtype, bdata} objects. gd._fullData[i] has decoded arrays and `_length` (the trace's length, NaN
# included: a trace of NaNs has a length but draws nothing). n_points counts the finite y values.
_JS_PLOTLY = """(withValues) => {
  const root = window.jupyterapp.shell.currentWidget.node;
  const len = a => (a && typeof a.length === 'number') ? a.length : 0;
  return Array.from(root.querySelectorAll('.js-plotly-plot')).map(gd => (gd.data || []).map((t, i) => {
    const full = (gd._fullData && gd._fullData[i]) || {};
    const x = len(full.x) ? full.x : t.x, y = len(full.y) ? full.y : t.y;
    const raw = Math.max(len(x), len(y), len(t.values), len(t.z));
    let finite = 0;
    for (let j = 0; j < len(y); j++) { if (typeof y[j] === 'number' && Number.isFinite(y[j])) finite++; }
    const tr = {name: t.name == null ? '' : String(t.name), type: t.type || 'scatter',
                n_points: finite, length: typeof full._length === 'number' ? full._length : raw,
                x_len: len(x), y_len: len(y)};
    if (withValues) { tr.x = len(x) ? Array.from(x) : []; tr.y = len(y) ? Array.from(y) : []; }
    return tr;
  }));
}"""


def _check_no_dialog(page: Any) -> None:
    text = page.evaluate(_JS_DIALOG_TEXT)
    if text:
        raise HarnessError(f"unexpected JupyterLab dialog: {text!r}")


@contextlib.contextmanager
def browser_page(
    lab: Lab,
    notebook: str,
    timeout_s: float = 120.0,
    viewport: tuple[int, int] = (1400, 1000),
    failure_screenshot: Path | None = None,
) -> Iterator[Any]:
    """Open ``notebook`` (path relative to the lab root, "/"-separated) in headless Chromium.

    Yields a Playwright ``Page`` once the notebook is loaded and its kernel is connected and idle.
    On an exception inside the block, saves ``failure_screenshot`` (if given) and echoes the browser
    console errors to stderr. The browser is always closed.
    """
    from playwright.sync_api import sync_playwright

    console: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_executable(), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": viewport[0], "height": viewport[1]})
            page.on("console", lambda m: console.append(f"[{m.type}] {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: console.append(f"[pageerror] {e}"))
            try:
                url = f"{lab.url}lab/tree/{urllib.parse.quote(notebook)}?token={lab.token}"
                page.goto(url, timeout=timeout_s * 1000)
                try:
                    page.wait_for_function(_JS_NOTEBOOK_READY, arg=notebook, timeout=timeout_s * 1000, polling=250)
                except Exception as exc:
                    _check_no_dialog(page)
                    raise HarnessError(f"notebook {notebook!r} not open with an idle kernel: {exc}") from exc
                _check_no_dialog(page)
                lab.remember_descendants()  # the kernel now exists
                yield page
            except BaseException:
                if failure_screenshot is not None:
                    with contextlib.suppress(Exception):
                        screenshot(page, failure_screenshot)
                if console:
                    print("----- browser console errors -----\n" + "\n".join(console[-50:]), file=sys.stderr)
                raise
        finally:
            browser.close()


def wait_kernel_idle(page: Any, timeout_s: float = 60.0) -> None:
    page.wait_for_function(_JS_KERNEL_IDLE, timeout=timeout_s * 1000, polling=250)


def run_all_cells(page: Any, timeout_s: float = 300.0) -> None:
    """Run all cells (JupyterLab's own ``notebook:run-all-cells``) and wait until they have finished.

    Raises :class:`CellExecutionError` (with the ename/evalue) if a cell raised; JupyterLab then stops.
    Cells that start background threads count as finished when the cell returns.
    """
    page.evaluate(_JS_START_RUN_ALL)
    try:
        page.wait_for_function(
            "() => window.__labkitRunAll !== undefined", timeout=timeout_s * 1000, polling=250
        )
    except Exception as exc:
        _check_no_dialog(page)
        raise HarnessError(f"cells still running after {timeout_s}s: {page.evaluate(_JS_EXEC_COUNTS)}") from exc
    result = page.evaluate("() => window.__labkitRunAll")
    errors = page.evaluate(_JS_CELL_ERRORS)
    if result != "ok" or errors:
        raise CellExecutionError(f"run all cells: {result}; " + ("; ".join(errors) or "no error output"))
    wait_kernel_idle(page, timeout_s)
    _check_no_dialog(page)


def click_button(page: Any, description: str, timeout_s: float = 30.0) -> None:
    """Click the (unique) ipywidgets Button whose text is exactly ``description``; waits until enabled."""
    pattern = re.compile(rf"^\s*{re.escape(description)}\s*$")
    buttons = page.locator(WIDGET_BUTTON_SELECTOR).filter(has_text=pattern)
    buttons.first.wait_for(state="visible", timeout=timeout_s * 1000)
    n = buttons.count()
    if n != 1:
        raise HarnessError(f"expected 1 widget button {description!r}, found {n}")
    buttons.click(timeout=timeout_s * 1000)  # Playwright waits for enabled/stable/unobscured


def widget_texts(page: Any, selector: str = WIDGET_TEXT_SELECTOR) -> list[str]:
    """Current texts of the widget elements matching ``selector`` in the open notebook."""
    return list(page.evaluate(_JS_TEXTS, selector))


def wait_for_text(
    page: Any,
    text: str,
    timeout_s: float = 60.0,
    selector: str = WIDGET_TEXT_SELECTOR,
    exact: bool = False,
) -> None:
    """Wait until some widget Label/HTML (``selector``) contains (or equals, with ``exact``) ``text``."""
    try:
        page.wait_for_function(_JS_WAIT_TEXT, arg=[selector, text, exact], timeout=timeout_s * 1000, polling=250)
    except Exception as exc:
        raise HarnessError(
            f"no widget text {text!r} within {timeout_s}s; widget texts now: {widget_texts(page, selector)}"
        ) from exc


def plotly_traces(page: Any, with_values: bool = False) -> list[list[dict[str, Any]]]:
    """Trace data of every plotly chart in the open notebook, as the browser sees it.

    One list per chart (document order), one dict per trace: ``name``, ``type``, ``n_points`` (finite
    y values: the points plotly can draw), ``length`` (plotly's trace length, NaN included), ``x_len``,
    ``y_len``, and with ``with_values`` also ``x`` and ``y`` lists (NaN stays NaN).
    """
    return list(page.evaluate(_JS_PLOTLY, with_values))


def wait_for_charts(page: Any, count: int, timeout_s: float = 60.0) -> None:
    """Wait until ``count`` plotly charts are on the page (they render after their cell has returned)."""
    try:
        page.wait_for_function(
            "(n) => window.jupyterapp.shell.currentWidget.node.querySelectorAll('.js-plotly-plot').length >= n",
            arg=count, timeout=timeout_s * 1000, polling=250)
    except Exception as exc:
        raise HarnessError(f"fewer than {count} plotly charts after {timeout_s}s: {plotly_traces(page)}") from exc


def wait_for_points(page: Any, min_points: int, chart: int = 0, trace: int = 0, timeout_s: float = 60.0) -> None:
    """Wait until trace ``trace`` of chart ``chart`` has at least ``min_points`` finite points."""
    deadline = time.monotonic() + timeout_s
    while True:
        charts = plotly_traces(page)
        with contextlib.suppress(IndexError):
            if charts[chart][trace]["n_points"] >= min_points:
                return
        if time.monotonic() > deadline:
            raise HarnessError(f"chart {chart} trace {trace} below {min_points} points: {charts}")
        time.sleep(0.25)


# Runs code in the open notebook's kernel (not a cell: nothing shows in the notebook) and returns
# its stdout; the kernel must be idle or the request waits its turn.
_JS_KERNEL_RUN = """async (code) => {
  const k = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
  let out = '', err = null;
  const future = k.requestExecute({code, silent: false, store_history: false});
  future.onIOPub = msg => {
    if (msg.header.msg_type === 'stream') out += msg.content.text;
    if (msg.header.msg_type === 'error') err = msg.content.ename + ': ' + msg.content.evalue;
  };
  await future.done;
  return {out, err};
}"""


def kernel_output(page: Any, code: str) -> str:
    """Stdout of ``code`` run in the notebook's kernel (raises :class:`HarnessError` if it raised)."""
    result = page.evaluate(_JS_KERNEL_RUN, code)
    if result["err"]:
        raise HarnessError(f"kernel code {code!r} raised {result['err']}")
    return str(result["out"])


def set_text_widget(page: Any, description: str, value: str, timeout_s: float = 30.0) -> None:
    """Type ``value`` into the (unique) Text/IntText/FloatText widget labelled ``description``, then leave it.

    Leaving the box (Tab) is what sends the value to the kernel: these widgets do not update continuously.
    """
    label = page.locator("label.widget-label", has_text=re.compile(rf"^\s*{re.escape(description)}\s*$"))
    boxes = page.locator(".widget-text").filter(has=label).locator("input")
    boxes.first.wait_for(state="visible", timeout=timeout_s * 1000)
    if boxes.count() != 1:
        raise HarnessError(f"expected 1 text widget {description!r}, found {boxes.count()}")
    boxes.fill(value, timeout=timeout_s * 1000)
    boxes.press("Tab")


def screenshot(page: Any, path: Path, scroll_to: str | None = None) -> Path:
    """Save a PNG of the viewport (creating parent dirs).

    JupyterLab scrolls inside the notebook panel, so Playwright's ``full_page`` shows nothing more;
    pass ``scroll_to`` (a CSS selector, e.g. ``".js-plotly-plot"``) to bring its last match into view.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if scroll_to is not None:
        page.locator(scroll_to).last.scroll_into_view_if_needed(timeout=5000)
    page.screenshot(path=str(path))
    return path

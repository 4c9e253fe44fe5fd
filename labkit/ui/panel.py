"""The lab's control panel: pick a configuration, Launch, watch every rank live, Stop, compare.

    from labkit.ui.panel import LabPanel
    panel = LabPanel(example="zero3", world_size=2, micro_batch=32, steps=20)
    panel                 # in a notebook: controls, status line, live charts, logs, history
    panel.launch()        # what the Launch button does; returns the Run (None if the config is invalid)
    panel.stop()          # what the Stop button does

The widgets hold no logic: each control is named after the `RunConfig` field it sets,
`config()` builds a `RunConfig` from them (its validation is the only validation), Launch
starts a `labkit.Run`, and the live charts are a `labkit.ui.dashboard.Dashboard`. Every value
shown comes from the config, the run or the run store, so a fresh panel after a kernel
restart shows the same history.
"""

from __future__ import annotations

import html
import numbers
import os
import threading
import time
from typing import Any

from labkit.core.config import FIELDS, ConfigError, RunConfig
from labkit.core.model_specs import MODELS
from labkit.core.records import rank_log, read_end
from labkit.launch.admission import Admission
from labkit.launch.history import COLUMNS, recover_stale, runs
from labkit.launch.run import FINAL_STATUSES, Run, check_extra_env, warm_by_default, warm_up
from labkit.ui.dashboard import REFRESH_S, Dashboard, RunSeries, check_refresh_s

LOG_REFRESH_S = 1.0    # log tails are re-read at most this often
LOG_LINES = 40
# Dropdowns cannot show None as a chosen value (it means "nothing selected"): "preset" stands
# for RunConfig's None, "use the example's preset".
PRESET = "preset"
# The RunConfig fields the panel has a control for (LabPanel.controls), in its order.
CONTROLLED = ("example", "stage", "offload_optimizer", "precision", "world_size", "micro_batch", "grad_accum", "steps",
              "hidden", "depth", "lr", "lr_scaling", "base_batch", "model", "data", "loss")
LR_BOX = (1e-9, 10.0)  # what the LR box holds: it would clamp a default outside, so LabPanel refuses one


def _preset(value: Any) -> Any:
    return PRESET if value is None else value


# -- pure helpers (unit-tested) ------------------------------------------------------------
def dropdown_options(name: str) -> list[tuple[str, Any]]:
    """(label, value) for each value RunConfig field `name` takes (its Literal's choices; off/on for a switch),
    after "preset" where the field may be None."""
    spec = FIELDS[name]
    values = (False, True) if spec.kind is bool else spec.choices
    assert values is not None, f"{name} has no fixed set of values"
    options = [({False: "off", True: "on"}[v] if spec.kind is bool else str(v), v) for v in values]
    return [(PRESET, PRESET), *options] if spec.optional else options


def control_problem(name: str, value: Any) -> str | None:
    """Why the control of RunConfig field `name` cannot hold `value` (a LabPanel default), or None. A dropdown holds
    only its choices and a text box only text; an integer box holds any integer (RunConfig's bounds are shown in
    the message area, as for a value typed in), but not text or a fraction it would round; the LR box holds `LR_BOX`
    and would clamp anything else. "must be ..., got ...", as RunConfig says it. Pure."""
    spec = FIELDS[name]
    if name == "lr":
        low, high = LR_BOX
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if number and low <= value <= high else \
            f"must be a number from {low:g} to {high:g} (the LR box's range), got {value!r}"
    if spec.kind is int and spec.choices is None:
        return None if isinstance(value, numbers.Integral) and not isinstance(value, bool) else spec.problem(value)
    return spec.problem(value)


def status_line(status: str, *, step: int = 0, steps: int = 0, run_id: str = "",
                summary: dict[str, Any] | None = None, waiting_on: str | None = None) -> str:
    """The panel's one-line status. Every line starts with "status: <state>". `waiting_on`: what a run
    at step 0 waits for when it is an op build or a stale build lock (`Run.waiting_on`)."""
    where = f" · {run_id}" if run_id else ""
    summary = summary or {}
    if status == "created":
        return "status: idle"
    if status == "stopping":
        return f"status: stopping{where}"
    if status in ("starting", "running"):
        if step == 0 and waiting_on:
            return f"status: starting{where} · waiting: {waiting_on}"
        if step == 0:
            return f"status: starting{where} (process start, distributed init, op builds)"
        return f"status: running step {step}/{steps}{where}"
    if status == "finished":
        rate = summary.get("samples_per_s")
        loss = summary.get("final_loss")
        extra = (f" · {rate:.0f} samples/s" if rate else "") + (f" · final loss {loss:.4f}" if loss else "")
        # Which optimizer ran (labkit.runtime.ops.OPTIMIZER_IMPLS): offload timings mean CPU Adam only if it ran.
        impl = summary.get("optimizer_impl")
        extra += f" · optimizer {impl}" if impl else ""
        return f"status: finished {summary.get('steps_completed', step)}/{steps} steps{extra}{where}"
    if status == "stopped":
        return f"status: stopped at step {summary.get('steps_completed', step)}/{steps}{where}"
    # failed / oom / hung: the supervisor's cause names the root-cause rank ("rank 1: ...").
    cause = summary.get("cause") or "no cause recorded"
    rank = summary.get("failed_rank")
    if rank is not None and not cause.startswith(f"rank {rank}"):
        cause = f"rank {rank}: {cause}"
    return f"status: {status} · {cause}{where}"


def tail_text(path: str | os.PathLike, max_lines: int = LOG_LINES, max_bytes: int = 16384) -> str:
    """The last `max_lines` lines of a log file (reads at most `max_bytes` from its end)."""
    data = read_end(path, max_bytes + 1)  # one byte more: whether the first line kept is cut
    lines = data[-max_bytes:].decode(errors="replace").splitlines()
    if len(data) > max_bytes:
        lines = lines[1:]  # the first line is probably cut
    return "\n".join(lines[-max_lines:])


def _run_id(run: Run) -> str:
    """The run directory's name, which the status line and messages call the run by."""
    return run.run_dir.name if run.run_dir is not None else "(not started)"


# -- the panel -----------------------------------------------------------------------------
class LabPanel:
    """ipywidgets control panel bound to `RunConfig` and `Run`; see the module docstring.

    `defaults` are RunConfig fields: those with a control set its initial value, the others
    (dataset_size, census_every, ...) pass through to every launched config. `env` is added
    to the ranks' environment and `root` is the run store (default: LABKIT_RUNS_DIR / runs/).
    """

    def __init__(self, *, env: dict[str, str] | None = None, root: str | os.PathLike | None = None,
                 refresh_s: float = REFRESH_S, **defaults: Any):
        import ipywidgets as W

        from labkit.runtime.devices import detect_devices

        unknown = sorted(set(defaults) - set(FIELDS))
        if unknown:
            raise TypeError(f"LabPanel got unknown RunConfig field(s) {unknown}")
        # What no control could show, and what the panel itself takes: refused before anything is built or written
        # (ConfigError or ValueError naming it); what a control shows, RunConfig judges in the message area.
        for name, value in defaults.items():
            problem = control_problem(name, value) if name in CONTROLLED else None
            if problem:
                raise ConfigError(name, problem)
        self.env = check_extra_env(env)
        check_refresh_s(refresh_s)
        self.root = root
        self.run: Run | None = None
        self._stopping: Run | None = None  # the run Stop was pressed for, until it is done
        # Status line, buttons and logs are written by the kernel's thread (launch, stop) and
        # by the dashboard's thread (ticks): one writer at a time.
        self._lock = threading.RLock()
        self._logs_read_at = 0.0
        values = {name: spec.default for name, spec in FIELDS.items()}
        values.update(defaults)
        max_ranks = detect_devices().max_ranks
        wide = {"description_width": "140px"}  # the longest label, "grad. accumulation", is 126 px in Chromium

        # Every control is named after the RunConfig field it sets and shows the field's help as its tooltip.
        descriptions = {
            "example": "example", "stage": "ZeRO stage", "offload_optimizer": "optimizer offload",
            "precision": "precision", "world_size": f"world size (≤{max_ranks})", "micro_batch": "micro-batch",
            "grad_accum": "grad. accumulation", "steps": "steps", "hidden": "hidden width", "depth": "depth (layers)",
            "lr": "LR", "lr_scaling": "LR scaling", "base_batch": "LR tuned at batch", "model": "model",
            "data": "dataset", "loss": "loss",
        }

        def described(name: str) -> dict[str, Any]:
            return {"description": descriptions[name], "tooltip": FIELDS[name].describe(), "style": wide}

        def intbox(name: str) -> W.IntText:
            # Unbounded: a bounded box would clamp silently; RunConfig says what is wrong.
            return W.IntText(value=values[name], **described(name))

        def dropdown(name: str) -> W.Dropdown:
            return W.Dropdown(options=dropdown_options(name), value=_preset(values[name]), **described(name))

        # One control per RunConfig field, keyed by the field's name: config() reads them as they are.
        self.controls: dict[str, W.ValueWidget] = {
            **{name: dropdown(name) for name in ("example", "stage", "offload_optimizer", "precision")},
            # What this machine can host: one rank per GPU, or per core on CPU (RunConfig checks it).
            **{name: intbox(name) for name in ("world_size", "micro_batch", "grad_accum", "steps", "hidden",
                                               "depth")},
            "lr": W.BoundedFloatText(value=values["lr"], min=LR_BOX[0], max=LR_BOX[1], step=1e-4, **described("lr")),
            "lr_scaling": dropdown("lr_scaling"),
            "base_batch": intbox("base_batch"),
            # What is trained (labkit.models.builders): a built-in name or the learner's import strings. Launch
            # imports them in a child process first: a bad one is shown here and nothing starts.
            "model": W.Combobox(options=list(MODELS), value=values["model"], ensure_option=False,
                                placeholder="mlp, gpt or package.module:build_model",
                                layout=W.Layout(width="520px"), **described("model")),
            "data": W.Text(value=values["data"] or "", layout=W.Layout(width="520px"),
                           placeholder="package.module:build_dataset (default: the model's)", **described("data")),
            "loss": W.Text(value=values["loss"] or "", layout=W.Layout(width="520px"),
                           placeholder="package.module:loss_fn (default: cross-entropy)", **described("loss")),
        }
        assert tuple(self.controls) == CONTROLLED, "CONTROLLED lists the controls"
        self._extra = {k: v for k, v in defaults.items() if k not in self.controls}

        self.derived = W.HTML()   # global batch and peak LR of the current choice
        self.message = W.HTML()   # the ConfigError of an invalid choice
        self.launch_button = W.Button(description="Launch", button_style="success", icon="play")
        self.stop_button = W.Button(description="Stop", button_style="danger", icon="stop", disabled=True)
        # Cold: through DeepSpeed's launcher, every interpreter importing torch and DeepSpeed again (~8 s here), to
        # compare with the default warm launch (labkit.launch.zygote; on a GPU, spawned: labkit.launch.warm_launch).
        self.cold = W.Checkbox(value=not warm_by_default(), description="cold launch", indent=False,
                               tooltip="launch as the deepspeed command does, through DeepSpeed's runner and "
                                       "launch.py (unticked: CPU ranks fork from a preloaded zygote, GPU ranks are "
                                       "started by the run's supervisor)")
        self.status = W.HTML(value=status_line("created"))
        self.logs = W.Accordion(children=[])
        self.dashboard = Dashboard(refresh_s=refresh_s, on_tick=self._on_tick)

        # Compare: overlay past runs, history table. Both read the run store only.
        self.run_select = W.SelectMultiple(options=[], rows=6, description="past runs",
                                           layout=W.Layout(width="560px"))
        self.overlay_button = W.Button(description="Overlay", icon="clone")
        self.clear_button = W.Button(description="Clear overlays")
        self.history_button = W.Button(description="Reload history", icon="refresh")
        self.history = W.Output(layout=W.Layout(max_height="320px", overflow="auto"))

        self.launch_button.on_click(lambda _: self.launch())
        self.stop_button.on_click(lambda _: self.stop())
        self.overlay_button.on_click(lambda _: self.dashboard.overlay(self.run_select.value))
        self.clear_button.on_click(lambda _: self.dashboard.clear_overlays())
        self.history_button.on_click(lambda _: self.refresh_history(recover=True))
        for control in self.controls.values():
            control.observe(self._on_change, names="value")

        c = self.controls
        column = lambda *names: W.VBox([c[n] for n in names])  # noqa: E731
        compare = W.VBox([
            W.HBox([self.run_select, W.VBox([self.overlay_button, self.clear_button, self.history_button])]),
            self.history])
        self.compare = W.Accordion(children=[compare], titles=("Compare past runs",), selected_index=0)
        self.widget = W.VBox([
            W.HTML("<h3 style='margin:0'>DeepSpeed Batch Lab</h3>"),
            W.HBox([column("example", "stage", "offload_optimizer", "precision"),
                    column("world_size", "micro_batch", "grad_accum", "steps"),
                    column("hidden", "depth", "lr", "lr_scaling", "base_batch")]),
            W.HBox([column("model", "data", "loss")]),
            self.derived, self.message,
            W.HBox([self.launch_button, self.stop_button, self.cold]),
            self.status,
            self.dashboard.widget,
            self.logs,
            self.compare,
        ])
        self._on_change()
        self.refresh_history(recover=True)

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)
        if not self.cold.value:
            warm_up(self.env)  # the zygote preloads while the learner picks a configuration

    # -- binding ---------------------------------------------------------------------------
    def config(self) -> RunConfig:
        """The RunConfig the controls describe; raises ConfigError if it must not be launched."""
        values: dict[str, Any] = {name: None if control.value == PRESET else control.value
                                  for name, control in self.controls.items()}
        for name in ("data", "loss"):
            values[name] = values[name].strip() or None  # an empty text field: the default
        values["model"] = values["model"].strip()
        return RunConfig(**self._extra, **values)

    def _on_change(self, _change: Any = None) -> None:
        """Show the derived numbers of the current choice (global batch, peak LR) or why it is invalid."""
        try:
            config = self.config()
        except ConfigError as exc:
            self.derived.value = "global batch: —"
            self._show_error(str(exc))
            return
        stage = "no ZeRO" if config.stage is None else f"ZeRO stage {config.stage}"
        offload = ", optimizer offloaded" if config.offload_optimizer else ""
        self.derived.value = (
            f"<b>global batch = {config.micro_batch} × {config.grad_accum} × {config.world_size} "
            f"= {config.global_batch}</b> (micro-batch × accumulation × ranks) · peak LR {config.peak_lr:.3g} "
            f"({config.lr_scaling} scaling) · {stage}{offload}")
        self.message.value = ""

    def _show_error(self, text: str) -> None:
        self.message.value = f"<span style='color:#b00020'>⚠ {html.escape(text)}</span>"

    # -- actions ---------------------------------------------------------------------------
    def launch(self) -> Run | None:
        """Start a run with the current choice; None (and the reason shown) if nothing was launched."""
        if self.run is not None and not self.run.done:
            self._show_error(f"run {_run_id(self.run)} is still going; stop it first")
            return None
        # The last run's update thread goes first, so nothing of it can touch the new run.
        if not self.dashboard.close():
            self._show_error("the last run's chart updates have not stopped yet; press Launch again")
            return None
        try:
            config = self.config()
            _, decision = Admission.here(self.root).admit_alone(config, "this run")  # NotEnoughMemory, with figures
            if not decision.admit:  # other programs hold the memory now
                self._show_error(f"{decision.describe()}: close other programs, then Launch again")
                return None
            run = Run(config, env=self.env, root=self.root, warm=not self.cold.value).start()  # refuses busy GPUs
        except ConfigError as exc:
            self._show_error(str(exc))
            return None
        except Exception as exc:  # a busy GPU, a full disk: shown in the panel, not lost in a callback
            self._show_error(f"launch failed: {type(exc).__name__}: {exc}")
            return None
        with self._lock:
            self.message.value = ""
            self.run = run
            self._stopping = None
            self.launch_button.disabled = True
            self.stop_button.disabled = False
            self._show_status(run, 0)
            self.logs.children = [self._log_view() for _ in range(config.world_size)]
            self.logs.titles = tuple(f"rank {rank} log" for rank in range(config.world_size))
            self.logs.selected_index = None  # collapsed until asked for
        self.dashboard.watch(run)  # its thread also drives the status line and log tails (_on_tick)
        self.refresh_history(recover=True)
        return run

    def stop(self) -> str | None:
        """End every process of the current run (blocks a few seconds); returns its status."""
        run = self.run
        if run is None:
            return None
        if not run.done:
            with self._lock:
                self._stopping = run  # ticks keep showing "stopping" until the run is done
                self._show_status(run, self.dashboard.last_step())
        status = run.stop()
        self.dashboard.join(timeout=10)  # its final tick shows "stopped" and reloads the history
        if run is self.run:
            # Whatever the update thread managed: the run is over, the controls are free again.
            self._finish(run, self.dashboard.last_step())
        return status

    def close(self) -> None:
        self.dashboard.close()

    # -- updates (from the dashboard's thread) ---------------------------------------------
    def _on_tick(self, run: Run, series: RunSeries, final: bool, error: str | None) -> None:
        step = series[0].last_step if len(series) else 0  # this thread is the one that extends them
        # The panel's own run: if its supervisor died, end what it left and write the summary (status only
        # reads). Outside the lock: seconds of killing and summarising, and Stop must not wait on that.
        run.recover()
        status = run.status
        with self._lock:
            if run is not self.run:
                return  # a thread of an earlier run: never writes over the current one
            if not final:
                self._show_status(run, step, status)
                now = time.monotonic()
                if now - self._logs_read_at >= LOG_REFRESH_S:
                    self._logs_read_at = now
                    self._show_logs(run)
                return
            if error:
                self._show_error(f"live updates stopped: {error.strip().splitlines()[-1]}"
                                 + ("" if run.done else "; the run goes on (Stop ends it)"))
        self._finish(run, step)

    def _finish(self, run: Run, step: int) -> None:
        """The last status, logs and history of `run`; Launch enabled, Stop only while it still runs."""
        status = run.status  # outside the lock, as in _on_tick
        with self._lock:
            done = False
            try:
                done = self._show_status(run, step, status)
                self._show_logs(run)
            finally:
                self.launch_button.disabled = False
                self.stop_button.disabled = done
        self.refresh_history()

    def _show_status(self, run: Run, step: int, status: str | None = None) -> bool:
        """Show the run's status line (`status` read beforehand, outside the lock); returns whether it is done."""
        status = status or run.status
        done = status in FINAL_STATUSES
        if not done and self._stopping is run:
            status = "stopping"
        summary = run.summary if done else None
        waiting = run.waiting_on if not done and step == 0 else None
        text = status_line(status, step=step, steps=run.config.steps, run_id=_run_id(run), summary=summary,
                           waiting_on=waiting)
        color = {"finished": "#1b5e20", "stopped": "#6d4c41"}.get(status, "#b00020" if done else "#0d47a1")
        self.status.value = f"<span style='color:{color}'>{html.escape(text)}</span>"
        return done

    @staticmethod
    def _log_view():
        import ipywidgets as W

        return W.HTML(value="<pre>(no output yet)</pre>")

    def _show_logs(self, run: Run) -> None:
        if run.run_dir is None:
            return  # not started: no logs yet
        for rank, view in enumerate(self.logs.children):
            path = rank_log(run.run_dir, rank)
            text = tail_text(path) if path else ""
            value = (f"<pre style='max-height:18em;overflow:auto;font-size:11px;margin:0'>"
                     f"{html.escape(text or '(no output yet)')}</pre>")
            if view.value != value:
                view.value = value

    # -- history ---------------------------------------------------------------------------
    def refresh_history(self, recover: bool = False) -> None:
        """Reload the run store: the overlay choices and the history table. `recover` (the user's actions:
        showing the panel, Launch, Reload history): first end the runs whose supervisor died (`recover_stale`)."""
        if recover:
            recover_stale(self.root)
        table = runs(self.root)
        newest_first = table.iloc[::-1]
        shown = newest_first.loc[:, list(COLUMNS)]
        with self._lock:  # the kernel's thread (buttons) and the dashboard's (final tick) both reload
            self._show_history(newest_first, shown)

    def _show_history(self, newest_first: Any, shown: Any) -> None:
        chosen = set(self.run_select.value)
        self.run_select.options = [(f"{row.run_id} ({row.status})", row.path) for row in newest_first.itertuples()]
        self.run_select.value = tuple(path for _, path in self.run_select.options if path in chosen)
        # Set the Output's outputs directly: `with output:` captures by thread and must not
        # be used from the dashboard's thread.
        self.history.outputs = ({
            "output_type": "display_data",
            "data": {"text/html": "<div style='font-size:12px;white-space:nowrap'>"
                                  + shown.to_html(index=False, na_rep="", float_format=lambda v: f"{v:.4g}") + "</div>",
                     "text/plain": shown.to_string(index=False)},
            "metadata": {},
        },)

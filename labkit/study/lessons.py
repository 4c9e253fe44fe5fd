"""Small helpers the lesson notebooks (notebooks/00-04) share, so no notebook copies code.

    from labkit.study import lessons
    runs = lessons.launch_all({"stage 0": RunConfig(...), "stage 1": RunConfig(...)})
    lessons.summary_table(runs)          # one row per run: status, timings, batch
    lessons.rank_table(runs)             # one row per (run, rank): model-state bytes in MiB
    lessons.stacked_bars(table, [...])   # a static plotly bar chart (labkit.study.figures draws the rest)
    lessons.check(condition, "what it shows")  # "Check: ... holds"; if not: fails (ci) or a warning box (else)
    with lessons.check_group("more checks"): ...  # the passing checks folded into one collapsed line
    lessons.reveal("Answer", "...")      # a prediction's answer, collapsed until clicked

Everything here reads what the runs recorded (`Run.summary`, `Run.records()`, the rank
logs); nothing is estimated except where a function says so.
"""

from __future__ import annotations

import contextlib
import html
import numbers
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import pandas as pd

import labkit.study.figures  # noqa: F401  (sets plotly's renderer: figures show in JupyterLab and in `make docs` HTML)
from labkit.core import schema
from labkit.core.config import ConfigError, RunConfig
from labkit.core.records import rank_logs_text
from labkit.launch.run import Run
from labkit.runtime.arguments import whole_number

MiB = 2**20
# The lesson helpers build their dataset in this process: 10M samples of 1 input and 2 outputs (float32) are 120 MB,
# and the samplers' index lists a few times that; a typed 10**12 would ask for terabytes.
LESSON_MAX_SAMPLES = 10_000_000

# Per-rank byte counters of a run summary, in the order the notebooks show them.
STATE_COLUMNS = schema.STATE_KEYS
RANK_COLUMNS = (*STATE_COLUMNS, *schema.HOST_KEYS, "activation_bytes", "peak_rss_bytes",
                "device_peak_bytes")
SUMMARY_COLUMNS = ("status", "example", "stage", "offload_optimizer", "precision", "world_size", "micro_batch",
                   "grad_accum", "global_batch", "steps_completed", "median_step_time_s", "forward_s",
                   "backward_s", "optimizer_s", "samples_per_s", "final_loss", "wall_time_s")


# -- launching ---------------------------------------------------------------------------


def launch_all(configs: Mapping[str, RunConfig], timeout_s: float | None = None,
               concurrent: bool | None = None, *, progress: bool = True, file: TextIO | None = None,
               poll_s: float = 0.25) -> dict[str, Run]:
    """Run every config; returns {label: Run}, finished or not (check `require`).

    On CPU ranks they overlap as far as the machine holds them (`labkit.launch.admission`): a run
    starts, in order, once its estimated memory fits beside the runs already going (what
    `psutil` says is available, or `LABKIT_MEMORY_LIMIT_BYTES`, less a margin) and its ranks fit on
    the cores (one rank process and one OpenMP thread per core); the rest wait, and their bars say for what
    ("waiting for memory: needs 1.73 GB, 0.94 GB available"). A run whose config leaves `threads_per_rank`
    unset gets its share of the cores (`admission.share_cores`: two 1-rank runs on 2 cores, one thread each), so
    runs that train together do not spin-wait on each other's cores. A run that needs more than the machine
    could ever give it is refused before anything launches (`NotEnoughMemory`, a ConfigError with
    `needed_bytes` and `available_bytes`). On GPUs they run one
    after the other (`concurrent=False`): every run's rank 0 would use the first GPU and take the
    others' memory; a run whose GPUs another run holds waits for them. `timeout_s` bounds each run,
    from its start.

    `progress`: `tqdm.auto` bars (widgets in a notebook, text elsewhere, on `file`, default
    stderr): one over the runs, and one per run with its step and phase (queued, waiting for memory,
    starting, building ops, step k/N; labkit.launch.phase), ending with its status.
    """
    import dataclasses

    from labkit.launch.admission import SAMPLE_S, Admission, Estimate, occupies, share_cores
    from labkit.launch.device_lease import DevicesBusy
    from labkit.launch.phase import RunProgress
    from labkit.runtime.devices import detect_devices

    if concurrent is None:
        concurrent = detect_devices().is_cpu
    admission = Admission.here()
    if concurrent and admission.is_cpu:  # runs that overlap train on their share of the cores, not all of them
        configs = share_cores(configs, admission.cores)
    estimates = {label: admission.estimate(config) for label, config in configs.items()}
    for label, estimate in estimates.items():  # before anything launches
        admission.check_alone(estimate, f"run {label!r}")
    start = time.monotonic()
    runs: dict[str, Run] = {}
    pending = list(configs)
    active: dict[str, tuple[RunProgress, float, int | None]] = {}  # label -> (progress, started, supervisor pid)
    rss: dict[str, int] = {}  # label -> its process tree's RSS at the last sample
    sampled_at = 0.0
    most_at_once = 0
    overall = _bar(progress, file, total=len(pending), unit="run", desc="runs", position=0)
    bars = {label: _bar(progress, file, total=config.steps, unit="step", desc=label, position=i + 1, leave=True)
            for i, (label, config) in enumerate(configs.items())}

    shown: dict[str, str] = {}  # label -> what its bar says while it waits (redrawn only when it changes)

    def show(label: str, text: str) -> None:
        if bars[label] is not None and shown.get(label) != text:
            shown[label] = text
            bars[label].set_postfix_str(text[:120], refresh=True)

    def in_flight(label: str) -> Estimate:
        """A running run's estimate; once its ranks all recorded done it computes no more (its supervisor
        tears down for a few seconds): its memory still counts, its cores and devices no longer."""
        run = active[label][0].run
        return estimates[label] if occupies(run) else dataclasses.replace(estimates[label], cpu_ranks=0, threads=0,
                                                                          devices=0)

    def admit() -> None:
        """Start runs from the head of the queue while the admission lets them; say why the next waits."""
        nonlocal most_at_once
        if not concurrent and active:
            show(pending[0], "queued: one run at a time")
        while pending and (concurrent or not active):
            label = pending[0]
            decision = admission.decide(estimates[label], [(in_flight(k), rss.get(k, 0)) for k in active])
            waiting = None if decision.admit else decision.describe()
            if waiting is None:
                try:
                    run = runs[label] = Run(configs[label]).start()
                except DevicesBusy as exc:  # held by a run this call did not start: wait for it
                    waiting = f"waiting for devices: {exc}"
                else:
                    pending.pop(0)
                    active[label] = (RunProgress(run), time.monotonic(), run._supervisor_pid())
                    most_at_once = max(most_at_once, sum(occupies(active[k][0].run) for k in active))
                    continue
            show(label, waiting)
            break
        for behind in pending[1:]:
            show(behind, f"queued behind {pending[0]!r}")

    def follow(label: str) -> None:
        watcher, since, supervisor = active[label]
        run = watcher.run
        if timeout_s is not None and not run.done and time.monotonic() - since > timeout_s:
            run.stop()
        step, phase = watcher.poll()
        done = run.done  # read once: the supervisor may write summary.json between two reads
        if done:
            run.wait(timeout=15)  # summary.json is there: the status is final
            step, phase = run.progress(), run.status if run.status == "finished" else f"{run.status}: {run.cause}"
            admission.learn(run.config, run.run_dir, supervisor)
        bar = bars[label]
        if bar is not None:
            bar.update(step - bar.n)
            bar.set_postfix_str(phase[:120], refresh=True)
        if done:
            if bar is not None:
                bar.close()
            if overall is not None:
                overall.update(1)
            del active[label]
            rss.pop(label, None)

    try:
        ended = True  # a run ended since the last admission (at the start: nothing runs yet)
        while pending or active:
            # Once a second (psutil walks the process trees), or at once when a run has ended.
            if ended or time.monotonic() - sampled_at >= SAMPLE_S:
                sampled_at = time.monotonic()
                rss.update({label: admission.sample(supervisor) for label, (_, _, supervisor) in active.items()})
                if pending:
                    admit()
            before = len(active)
            for label in list(active):
                follow(label)
            ended = len(active) < before
            if active or pending:
                time.sleep(poll_s)
    except KeyboardInterrupt:  # Ctrl-C in the kernel: no run it started goes on unattended
        for run in runs.values():
            run.stop()
        raise
    finally:
        for bar in bars.values():
            if bar is not None:
                bar.close()
        if overall is not None:
            overall.close()
    statuses = ", ".join(f"{label}: {run.status}" for label, run in runs.items())
    print(f"{len(runs)} run(s) in {time.monotonic() - start:.0f} s, at most {most_at_once} at once ({statuses})")
    return runs


def _bar(progress: bool, file: TextIO | None, **options: Any) -> Any:
    """A `tqdm.auto` bar (a widget in a notebook, text elsewhere), or None without `progress`."""
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(file=file if file is not None else sys.stderr, dynamic_ncols=True, **options)


def require(runs: Mapping[str, Run], status: str = "finished") -> None:
    """Raise, naming the run and DeepSpeed's cause, if a run did not end with `status`."""
    wrong = {label: run for label, run in runs.items() if run.status != status}
    if wrong:
        lines = [f"{label}: {run.status} ({run.cause}) in {run.run_dir}" for label, run in wrong.items()]
        raise RuntimeError(f"expected every run to be {status!r}:\n" + "\n".join(lines))
    line = optimizer_line(runs)
    if line:
        print(line)


def optimizer_line(runs: Mapping[str, Run]) -> str | None:
    """Which optimizer each run ran (`optimizer_impl`: fused_adam, cpu_adam, torch_adam, torch_sgd), grouped:
    an offload timing measures DeepSpeed's CPU Adam only where it says cpu_adam."""
    by_impl: dict[str, list[str]] = {}
    for label, run in runs.items():
        impl = (run.summary or {}).get("optimizer_impl")
        if impl:
            by_impl.setdefault(impl, []).append(label)
    if not by_impl:
        return None
    return "optimizer_impl: " + "; ".join(f"{impl} ({', '.join(labels)})" for impl, labels in by_impl.items())


def config_error(**fields: Any) -> str | None:
    """Build a RunConfig; return ConfigError's message if it refuses (nothing is launched), else None."""
    try:
        RunConfig(**fields)
    except ConfigError as exc:
        return str(exc)
    return None


def check(condition: Any, what: str, detail: Any = None) -> None:
    """A claim the notebook shows, printed as a line the learner reads ("Check: what ... holds").

    When it does not hold, what happens depends on the setting (`strict_checks`): in the `ci` profile on a
    CPU, where the committed reference numbers were measured and CI runs the notebooks through nbval, it
    raises AssertionError with `detail` (the cell fails). Anywhere else (the `workshop` and `full` profiles,
    any GPU) it shows a warning box with the claim, the measured `detail` and "this came out differently on
    your machine", and the notebook goes on: a workshop's Run All never halts on a number a GPU measured
    otherwise. (It returns nothing, so a cell that ends with a check shows no Out[] value.)"""
    if condition:
        _holds(f"Check: {what} -- holds")
    elif strict_checks():
        raise AssertionError(f"Check failed: {what}" + (f"\n{detail}" if detail is not None else ""))
    else:
        _show(_warning_html(what, detail), _warning_text(what, detail))


def strict_checks() -> bool:
    """True where a claim that does not hold must fail the cell: the `ci` profile on a CPU."""
    from labkit.runtime.devices import detect_devices
    from labkit.runtime.profiles import current_profile

    return current_profile() == "ci" and detect_devices().is_cpu


_folded: list[str] | None = None  # the passing checks of the open check_group, else None


@contextlib.contextmanager
def check_group(title: str) -> Iterator[None]:
    """Fold the passing checks of a block into one collapsed line ("title: 4 checks hold"); a check that
    does not hold still fails (ci) or shows its warning box (elsewhere), outside the fold."""
    global _folded
    outer, _folded = _folded, []
    try:
        yield
    finally:
        lines, _folded = _folded, outer
        if lines:
            body = "".join(f"<li>{html.escape(line)}</li>" for line in lines)
            _show(f"<details><summary>{html.escape(title)}: {len(lines)} check(s) hold</summary><ul>{body}</ul>"
                  "</details>", "\n".join(lines))


def reveal(summary: str, text: str) -> None:
    """A collapsed answer (a prediction's, an exercise's): `text` appears when the learner opens it. Blank
    lines separate paragraphs."""
    paragraphs = "".join(f"<p>{html.escape(p.strip())}</p>" for p in text.split("\n\n") if p.strip())
    _show(f"<details><summary><b>{html.escape(summary)}</b></summary>{paragraphs}</details>", f"{summary}: {text}")


def _holds(line: str) -> None:
    if _folded is not None:
        _folded.append(line)
    else:
        print(line)


def _show(html_text: str, plain: str) -> None:
    """HTML in a notebook (a running IPython kernel), plain text elsewhere (scripts, tests)."""
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython comes with the lab extras
        get_ipython = None
    if get_ipython is not None and get_ipython() is not None and hasattr(get_ipython(), "kernel"):
        from IPython.display import HTML, display

        display(HTML(html_text))
    else:
        print(plain)


def _detail_text(detail: Any) -> str:
    if detail is None:
        return "(no detail recorded)"
    if isinstance(detail, pd.DataFrame | pd.Series):
        return detail.to_string(max_rows=20)
    return str(detail)


def _warning_text(what: str, detail: Any) -> str:
    return (f"WARNING: this came out differently on your machine: the claim \"{what}\" does not hold here.\n"
            f"Measured: {_detail_text(detail)}\nThe notebook goes on; the reference results show what it "
            "claims on the machine they were measured on.")


def _warning_html(what: str, detail: Any) -> str:
    measured = (detail.to_html(max_rows=20) if isinstance(detail, pd.DataFrame) else
                f"<pre>{html.escape(_detail_text(detail))}</pre>")
    return ("<div style='border:2px solid #d97706;background:#fff7ed;padding:.6em;margin:.4em 0'>"
            "<b>&#9888; This came out differently on your machine.</b><br>"
            f"<b>Claim:</b> {html.escape(what)}<br><b>Measured:</b> {measured}"
            "The notebook goes on: the reference results show this claim on the machine they were measured on; "
            "yours measured otherwise (another device, another load). Read the figures with that in mind.</div>")


# -- tables ------------------------------------------------------------------------------
def mib(value: float | None) -> float | None:
    return None if value is None else value / MiB


def summary_table(runs: Mapping[str, Run], columns: Sequence[str] = SUMMARY_COLUMNS) -> pd.DataFrame:
    """One row per run (index: its label) with the summary's headline numbers."""
    rows = {label: {key: (run.summary or {}).get(key) for key in columns} for label, run in runs.items()}
    return pd.DataFrame.from_dict(rows, orient="index", columns=list(columns))


def rank_table(runs: Mapping[str, Run], columns: Sequence[str] = RANK_COLUMNS, *, in_mib: bool = True) -> pd.DataFrame:
    """One row per (run, rank) with what that rank held; bytes shown in MiB unless `in_mib=False`.

    Columns no rank recorded (device peak on CPU, for one) are dropped.
    """
    rows = []
    for label, run in runs.items():
        for rank, values in sorted(((run.summary or {}).get("per_rank") or {}).items(), key=lambda kv: int(kv[0])):
            row = {"run": label, "rank": int(rank)}
            for key in columns:
                value = values.get(key)
                row[key.replace("_bytes", "_MiB") if in_mib else key] = mib(value) if in_mib else value
            rows.append(row)
    table = pd.DataFrame(rows).set_index(["run", "rank"])
    return table.dropna(axis=1, how="all")


def last_census(run: Run, rank: int = 0) -> dict[str, Any]:
    """The rank's last per-step record that carries a model-state census (`param_bytes`, ...)."""
    census = [r for r in run.records().get(rank, []) if "param_bytes" in r]
    if not census:
        raise ValueError(f"rank {rank} of {run.run_dir} recorded no model-state census")
    return census[-1]


def offload_traffic(run: Run, rank: int = 0) -> dict[str, float]:
    """Bytes that cross between device and host each optimizer step with `offload_optimizer`,
    per rank, from the rank's measured census: its partition has `optim_bytes / 8` elements
    (Adam's two fp32 moments each). Gradients go down in fp32 whatever the training precision:
    ZeRO casts them to the fp32 master's dtype on the device before the copy (DeepSpeed 0.19.8:
    `runtime/zero/stage_1_and_2.py:1899-1909`, `stage3.py:1457`). The updated parameters come back
    in the training precision: the fp32 master is cast into a host buffer of the parameters' dtype,
    which is copied up (`stage_1_and_2.py:566-575, 3094-3096`; `stage3.py:2858`, a blocking copy,
    which torch converts on the host before the transfer). bf16/fp16: 4 + 2 = 6 bytes per element,
    fp32: 4 + 4 = 8. On a GPU these copies cross PCIe (or NVLink-C2C); on the CPU accelerator they
    are memory copies."""
    elements = last_census(run, rank)["optim_bytes"] / 8
    size = 4 if run.config.precision == "fp32" else 2
    return {"partition_elements": elements, "to_host_bytes": elements * 4, "to_device_bytes": elements * size}


def source_line(function: Any, contains: str) -> str:
    """The first line of `function`'s source (DeepSpeed's, say) that contains `contains`, with
    its file and line number: to show in a notebook what the installed version does. Decorators
    are looked through: those that keep `__wrapped__` (torch.no_grad()) and those that only close
    over the function (DeepSpeed's `instrument_w_nvtx`)."""
    import inspect

    candidates = [inspect.unwrap(function)]  # through decorators such as torch.no_grad()
    candidates += [cell.cell_contents for cell in candidates[0].__closure__ or ()
                   if inspect.isfunction(cell.cell_contents)]
    for candidate in candidates:
        lines, first = inspect.getsourcelines(candidate)
        for offset, line in enumerate(lines):
            if contains in line:
                path = Path(inspect.getsourcefile(candidate) or "?")
                return f"{'/'.join(path.parts[-3:])}:{first + offset}: {line.strip()}"
    raise ValueError(f"{contains!r} is not in the source of {function!r} (another DeepSpeed version?)")


def partition_rows(runs: Mapping[str, Run]) -> pd.DataFrame:
    """One row per (run, rank) with the run's ZeRO `stage`, the `rank` and its model-state MiB:
    the input of `labkit.study.figures.zero_partition_figure`."""
    table = rank_table(runs, STATE_COLUMNS).reset_index()
    stages = {label: run.config.stage for label, run in runs.items()}
    table.insert(1, "stage", table["run"].map(stages))
    return table


def epoch_progress(runs: Mapping[str, Run]) -> pd.DataFrame:
    """Per run: how many steps an epoch takes, the samples/s the worker counts (every rank's
    samples) and the unique samples/s (measured progress through the dataset: dataset size x
    epochs per step / step time), and how many times the first overstates the second."""
    rows = {}
    for label, run in runs.items():
        records = step_records(run)
        epochs_per_step = records["epoch"].iloc[-1] / len(records)
        summary = run.summary
        if summary is None:
            raise ValueError(f"{label}: {run.status} without a summary.json, so no step time to read")
        step_time = summary["median_step_time_s"]
        counted = summary["samples_per_s"]
        unique = run.config.dataset_size * epochs_per_step / step_time
        rows[label] = {"world_size": run.config.world_size, "distributed_sampler": run.config.distributed_sampler,
                       "global_batch": run.config.global_batch, "steps_per_epoch": 1 / epochs_per_step,
                       "samples_per_s (counted)": counted, "unique samples_per_s": unique,
                       "overstated_x": counted / unique}
    return pd.DataFrame.from_dict(rows, orient="index")


def sampler_overlap(dataset_size: int, micro_batch: int, world_size: int, steps: int = 4,
                    seed: int = 0) -> pd.DataFrame:
    """What the ranks read, sampled with the worker's own `labkit.models.data.make_sampler` (no run):
    per data-loading mode and step, how many distinct samples the global batch of
    `world_size` micro-batches holds. Modes: a DistributedSampler; no sampler, each rank its
    own seed (the seed text's loader in labkit); no sampler with the same seed on every rank.
    The dataset must hold `steps` global batches (a DistributedSampler's shard is dataset_size / world_size)."""
    from torch.utils.data import BatchSampler

    from labkit.models.data import make_dataset, make_sampler

    micro_batch, world_size, steps = (whole_number(name, value) for name, value in
                                      (("micro_batch", micro_batch), ("world_size", world_size), ("steps", steps)))
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    needed = micro_batch * world_size * steps
    if whole_number("dataset_size", dataset_size, maximum=LESSON_MAX_SAMPLES) < needed:
        raise ValueError(f"dataset_size must be >= micro_batch x world_size x steps = {micro_batch} x {world_size} "
                         f"x {steps} = {needed} (each rank's shard must hold {steps} micro-batches), "
                         f"got {dataset_size!r}")
    dataset = make_dataset(dataset_size, 1, 2, seed)
    modes = {"DistributedSampler": dict(distributed_sampler=True),
             "no sampler, seed per rank": dict(distributed_sampler=False),
             "no sampler, same seed on every rank": dict(distributed_sampler=False, same_seed_every_rank=True)}
    rows = []
    for mode, options in modes.items():
        loaders = []
        for rank in range(world_size):
            sampler, _ = make_sampler(dataset, world_size=world_size, rank=rank, seed=seed, **options)
            # How a DataLoader groups its sampler's indices into micro-batches.
            loaders.append(iter(BatchSampler(sampler, batch_size=micro_batch, drop_last=True)))
        for step in range(1, steps + 1):
            picked = [next(loader) for loader in loaders]
            distinct = len({i for batch in picked for i in batch})
            rows.append({"mode": mode, "step": step, "samples read": micro_batch * world_size,
                         "distinct samples": distinct, "micro-batches' worth": distinct / micro_batch})
    return pd.DataFrame(rows)


def deepspeed_loader_shards(dataset_size: int, world_size: int, micro_batch: int) -> pd.DataFrame:
    """The loader DeepSpeed builds from `deepspeed.initialize(training_data=...)`: the engine's
    `deepspeed_io` makes a `DeepSpeedDataLoader` with the data-parallel size and rank; built
    here for each rank (no process group needed) to show its sampler's shard."""
    from deepspeed.runtime.dataloader import DeepSpeedDataLoader

    from labkit.models.data import make_dataset

    dataset_size = whole_number("dataset_size", dataset_size, maximum=LESSON_MAX_SAMPLES)
    world_size, micro_batch = whole_number("world_size", world_size), whole_number("micro_batch", micro_batch)
    dataset = make_dataset(dataset_size, 1, 2, 0)
    shards = {}
    for rank in range(world_size):
        loader = DeepSpeedDataLoader(dataset, batch_size=micro_batch, pin_memory=False, local_rank=rank,
                                     tput_timer=None, data_parallel_world_size=world_size,
                                     data_parallel_rank=rank)
        shards[rank] = (type(loader.data_sampler).__name__, set(loader.data_sampler))
    from collections import Counter

    seen = Counter(index for _, indices in shards.values() for index in indices)
    return pd.DataFrame([{"rank": rank, "sampler": name, "samples per epoch": len(indices),
                          "shared with another rank": sum(seen[i] > 1 for i in indices)}
                         for rank, (name, indices) in shards.items()]).set_index("rank")


def step_records(run: Run, rank: int = 0) -> pd.DataFrame:
    """The per-step records of one rank as a table (step, loss, epoch, times, bytes...)."""
    records = [r for r in run.records().get(rank, []) if r.get("event") == "step"]
    return pd.DataFrame(records).set_index("step") if records else pd.DataFrame()


def maxbatch_result(runs: Mapping[str, Run], capacity_bytes: int, *, emulated: bool):
    """Runs of one configuration at several micro-batches, read as a max-batch search.

    Returns a `labkit.study.maxbatch.MaxBatchResult` whose probes are these runs (sorted by
    micro-batch; counted bytes as `labkit.study.sweep.row_from_run` reads them), so its
    `activation_fit()`, `predicted_max_micro_batch` and `consistent()` are the max-batch
    search's own. `capacity_bytes`: the emulated budget (CPU) or the device's memory (GPU).
    """
    from labkit.study.maxbatch import MaxBatchResult, Probe, int_or_none
    from labkit.study.sweep import row_from_run, strategy_of

    probes = []
    for run in sorted(runs.values(), key=lambda r: r.config.micro_batch):
        if run.run_dir is None:
            raise ValueError(f"a run at micro-batch {run.config.micro_batch} was never started")
        row = row_from_run(run.run_dir) or {}
        probes.append(Probe(run.config.micro_batch, run.status, int_or_none(row.get("device_bytes")),
                            int_or_none(row.get("activation_bytes")), row.get("run_id"), False))
    first = next(iter(runs.values())).config
    return MaxBatchResult(strategy=strategy_of(first), world_size=first.world_size, budget_bytes=capacity_bytes,
                          emulated=emulated, max_micro_batch=max((p.micro_batch for p in probes if p.fits), default=0),
                          first_oom=min((p.micro_batch for p in probes if p.status == "oom"), default=None),
                          probes=probes)


# -- charts ------------------------------------------------------------------------------
def stacked_bars(table: pd.DataFrame, columns: Sequence[str], *, title: str, yaxis: str,
                 xaxis: str | None = None):
    """A static stacked bar chart: one bar per row of `table`, one segment per column."""
    import plotly.graph_objects as go

    x = [" / ".join(map(str, i)) if isinstance(i, tuple) else str(i) for i in table.index]
    fig = go.Figure([go.Bar(name=c, x=x, y=table[c]) for c in columns if c in table])
    fig.update_layout(barmode="stack", title=title, yaxis_title=yaxis, xaxis_title=xaxis or table.index.name,
                      height=380, margin=dict(t=50, b=40))
    return fig


def line_chart(table: pd.DataFrame, x: str, ys: str | Sequence[str], *, title: str, yaxis: str,
               log_x: bool = False, log_y: bool = False, markers: bool = True):
    """A static line chart of column(s) `ys` against column `x` of `table`."""
    import plotly.graph_objects as go

    ys = [ys] if isinstance(ys, str) else list(ys)  # one column's name, not its letters
    missing = [c for c in (x, *ys) if c not in table]
    if missing:  # a misspelled column drew an empty chart
        raise ValueError(f"no column {', '.join(map(repr, missing))} in the table; it has {list(table.columns)}")
    mode = "lines+markers" if markers else "lines"
    fig = go.Figure([go.Scatter(name=y, x=table[x], y=table[y], mode=mode) for y in ys])
    fig.update_layout(title=title, xaxis_title=x, yaxis_title=yaxis, height=380, margin=dict(t=50, b=40))
    if log_x:
        fig.update_xaxes(type="log")
    if log_y:
        fig.update_yaxes(type="log")
    return fig


# -- what DeepSpeed communicated ---------------------------------------------------------
def comms_logger_overrides() -> dict[str, Any]:
    """`ds_overrides` that make DeepSpeed log every collective it runs, with the DeepSpeed
    function that called it (one line each in rank 0's log).

    The comms logger reports at INFO level and DeepSpeed's logger defaults to WARNING, so the
    run's top-level `log_level` (read by `DeepSpeedConfig`, applied by the engine) must be
    "info" too; otherwise the run logs nothing and `comm_log` comes back empty.
    """
    return {"comms_logger": {"enabled": True, "verbose": True, "prof_all": True, "debug": True},
            "log_level": "info", "steps_per_print": 1}  # "step=N" after each step: where `comm_log` splits steps


_COMM_LINE = re.compile(r"^\[(?P<when>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\].*?comm op: (?P<op>[\w.]+)"
                        r"(?: \| \[Caller Func: (?P<caller>[^\]]*)\])? \| time \(ms\): (?P<ms>[\d.]+) "
                        r"\| msg size: (?P<size>[\d.]+) ?(?P<unit>[KMGT]?B)", re.MULTILINE)
_SIZE_UNITS = {"B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40}
# DeepSpeed's progress line after each optimizer step (engine._report_progress, steps_per_print 1), rank 0's log.
_STEP_LINE = re.compile(r"^\[[^\]]*\].*?\bstep=(?P<step>\d+), skipped=\d+", re.MULTILINE)


def rank_log_text(run: Run, rank: int = 0) -> str:
    """Everything rank `rank` printed (DeepSpeed's launcher writes one log per rank)."""
    if run.run_dir is None:
        raise ValueError("the run was never started: it has no logs")
    return rank_logs_text(run.run_dir, rank)


def _step_ends(run: Run, rank: int) -> tuple[float | None, list[tuple[int, float]]]:
    """(wall time the rank became ready, [(step, wall time the step ended)]) from its records."""
    records = run.records().get(rank, [])
    start = next((r for r in records if r.get("event") == "start"), None)
    if start is None:
        return None, []
    origin = start["wall_time"] - start["time_s"]
    ready = next((origin + r["time_s"] for r in records if r.get("event") == "ready"), None)
    return ready, [(r["step"], origin + r["time_s"]) for r in records if r.get("event") == "step"]


def comm_log(run: Run, rank: int = 0) -> pd.DataFrame:
    """Every collective the comms logger recorded (a run launched with `comms_logger_overrides()`).

    One row per call, in order: the operation, the DeepSpeed function that called it,
    its message size in bytes as DeepSpeed reports it, its time, and the phase it fell in:
    "setup" (before the first step), the optimizer step it belongs to, or "teardown".
    Setup is what the log's millisecond timestamps put before the rank's `ready` record. Steps are split at
    DeepSpeed's own "step=N" lines (`comms_logger_overrides()` turns them on), which sit in the same log,
    in order with the collectives; without them, by timestamp against the step records, which cannot
    tell apart a step's last collective and the next one's first when less than a millisecond separates
    them (it happens: steps of this lab's MLP are a few ms apart on 2 cores).
    """
    import bisect
    from datetime import datetime

    ready, ends = _step_ends(run, rank)
    text = rank_log_text(run, rank)
    # Where each step's end is logged, and which step (the engine also logs "step=0" at its start).
    found = [(m.start(), int(m["step"])) for m in _STEP_LINE.finditer(text)]
    marks, marked = [at for at, _ in found], [step for _, step in found]
    rows = []
    for match in _COMM_LINE.finditer(text):
        when = datetime.strptime(match["when"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if ready is None or when < ready:
            phase: str | int = "setup"
        elif marks:
            before = bisect.bisect(marks, match.start())  # step lines logged before this collective
            done = marked[before - 1] if before else 0  # the last step that had ended
            phase = done + 1 if done < len(ends) else "teardown"
        else:
            phase = next((step for step, end in ends if when <= end), "teardown")
        rows.append({"phase": phase, "op": match["op"], "called from": (match["caller"] or "").strip(),
                     "bytes": float(match["size"]) * _SIZE_UNITS[match["unit"]], "ms": float(match["ms"])})
    return pd.DataFrame(rows, columns=["phase", "op", "called from", "bytes", "ms"])


def comm_ops(run: Run, rank: int = 0, first_steps: int = 2) -> pd.DataFrame:
    """The collectives of `comm_log`, counted by phase: setup, the first `first_steps` steps
    together (ZeRO-3 records and cross-checks its module trace there), and the mean of the
    later steps."""
    log = comm_log(run, rank)
    later = sorted({p for p in log["phase"] if isinstance(p, int) and p > first_steps})
    early = f"steps 1-{first_steps} (total)" if first_steps > 1 else "step 1"
    log["when"] = [p if isinstance(p, str) else early if p <= first_steps else "each later step (mean)"
                   for p in log["phase"]]
    table = log.groupby(["when", "op", "called from"], sort=False).agg(
        calls=("bytes", "size"), MiB=("bytes", "sum")).reset_index()
    table["calls"] = table["calls"].astype(float)
    mean = table["when"] == "each later step (mean)"
    if later:
        table.loc[mean, "calls"] = table.loc[mean, "calls"] / len(later)
        table.loc[mean, "MiB"] = table.loc[mean, "MiB"] / len(later)
    table["MiB"] = table["MiB"] / MiB
    return table


def zero3_tensors(config: RunConfig, threshold: int | None = None) -> pd.DataFrame:
    """The parameter tensors of the run's MLP in forward order: elements, bytes at the run's
    precision, and whether ZeRO-3 keeps each whole on every rank ("persistent": at most
    `threshold` elements, DeepSpeed's `stage3_param_persistence_threshold`, default 100,000).
    Cross-checked against `labkit.core.memory.mlp_persistent_params`."""
    import torch
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from labkit.core import memory
    from labkit.models.mlp import SimpleModel

    if threshold is None:
        threshold = DeepSpeedZeroConfig().param_persistence_threshold
    size = torch.empty(0, dtype={"fp32": torch.float32, "bf16": torch.bfloat16,
                                 "fp16": torch.float16}[config.precision]).element_size()
    with torch.device("meta"):  # shapes only: no memory, no initialisation (a GPU-sized model costs nothing)
        mlp = SimpleModel(config.input_size, config.hidden, config.output_size, config.depth)
    table = pd.DataFrame([{"tensor": name, "module": name.rsplit(".", 1)[0], "elements": p.numel(),
                           "bytes": p.numel() * size, "persistent": p.numel() <= threshold}
                          for name, p in mlp.named_parameters()])
    persistent = memory.mlp_persistent_params(config.input_size, config.hidden, config.depth, config.output_size,
                                              threshold=threshold)
    if table.loc[table["persistent"], "elements"].sum() != persistent:
        raise AssertionError("labkit.core.memory.mlp_persistent_params disagrees with the model's tensors")
    table.attrs["threshold"] = threshold
    return table


def zero3_step_pattern(run: Run, tensors: pd.DataFrame, step: int | None = None) -> dict[str, Any]:
    """Read one step of rank 0's communication log (a ZeRO-3 run with `comms_logger_overrides()`,
    `stage3_max_reuse_distance: 0`, `stage3_prefetch_bucket_size: 0`) against the ZeRO-3
    pattern. Returns the step's log and what it shows; the `*_ok` entries say whether each
    part of the pattern holds:

    - `gathers_ok`: before the first reduce-scatter, one all-gather per module with
      partitioned parameters in forward order, then again in backward (reverse) order, each
      of one rank's shard;
    - `scatter_ok`: the reduce-scatter(s) carry every gradient;
    - `persistent_ok`: after them, all-gathers of the persistent parameters only.
    DeepSpeed logs sizes rounded to 2 decimals of their unit, hence the tolerances.
    """
    step = min(3, run.config.steps) if step is None else step
    log = comm_log(run)
    one = log[log["phase"] == step].drop(columns="phase").reset_index(drop=True)
    ranks = run.config.world_size

    def close(measured: list[float], expected: list[float]) -> bool:
        # Lengths compared first, so strict=True only restates what was checked.
        return len(measured) == len(expected) and all(
            abs(m - e) <= 0.01 * e for m, e in zip(measured, expected, strict=True))

    gathers = one["op"].str.startswith("all_gather")
    scatters = one.index[one["op"].str.startswith("reduce_scatter")]
    part = tensors[~tensors["persistent"]]
    modules = list(dict.fromkeys(part["module"]))  # forward order
    forward = [part.loc[part["module"] == m, "bytes"].sum() / ranks for m in modules]
    first = scatters[0] if len(scatters) else len(one)
    gathered = one.loc[gathers & (one.index < first), "bytes"].tolist()
    scattered, all_grads = one.loc[scatters, "bytes"].sum(), tensors["bytes"].sum()
    after = sorted(one.loc[gathers & (one.index > (scatters[-1] if len(scatters) else len(one))), "bytes"])
    return {"step": step, "log": one, "modules": modules, "ranks": ranks,
            "gathers_ok": close(gathered, forward + forward[::-1]), "gathered": gathered,
            "expected_gathers": forward + forward[::-1],
            "scatters": len(scatters),
            "scatter_ok": len(scatters) > 0 and abs(scattered - all_grads) <= 0.02 * all_grads,
            "scattered_bytes": scattered, "gradient_bytes": all_grads,
            "persistent_ok": close(after, sorted(tensors.loc[tensors["persistent"], "bytes"] / ranks)),
            "persistent_gathers": len(after)}


def step_timeline(run: Run, step: int | None = None) -> pd.DataFrame:
    """Spans of one step, per rank, for `labkit.study.figures.timeline_figure`: each rank's forward,
    backward and optimizer phases (its own records; placed back to back, ending at the
    step's record, so within a millisecond or two) and the collectives of rank 0's
    communication log (DeepSpeed's comms logger prints on rank 0 only; every rank takes part
    in each collective). Times in ms from the start of rank 0's step."""
    from datetime import datetime

    step = min(3, run.config.steps) if step is None else step
    spans = []
    for rank in range(run.config.world_size):
        records = run.records().get(rank, [])
        start = next((r for r in records if r.get("event") == "start"), None)
        record = next((r for r in records if r.get("event") == "step" and r["step"] == step), None)
        if start is None or record is None:
            continue
        end = start["wall_time"] - start["time_s"] + record["time_s"]
        for phase in ("optimizer", "backward", "forward"):
            spans.append({"lane": f"rank {rank}", "kind": phase, "start": end - record[f"{phase}_s"], "end": end,
                          "label": f"rank {rank} {phase} {record[f'{phase}_s'] * 1e3:.1f} ms"})
            end -= record[f"{phase}_s"]
    ready, ends = _step_ends(run, 0)
    for match in _COMM_LINE.finditer(rank_log_text(run, 0)):
        when = datetime.strptime(match["when"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        previous = dict(ends).get(step - 1, ready)
        if previous is None or not (previous < when <= dict(ends).get(step, 0)):
            continue
        ms = float(match["ms"])
        spans.append({"lane": "collectives (rank 0's log)", "kind": match["op"], "start": when - ms / 1e3,
                      "end": when, "label": f"{match['op']} {match['size']} {match['unit']} {ms:.2f} ms "
                                            f"({(match['caller'] or '').strip()})"})
    table = pd.DataFrame(spans, columns=["lane", "kind", "start", "end", "label"])
    origin = table.loc[table["lane"] == "rank 0", "start"].min() if len(table) else 0.0
    table["start_ms"] = (table.pop("start") - origin) * 1e3
    table["end_ms"] = (table.pop("end") - origin) * 1e3
    return table


# -- environment (00-setup) --------------------------------------------------------------
def ds_report(lines: Sequence[str] = ("torch version", "deepspeed info", "deepspeed wheel compiled",
                                      "torch install path", "deepspeed install path", "shared memory",
                                      "cpu_adam", "fused_adam", "deepspeed_shm_comm"),
              timeout_s: float = 300) -> str:
    """The lines of DeepSpeed's environment report (`ds_report`) that mention any of `lines`.

    Runs `python -m deepspeed.env_report` in a subprocess (it is what the `ds_report`
    command runs), so this kernel's state does not matter.
    """
    result = subprocess.run([sys.executable, "-m", "deepspeed.env_report"], capture_output=True, text=True,
                            timeout=timeout_s)
    text = re.sub(r"\x1b\[[0-9;]*m", "", result.stdout)  # drop the colour codes
    wanted = [line.rstrip() for line in text.splitlines() if any(key in line.lower() for key in lines)]
    return "\n".join(wanted) if wanted else text[-2000:]


def build_ops(timeout_s: float = 1800, *, progress: bool = True, file: TextIO | None = None) -> str:
    """Build (or load from the cache) DeepSpeed's JIT ops in a child process: `python -m labkit.runtime.ops`.

    Not in this kernel: on a GPU, loading the CUDA ops would give the kernel a device context
    on GPU 0 that rank 0 then shares for the whole session. The child's output (the compiler's
    included: a first build takes minutes) is streamed to `file` (default stdout) as it comes, under
    a `tqdm.auto` bar over DeepSpeed's builders. Returns the lines that say what became of each op;
    raises with the end of the build log on failure or past `timeout_s`."""
    import threading

    from labkit.runtime.ops import BUILDERS

    out = file if file is not None else sys.stdout
    bar = _bar(progress, file, total=len(BUILDERS), unit="op", desc="DeepSpeed ops")
    child = subprocess.Popen([sys.executable, "-u", "-m", "labkit.runtime.ops"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, bufsize=1)
    timer = threading.Timer(timeout_s, child.kill)  # a hung compiler must not hang the notebook
    timer.start()
    lines: list[str] = []
    try:
        assert child.stdout is not None
        for line in child.stdout:
            line = line.rstrip("\n")
            lines.append(line)
            if bar is not None:
                bar.write(line, file=out)  # above the bar, not through it
                name = line.split(":", 1)[0]
                if name in BUILDERS and ("ready in" in line or "skipped" in line):
                    bar.set_postfix_str(name)
                    bar.update(1)
            else:
                print(line, file=out, flush=True)
        returncode = child.wait()
    finally:
        timer.cancel()
        if child.poll() is None:
            child.kill()
            child.wait()
        if bar is not None:
            bar.close()
    if returncode != 0:
        why = f"killed after {timeout_s:g} s" if returncode == -9 else f"exit code {returncode}"
        raise RuntimeError(f"building DeepSpeed's ops failed ({why}):\n" + "\n".join(lines)[-5000:])
    return "\n".join(line for line in lines if ": " in line and "WARNING" not in line)


# -- DeepSpeed's own batch check, without launching ----------------------------------------
class _DataParallelGroup:
    """What `DeepSpeedConfig` asks its `mpu` argument: the data-parallel world size."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    def get_data_parallel_world_size(self) -> int:
        return self.world_size


# The batch keys DeepSpeedConfig derives the triplet from (it does arithmetic on them, unchecked).
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def deepspeed_batch_check(ds_config: dict[str, Any], world_size: int) -> str:
    """What DeepSpeed's own config parser makes of a config's batch keys on `world_size` ranks.

    Builds `deepspeed.runtime.config.DeepSpeedConfig` in this process, telling it the
    data-parallel size instead of starting ranks. Returns the derived triplet, or the
    assertion DeepSpeed would stop every rank with after they had started. A batch key that is not an integer,
    or `world_size` below 1, is a ValueError (DeepSpeed would fail on it with a TypeError or ZeroDivisionError).
    """
    from unittest import mock

    if not isinstance(ds_config, Mapping):
        raise ValueError(f"ds_config must be a dict (a DeepSpeed config), got {type(ds_config).__name__}")
    world_size = whole_number("world_size", world_size)
    for key in BATCH_KEYS:
        value = ds_config.get(key)
        if value is not None and (not isinstance(value, numbers.Integral) or isinstance(value, bool)):
            raise ValueError(f"ds_config[{key!r}] must be an integer (or absent), got {value!r}")

    from deepspeed.runtime.config import DeepSpeedConfig

    try:
        # No process group exists here; DeepSpeedConfig only asks it for this rank's number.
        with mock.patch("deepspeed.comm.get_rank", return_value=0):
            parsed = DeepSpeedConfig(dict(ds_config), mpu=_DataParallelGroup(world_size))
    except AssertionError as exc:
        return f"DeepSpeed refuses it: AssertionError: {exc}"
    except ZeroDivisionError as exc:  # a batch key of 0, divided by before DeepSpeed's own assertions
        return f"DeepSpeed fails on it: ZeroDivisionError: {exc} (a batch key of 0)"
    return (f"DeepSpeed accepts it: train_batch_size {parsed.train_batch_size} = micro "
            f"{parsed.train_micro_batch_size_per_gpu} x accumulation {parsed.gradient_accumulation_steps} "
            f"x {world_size} rank(s)")


# -- the LR rules, measured (04) -----------------------------------------------------------
# The runs of notebook 04's two LR lessons, per model: small on purpose (a few seconds each on 2 CPU
# cores) and the same on every profile, since the rules are about the optimizer and the batch, not
# the model's size. Picked on the ci machine (2026-11-23) from in-process sweeps of the same model,
# data and schedule over LRs and seeds 0-2:
# - `sgd`: plain SGD (DeepSpeed's "SGD" is torch's, momentum 0) at the base batch and at `factor`
#   times it. At lr 0.1 (batch 64) the 4x batch with 0.4 follows the base curve to within ~20% at the
#   end (1.29 vs 1.02); with 0.1 kept it ends at 2.17, barely below chance (ln 10 = 2.30).
# - `warmup`: Adam at 0.05. Without warmup the first full-size steps throw the loss to several times
#   its start and it stalls near 2.0-2.1 on every seed tried; with 4096 warmup samples it falls to
#   1.37-1.49 (then creeps up at the peak LR). Plain SGD on this MLP showed no such clean split: at
#   LRs that diverge it diverged, or not, with and without warmup, depending on the seed.
# Only the MLP has settings: the GPT's were not measured (`lr_lesson_model` says so and uses the MLP).
LR_LESSONS: dict[str, dict[str, dict[str, Any]]] = {
    "mlp": {
        "sgd": dict(fields=dict(model="mlp", hidden=256, depth=2, dataset_size=8192, eval_samples=1024),
                    lr=0.1, base_batch=64, factor=4, samples=16384, eval_every_samples=1024),
        "warmup": dict(fields=dict(model="mlp", hidden=256, depth=2, dataset_size=8192, eval_samples=1024),
                       optimizer="adam", lr=0.05, batch=128, warmup_samples=4096, samples=8192,
                       eval_every_samples=512),
    },
}


def lr_lesson_model(model: str) -> str:
    """The model the LR lessons train for `model`: itself if it has settings in `LR_LESSONS`,
    else the MLP, with a line saying so."""
    if model in LR_LESSONS:
        return model
    print(f"the LR lessons have measured settings for {sorted(LR_LESSONS)} only; they train the MLP, not {model!r}")
    return "mlp"


def _lesson(model: str, which: str) -> dict[str, Any]:
    if model not in LR_LESSONS:
        raise ValueError(f"no LR lesson settings for model {model!r}; one of {sorted(LR_LESSONS)}")
    return LR_LESSONS[model][which]


def _lesson_run(fields: Mapping[str, Any], *, batch: int, samples: int, eval_every_samples: int,
                **settings: Any) -> RunConfig:
    """One run of `samples` samples at global batch `batch` on one DeepSpeed rank (stage 0: the
    rule is the optimizer's, ZeRO does not change it), its held-out loss every `eval_every_samples`."""
    return RunConfig(example="deepspeed", stage=0, world_size=1, micro_batch=batch, steps=samples // batch,
                     eval_every=max(1, eval_every_samples // batch), census_every=10**6, **fields, **settings)


def sgd_scaling_configs(model: str = "mlp") -> dict[str, RunConfig]:
    """SGD on the same number of samples three ways: the base batch at its LR $\\eta$; `factor` times
    the batch with the LR scaled linearly ($k\\eta$, Goyal et al. 2017); `factor` times the batch at
    the same $\\eta$. Every run sees the same samples, so their loss-by-samples curves compare."""
    s = _lesson(model, "sgd")
    base, big = s["base_batch"], s["base_batch"] * s["factor"]
    common = dict(fields=s["fields"], samples=s["samples"], eval_every_samples=s["eval_every_samples"],
                  optimizer="sgd", lr=s["lr"], base_batch=base)
    return {f"batch {base}, LR {s['lr']:g}": _lesson_run(batch=base, **common),
            f"batch {big}, LR x{s['factor']} (linear)": _lesson_run(batch=big, lr_scaling="linear", **common),
            f"batch {big}, LR {s['lr']:g} (kept)": _lesson_run(batch=big, lr_scaling="none", **common)}


def warmup_configs(model: str = "mlp") -> dict[str, RunConfig]:
    """One large LR, from the first step and after a linear warmup over `warmup_samples`."""
    s = _lesson(model, "warmup")
    common = dict(fields=s["fields"], batch=s["batch"], samples=s["samples"],
                  eval_every_samples=s["eval_every_samples"], optimizer=s["optimizer"], lr=s["lr"],
                  base_batch=s["batch"])
    return {f"LR {s['lr']:g}, no warmup": _lesson_run(**common),
            f"LR {s['lr']:g}, warmup {s['warmup_samples']} samples": _lesson_run(
                warmup_samples=s["warmup_samples"], **common)}


def loss_by_samples(runs: Mapping[str, Run], column: str = "eval_loss") -> pd.DataFrame:
    """Rank 0's `column` (the held-out `eval_loss`, or the training `loss`) against the samples
    the run had trained on when it was measured (step x global batch): one row per (run, record),
    non-finite losses (a diverged run) kept as they were recorded."""
    rows = []
    for label, run in runs.items():
        records = step_records(run)
        if records.empty or column not in records:
            raise ValueError(f"{label}: no {column!r} in rank 0's step records ({run.status}, {run.run_dir})")
        measured = records[column].dropna() if column == "eval_loss" else records[column]
        rows += [{"run": label, "samples": int(step) * run.config.global_batch, "step": int(step),
                  "lr": float(records.at[step, "lr"]), column: float(value)} for step, value in measured.items()]
    return pd.DataFrame(rows)


def curve_gap(curves: pd.DataFrame, a: str, b: str, column: str = "eval_loss") -> float:
    """How far apart two runs' loss-by-samples curves are: the mean of |ln(loss_a / loss_b)| over
    the samples both measured at (0.1 is about 10% apart). Infinite if either diverged there."""
    import numpy as np

    one = curves[curves["run"] == a].set_index("samples")[column]
    other = curves[curves["run"] == b].set_index("samples")[column]
    shared = one.index.intersection(other.index)
    if shared.empty:
        raise ValueError(f"{a!r} and {b!r} share no measured sample count")
    with np.errstate(divide="ignore", invalid="ignore"):  # a diverged run's inf and nan: the gap is inf
        ratio = np.log(one[shared].to_numpy(dtype=float) / other[shared].to_numpy(dtype=float))
    return float(np.mean(np.abs(ratio))) if np.isfinite(ratio).all() else float("inf")


def diverged(run: Run, factor: float = 1.5, column: str = "loss") -> bool:
    """Whether rank 0's loss (the training loss, every step) blew up: left the finite numbers (nan,
    inf) or rose above `factor` times its first value."""
    import math

    losses = [float(v) for v in step_records(run)[column].dropna()]
    return bool(losses) and (not all(math.isfinite(v) for v in losses) or max(losses) > factor * losses[0])


# -- ZeRO-3's reuse distance and peak memory (03) -------------------------------------------
def reuse_distance(run: Run) -> int:
    """The run's `stage3_max_reuse_distance`: its override, else DeepSpeed's default (1e9)."""
    return int(run.config.zero_settings().max_reuse_distance)


def reuse_kept_gathered(tensors: pd.DataFrame, max_reuse_distance: int) -> pd.Series:
    """Which modules with partitioned parameters ZeRO-3 keeps gathered from their forward to their
    backward (True) rather than releasing and gathering again (False), by DeepSpeed's rule for a
    model that runs its modules once each (this MLP; `tensors`: `zero3_tensors`).

    DeepSpeed 0.19.8, `runtime/zero/partitioned_param_coordinator.py`: after a module's forward,
    `__params_to_release` (lines 653-662) walks the recorded module order from the next module on
    (the step id was advanced at the end of the fetch, line 490) and keeps every parameter it meets
    again before it has counted `max_reuse_distance` elements (every parameter of each module it
    passes, persistent ones included). Between a module's forward and its backward lie the rest of
    the forward and those same modules again in the backward: twice the parameters after it. So with
    the default 1e9 a model stays gathered whole only while 2 x (its parameters after the first
    layer) < 1e9, about 0.5B parameters. Gathers before the reduce-scatter: 1 per kept module, 2
    per released one."""
    numels = tensors.groupby("module", sort=False)["elements"].sum()
    order = [int(numels[m]) for m in numels.index] + [int(numels[m]) for m in reversed(numels.index)]
    partitioned = set(tensors.loc[~tensors["persistent"], "module"])
    # The walk reaches the module's own backward (position len - 1 - i) if what lies between counts less.
    kept = {module: sum(order[i + 1:len(order) - 1 - i]) < max_reuse_distance
            for i, module in enumerate(numels.index) if module in partitioned}
    return pd.Series(kept, name=f"kept gathered (max_reuse_distance {max_reuse_distance:,})", dtype=bool)


def gathers_before_scatter(run: Run, step: int | None = None) -> int:
    """All-gathers in one step before its first reduce-scatter, from rank 0's comms log (a run
    launched with `comms_logger_overrides()`): the gathers of the forward and backward."""
    step = min(3, run.config.steps) if step is None else step
    log = comm_log(run)
    one = log[log["phase"] == step].reset_index(drop=True)
    scatters = one.index[one["op"].str.startswith("reduce_scatter")]
    first = scatters[0] if len(scatters) else len(one)
    return int((one["op"].str.startswith("all_gather") & (one.index < first)).sum())


def reuse_distance_memory(runs: Mapping[str, Run], tensors: pd.DataFrame) -> pd.DataFrame:
    """ZeRO-3 runs that differ in `stage3_max_reuse_distance`, one row per (run, rank): the reuse
    distance, all-gathers before the reduce-scatter (rank 0's log, every rank takes part), the
    parameter bytes the census counted after backward, the rank's peak RSS and, on a GPU, its
    device peak (labkit's records), in MiB.

    `attrs["extra_MiB"]`: what the default keeps that 0 frees, from the tensors (`zero3_tensors`):
    with the default, every partitioned module stays gathered from its forward to its backward
    (for a model under about 0.5e9 parameters: `reuse_kept_gathered`), so the peak holds all of them
    whole; with 0, about one
    module at a time. The difference is the partitioned modules' full bytes less the largest one's.
    """
    part = tensors[~tensors["persistent"]].groupby("module", sort=False)["bytes"].sum()
    rows = []
    for label, run in runs.items():
        gathers = gathers_before_scatter(run)
        for rank, values in sorted(((run.summary or {}).get("per_rank") or {}).items(), key=lambda kv: int(kv[0])):
            row = {"run": label, "rank": int(rank), "max_reuse_distance": reuse_distance(run),
                   "all-gathers before the reduce-scatter": gathers,
                   "param_MiB (census, after backward)": mib(values.get("param_bytes")),
                   "peak_rss_MiB": mib(values.get("peak_rss_bytes"))}
            if values.get("device_peak_bytes") is not None:
                row["device_peak_MiB"] = mib(values["device_peak_bytes"])
            rows.append(row)
    table = pd.DataFrame(rows).set_index(["run", "rank"])
    table.attrs["extra_MiB"] = (part.sum() - part.max()) / MiB if len(part) else 0.0
    table.attrs["gathered_MiB"] = part.sum() / MiB
    return table


def skipped_multi_rank(world_sizes: Sequence[int], parts: Sequence[str], devices: Any = None) -> str | None:
    """What a notebook's multi-rank half skips on this machine, and why, in one paragraph (None: nothing
    skipped). `world_sizes`: the rank counts the notebook asks for; `parts`: its sections that need 2+ ranks."""
    if devices is None:
        from labkit.runtime.devices import detect_devices

        devices = detect_devices()
    skipped = sorted(w for w in world_sizes if w > devices.max_ranks)
    if not skipped:
        return None
    text = (f"This machine has {devices.max_ranks} {devices.kind_plural}: the runs on {', '.join(map(str, skipped))} "
            f"ranks are skipped (one rank per {'core' if devices.is_cpu else 'GPU'}).")
    if devices.max_ranks < 2:
        text += (" With one rank there is no second rank to partition across or to talk to, so these parts show "
                 "no multi-rank result here: " + "; ".join(parts) + ". Run this notebook on 2+ "
                 f"{'cores' if devices.is_cpu else 'GPUs'} to see them.")
    return text

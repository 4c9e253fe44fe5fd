"""Where a launch's time goes: click -> rank 0's first step, phase by phase, labkit beside the bare launchers.

    .venv/bin/python benchmarks/bench_launch.py [--pairs 3] [--examples zero3,pytorch] [--json out.json]

Goal it serves (issue 25, item 3): Launch -> first plotted point <= 0.3x the bare `deepspeed` launcher's
start -> first step of the same training, and the same for a plain PyTorch run against `python train.py`.
This benchmark is the baseline the warm launches (item 2) are measured against: it times the cold launch (the panel's
"cold launch" box ticked); bench_warm_launch.py times the warm one.

What runs, alternating labkit, bare, labkit, bare, ... (`--pairs` pairs per example):
- zero3: Example 3 corrected (`RunConfig(example="zero3", world_size=2, micro_batch=64, hidden=1024,
  depth=2)`, 2 CPU ranks). labkit: `LabPanel.launch()` (the Launch button: Run -> supervisor -> DeepSpeed's
  runner -> launch.py -> rank guard -> worker per rank), timed to the dashboard refresh that plots rank 0's
  first step. Bare: the same training as a user writes it (launch_twins.PLAIN_SCRIPT, no labkit import) under
  `python -m deepspeed.launcher.runner --num_gpus 2` (the `deepspeed` script), runner -> launch.py -> train.py,
  with the environment labkit's launcher builds (threads, accelerator, loopback), timed to rank 0's first
  optimizer step.
- pytorch: Example 1 (`example="pytorch"`, world_size=1): labkit's launch as above against
  `python train.py` (launch_twins.PLAIN_PYTORCH_SCRIPT, one process, a plain loop, torch's Adam).
Every run is killed right after its first step (SIGKILL to the bare launcher's group; Stop for labkit's).

How each phase is measured (the `how` column):
- outside: each process's start is its fork time, from /proc/<pid>/stat's starttime (clock ticks, 10 ms
  here) on CLOCK_BOOTTIME, turned into wall-clock time. Not psutil's `create_time()`, which adds /proc/stat's
  whole-second boot time and reads up to 1 s off against time.time(). The process tree is read from psutil
  once, at the first step, while every process of the run is alive (they all live until the run ends).
- probe: benchmarks/launch_probe/sitecustomize.py, put on PYTHONPATH of every process of both sides'
  launches, stamps from inside each interpreter: the interpreter up (site done), each outermost import of
  torch / deepspeed / labkit modules, the rendezvous (labkit's `init_distributed`, `deepspeed.init_distributed`),
  `deepspeed.initialize`, DeepSpeed's op loads (`OpBuilder.load`), the first module forward and the first
  optimizer step's end. Off unless this benchmark sets it; its cost is one finder call per import.
- records: rank 0's JSONL `step` record (when labkit wrote it) and the panel's first plotted point.
- derived: the remainder of a hop (a process's own work between what the probe stamps, until it forks the
  next hop, or until the first step), so the rows of one run add up to its total exactly.
Each process's segment runs from its fork to its child's fork on rank 0's path (the last: to rank 0's first
optimizer step; labkit adds rows for that step's record and its plotted point); within it, time goes to the
innermost stamped interval (torch imported inside labkit's import is torch's), and an import inside a call
is named with it ("import torch (inside deepspeed.initialize)": what the call imported lazily). A cell is
`-` where that side never has the phase, `n/m` where its hop ran in every run without a probe record; a run
whose hop was measured without the phase counts 0 s. `interpreter start` is fork -> site done (fork/exec, the
interpreter's init, site and its .pth files); with 10 ms ticks the caller's row can read a few ms below 0.
Also printed: the interpreters started beside the hops (subprocesses a hop ran, from the probe), and labkit's
own rank-0 records (start, ready, step) as a check on the probe. Medians are per phase over the pairs; the
total's median is not the sum of the medians. Machine load is printed: on 2 shared cores, other work
lengthens every phase that needs a core.

Not the same baseline as bench_dashboard.py's "+0.48 s" (about 1.06x): its bare twin runs labkit's rank guard
and worker under the bare launcher, so it leaves out what labkit adds inside the ranks; here the bare side
imports no labkit at all.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))  # launch_twins, also when imported by the tests
from launch_twins import (
    MODELS,
    RunFailed,
    first_point_panel,
    launch_until,
    plain_deepspeed_command,
    plain_pytorch_command,
    rank0_times,
)

from labkit import RunConfig
from labkit.core.records import rank_file, read_records
from labkit.launch.launcher import free_port

PROBE_DIR_ENV = "LABKIT_LAUNCH_PROBE_DIR"
PROBE_PATH = Path(__file__).resolve().parent / "launch_probe"
OTHER = "other (own work until the next hop)"
NOT_SPLIT = "whole hop, not split (no probe record)"
# Rank 0's path, in order, on each side; `rank` is labkit's worker or the plain train.py.
CHAINS = {"labkit": ("supervisor", "runner", "launch.py", "rank guard", "rank"),
          "bare-deepspeed": ("runner", "launch.py", "rank"),
          "bare-python": ("rank",)}
PHASES = ("interpreter start", "import torch", "import deepspeed", "import labkit", "rendezvous", "op loads",
          "deepspeed.initialize", "first step (forward -> optimizer step)", OTHER, NOT_SPLIT)
HOW = {"interpreter start": "outside+probe", OTHER: "derived", NOT_SPLIT: "outside"}
ROLE_ORDER = ("caller", "supervisor", "runner", "launch.py", "rank guard", "rank", "after the step")


# -- pure helpers (tests/launch/test_bench_launch.py) ---------------------------------------------------------------
def role_of(cmdline: list[str]) -> str | None:
    """Which hop of a launch a process is, from its command line."""
    for module, role in (("labkit.launch.supervisor", "supervisor"), ("deepspeed.launcher.runner", "runner"),
                         ("deepspeed.launcher.launch", "launch.py"), ("labkit.rank.guard", "rank guard"),
                         ("labkit.rank.worker", "rank")):
        if module in cmdline:
            return role
    if any(Path(arg).name == "train.py" for arg in cmdline[1:3]):
        return "rank"
    return None


def rank0_chain(procs: list[dict[str, Any]], roles: tuple[str, ...]) -> list[dict[str, Any] | None]:
    """Rank 0's path through `procs` (dicts: pid, ppid, create, role, rank): for each role in order, the
    process of that role whose parent is the previous one (any parent if that one was not found), rank 0 or
    rankless. None where no process fits."""
    chain: list[dict[str, Any] | None] = []
    parent = None
    for role in roles:
        fits = [p for p in procs if p["role"] == role and p.get("rank") in (None, 0)
                and (parent is None or p["ppid"] == parent["pid"])]
        found = min(fits, key=lambda p: p["create"]) if fits else None
        chain.append(found)
        parent = found
    return chain


def probe_intervals(events: list[dict[str, Any]], created: float) -> list[tuple[str, float, float]]:
    """(phase, begin, end) of one process from its probe events; `created` is its fork time."""
    intervals = []
    forward = step = None
    for event in events:
        kind = event["event"]
        if kind == "up":
            intervals.append(("interpreter start", created, event["begin"]))
        elif kind == "import":
            intervals.append((f"import {event['name'].partition('.')[0]}", event["begin"], event["end"]))
        elif kind == "rendezvous":
            intervals.append(("rendezvous", event["begin"], event["end"]))
        elif kind == "initialize":
            intervals.append(("deepspeed.initialize", event["begin"], event["end"]))
        elif kind == "op_load":
            intervals.append(("op loads", event["begin"], event["end"]))
        elif kind == "forward1":
            forward = event["begin"]
        elif kind == "step1":
            step = event["begin"]
    if forward is not None and step is not None:
        intervals.append(("first step (forward -> optimizer step)", forward, step))
    return intervals


def exclusive_times(begin: float, end: float, intervals: list[tuple[str, float, float]]) -> dict[str, float]:
    """Seconds of [begin, end] per phase, each instant going to the innermost interval open then (the one that
    began last), OTHER where none is: the values add up to end - begin. An import inside another phase is
    named with it ("import torch (inside deepspeed.initialize)"): the lazy imports a call pays for."""
    clipped = [(name, max(b, begin), min(e, end)) for name, b, e in intervals if min(e, end) > max(b, begin)]
    cuts = sorted({begin, end, *(b for _, b, _ in clipped), *(e for _, _, e in clipped)})
    out: dict[str, float] = {}
    for lo, hi in itertools.pairwise(cuts):
        mid = (lo + hi) / 2
        open_now = sorted((b, i, name) for i, (name, b, e) in enumerate(clipped) if b <= mid < e)
        name = open_now[-1][2] if open_now else OTHER
        calls = [n for _, _, n in open_now if not n.startswith("import ")]
        if name.startswith("import ") and calls:
            name = f"{name} (inside {calls[-1]})"
        out[name] = out.get(name, 0.0) + hi - lo
    return out


def phase_rows(chain: list[dict[str, Any] | None], roles: tuple[str, ...], probes: dict[int, list[dict[str, Any]]],
               start: float, first_step: float | None) -> dict[str, Any]:
    """One run's phases: {"rows": {(role, phase): seconds}, "missing": [...], "end": first step}. The caller's
    row runs from `start` to the first process's fork; each process's from its fork to its child's (the last:
    to rank 0's first optimizer step from the probe, else `first_step`)."""
    found = [(role, p) for role, p in zip(roles, chain, strict=True) if p is not None]
    missing = [role for role, p in zip(roles, chain, strict=True) if p is None]
    last = found[-1][1] if found else None
    steps = [e["begin"] for e in probes.get(last["pid"], []) if e["event"] == "step1"] if last else []
    end = steps[0] if steps else first_step
    rows: dict[tuple[str, str], float] = {}
    if not found or end is None:
        return {"rows": rows, "missing": missing or ["first step"], "end": end}
    rows[("caller", "start -> first process forked")] = found[0][1]["create"] - start
    for index, (role, proc) in enumerate(found):
        until = found[index + 1][1]["create"] if index + 1 < len(found) else end
        events = probes.get(proc["pid"])
        if not events:
            missing.append(f"{role} (no probe record)")
            rows[(role, NOT_SPLIT)] = until - proc["create"]
            continue
        for phase, seconds in exclusive_times(proc["create"], until, probe_intervals(events, proc["create"])).items():
            rows[(role, phase)] = seconds
    return {"rows": rows, "missing": missing, "end": end}


def side_interpreters(probes: dict[int, list[dict[str, Any]]], hop_pids: set[int]) -> dict[str, int]:
    """Interpreters the probe saw start that are no hop of the launch (a subprocess a hop ran, say), counted by
    what they ran: the `-m` module, the script's file name, or `-c`."""
    out: dict[str, int] = {}
    for pid, events in probes.items():
        up = next((e for e in events if e["event"] == "up"), None)
        if pid in hop_pids or up is None:
            continue
        argv = up.get("argv") or ["?"]
        if "-m" in argv[:-1]:
            name = argv[argv.index("-m") + 1]
        elif "-c" in argv:
            name = "-c"
        else:
            name = next((Path(a).name for a in argv[1:] if not a.startswith("-")), "?")
        out[name] = out.get(name, 0) + 1
    return out


def how_measured(role: str, phase: str) -> str:
    if role == "caller":
        return "outside"
    if role == "after the step":
        return "probe+records"
    return HOW.get(phase, "probe")


def phase_order(phase: str) -> float:
    """Where a phase's row goes within its hop: PHASES' order, an import inside a call just after the call."""
    base, _, inside = phase.partition(" (inside ")
    if inside:
        return phase_order(inside.rstrip(")")) + 0.5
    order = (*PHASES, "start -> first process forked", "first step done -> step record written",
             "step record written -> plotted")
    return order.index(base) if base in order else len(order)


def unmeasured(run: dict[str, Any], role: str) -> bool:
    """Whether `role`'s hop ran in `run` without its phases measured (not found, or no probe record)."""
    return role in run["missing"] or f"{role} (no probe record)" in run["missing"]


def phase_table(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Median seconds per (role, phase) and side over runs: [{"role", "phase", "how", side: median, or None
    where the side never has it, or "n/m" where its hop ran unmeasured in every run, side + "_n": runs
    counted}], in launch order. A run whose hop was measured without that phase counts 0 s."""
    keys = {key for side_runs in runs.values() for run in side_runs for key in run["rows"]}
    table = []
    for role, phase in sorted(keys, key=lambda k: (ROLE_ORDER.index(k[0]), phase_order(k[1]))):
        row: dict[str, Any] = {"role": role, "phase": phase, "how": how_measured(role, phase)}
        for side, side_runs in runs.items():
            ran = [run for run in side_runs if any(k[0] == role for k in run["rows"])]
            values = [run["rows"].get((role, phase), 0.0) for run in ran
                      if (role, phase) in run["rows"] or not unmeasured(run, role)]
            if any((role, phase) in run["rows"] for run in side_runs):
                row[side] = statistics.median(values)
            else:
                row[side] = "n/m" if any(unmeasured(run, role) for run in ran) else None
            row[side + "_n"] = len(values)
        table.append(row)
    return table


def by_kind(run: dict[str, Any]) -> dict[str, float]:
    """A run's seconds per kind of phase, summed over the hops (interpreter starts, imports of torch, ...)."""
    out: dict[str, float] = {}
    for (role, phase), seconds in run["rows"].items():
        kind = phase if role not in ("caller", "after the step") else f"{role}: {phase}"
        if phase == OTHER:
            kind = "hops' own work (derived)"
        out[kind] = out.get(kind, 0.0) + seconds
    return out


# -- measuring ---------------------------------------------------------------------------------------------
def boot_wall_time() -> float:
    """The wall-clock time of boot, to the clock's precision (CLOCK_BOOTTIME counts from it)."""
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)


def fork_time(pid: int, boot: float, tick: float = 1 / os.sysconf("SC_CLK_TCK")) -> float:
    """When process `pid` was forked, wall clock: /proc/<pid>/stat's starttime (field 22, in clock ticks
    since boot on CLOCK_BOOTTIME)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return boot + int(fields[19]) * tick


def snapshot(root_pid: int) -> list[dict[str, Any]]:
    """Every descendant of `root_pid` with a launch role: pid, ppid, fork time, role, RANK (or None)."""
    boot = boot_wall_time()
    out = []
    for proc in psutil.Process(root_pid).children(recursive=True):
        try:
            role = role_of(proc.cmdline())
            if role is None:
                continue
            rank = proc.environ().get("RANK")
            out.append({"pid": proc.pid, "ppid": proc.ppid(), "create": fork_time(proc.pid, boot), "role": role,
                        "rank": int(rank) if rank and rank.isdigit() else None, "cmdline": proc.cmdline()[:6]})
        except (psutil.Error, OSError):
            continue  # gone meanwhile: its hop shows as not measured
    return out


def read_probes(probe_dir: Path) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for path in probe_dir.glob("*.jsonl"):
        lines = path.read_text().splitlines()
        out[int(path.stem)] = [json.loads(line) for line in lines if line.endswith("}")]
    return out


@contextlib.contextmanager
def probed(probe_dir: Path) -> Iterator[None]:
    """The probe on for the processes this one starts meanwhile (labkit's launcher takes os.environ)."""
    saved = {name: os.environ.get(name) for name in (PROBE_DIR_ENV, "PYTHONPATH")}
    os.environ[PROBE_DIR_ENV] = str(probe_dir)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROBE_PATH), saved["PYTHONPATH"]) if p)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def labkit_run(config: RunConfig, workdir: Path) -> dict[str, Any]:
    probe_dir = Path(tempfile.mkdtemp(prefix="probe-labkit-", dir=workdir))
    procs: list[dict[str, Any]] = []
    with probed(probe_dir):
        panel = first_point_panel(config, workdir / "runs",
                                  at_first_point=lambda _run: procs.extend(snapshot(os.getpid())))
    _, record_at = rank0_times(Path(panel["run_dir"]))
    plotted = panel["wall0"] + panel["total"]
    chain = rank0_chain(procs, CHAINS["labkit"])
    probes = read_probes(probe_dir)
    run = phase_rows(chain, CHAINS["labkit"], probes, panel["wall0"], record_at)
    run["side"] = side_interpreters(probes, {p["pid"] for p in procs})
    records = read_records(rank_file(panel["run_dir"], 0))
    # The worker's own records, as a check on the probe: `start` once its imports are done, `ready` once the
    # engine is built (after deepspeed.initialize), and the first step's record.
    run["records"] = {event: next((r["wall_time"] - panel["wall0"] for r in records if r.get("event") == event),
                                  None) for event in ("start", "ready")}
    run["records"]["step"] = record_at - panel["wall0"]
    if run["end"] is not None and run["rows"]:
        run["rows"][("after the step", "first step done -> step record written")] = record_at - run["end"]
        run["rows"][("after the step", "step record written -> plotted")] = plotted - record_at
    run.update(total=panel["total"], first_step_s=None if run["end"] is None else run["end"] - panel["wall0"],
               run_dir=panel["run_dir"], probe_dir=str(probe_dir))
    return run


def bare_run(config: RunConfig, workdir: Path) -> dict[str, Any]:
    here = Path(tempfile.mkdtemp(prefix="bare-", dir=workdir))
    probe_dir = here / "probe"
    probe_dir.mkdir()
    port = None
    if config.example == "pytorch":
        argv, env = plain_pytorch_command(config, here)
        roles = CHAINS["bare-python"]
    else:
        port = free_port()
        argv, env = plain_deepspeed_command(config, here, port)
        roles = CHAINS["bare-deepspeed"]
    env.update({PROBE_DIR_ENV: str(probe_dir), "PYTHONPATH": str(PROBE_PATH)})
    procs: list[dict[str, Any]] = []

    def first_step() -> bool:
        return any(e["event"] == "step1" and e.get("rank", 0) == 0 for events in read_probes(probe_dir).values()
                   for e in events)

    wall0, _ = launch_until(argv, env, cwd=here, log_path=here / "launcher.log", first_step=first_step,
                            at_first_step=lambda pid: procs.extend([*snapshot(pid), *_self(pid)]), master_port=port)
    probes = read_probes(probe_dir)
    run = phase_rows(rank0_chain(procs, roles), roles, probes, wall0, None)
    run["side"] = side_interpreters(probes, {p["pid"] for p in procs})
    run.update(total=None if run["end"] is None else run["end"] - wall0, run_dir=str(here))
    run["first_step_s"] = run["total"]
    return run


def _self(pid: int) -> list[dict[str, Any]]:
    """The launched process itself (snapshot lists descendants): `python train.py` is its own rank."""
    try:
        proc = psutil.Process(pid)
        role = role_of(proc.cmdline())
        return [{"pid": pid, "ppid": proc.ppid(), "create": fork_time(pid, boot_wall_time()), "role": role,
                 "rank": None, "cmdline": proc.cmdline()[:6]}] if role else []
    except (psutil.Error, OSError):
        return []


def example_config(example: str) -> RunConfig:
    if example == "pytorch":
        return RunConfig(example="pytorch", world_size=1, micro_batch=64, steps=5, **MODELS["example3"])
    return RunConfig(example="zero3", world_size=2, micro_batch=64, steps=5, **MODELS["example3"])


# -- printing ----------------------------------------------------------------------------------------------
def cell(value: Any) -> str:
    if value is None:
        return "-"
    return value if isinstance(value, str) else f"{value:.3f}"


def print_table(example: str, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    sides = list(runs)
    table = phase_table(runs)
    counts = ", ".join(f"{side}: {len(runs[side])} runs" for side in sides)
    print(f"\n{example}: median seconds per phase on rank 0's path ({counts})")
    print(f"  {'hop':<15}{'phase':<62}{'how':<15}" + "".join(f"{s:>16}" for s in sides))
    for row in table:
        print(f"  {row['role']:<15}{row['phase']:<62}{row['how']:<15}" + "".join(f"{cell(row[s]):>16}" for s in sides))
    labkit, bare = runs["labkit"], runs[sides[1]]
    first = [r["first_step_s"] for r in labkit if r["first_step_s"] is not None]
    bare_total = [r["total"] for r in bare if r["total"] is not None]
    medians = [statistics.median(values) if values else None for values in (first, bare_total)]
    print(f"  {'total':<15}{'start -> rank 0 first step done':<62}{'probe':<15}"
          f"{cell(medians[0]):>16}{cell(medians[1]):>16}")
    print(f"  {'total':<15}{'Launch -> first plotted point':<62}{'records':<15}"
          f"{cell(statistics.median(r['total'] for r in labkit)):>16}{'-':>16}")
    summary: dict[str, Any] = {"table": table}
    pairs = [(lk, br) for lk, br in zip(labkit, bare, strict=False) if br["total"] and lk["first_step_s"]]
    if pairs:
        plotted = [lk["total"] / br["total"] for lk, br in pairs]
        stepped = [lk["first_step_s"] / br["total"] for lk, br in pairs]
        summary.update(ratio_plotted=statistics.median(plotted), ratio_first_step=statistics.median(stepped))
        print(f"  ratio labkit Launch -> first plotted point / bare start -> first step: median "
              f"{summary['ratio_plotted']:.3f} over {len(pairs)} pairs ({', '.join(f'{r:.3f}' for r in plotted)}); "
              f"goal <= 0.3: {'met' if summary['ratio_plotted'] <= 0.3 else 'NOT met'}")
        print(f"  ratio labkit / bare, both to rank 0's first optimizer step: median {summary['ratio_first_step']:.3f}")
    for side in sides:
        kinds: dict[str, list[float]] = {}
        for run in runs[side]:
            for kind, seconds in by_kind(run).items():
                kinds.setdefault(kind, []).append(seconds)
        summary[f"by_kind_{side}"] = {k: statistics.median(v) for k, v in kinds.items()}
        print(f"  {side}, summed over its hops (median s): " + ", ".join(
            f"{k} {v:.2f}" for k, v in sorted(summary[f"by_kind_{side}"].items(), key=lambda kv: -kv[1])))
    for side in sides:
        names = sorted({name for run in runs[side] for name in run["side"]})
        if names:
            print(f"  {side}: interpreters started beside the hops (all ranks, median per run): " + ", ".join(
                f"{statistics.median(run['side'].get(name, 0) for run in runs[side]):g} x {name}" for name in names))
    checks = [run["records"] for run in labkit if run["records"]["start"] is not None]
    if checks:
        print("  labkit's own rank-0 records, s after Launch (median): " + ", ".join(
            f"{event} {statistics.median(c[event] for c in checks if c[event] is not None):.2f}"
            for event in ("start", "ready", "step")) + " (start: imports done; ready: engine built; step: record)")
    missing = {m for side in sides for run in runs[side] for m in run["missing"]}
    if missing:
        print(f"  not measured in some run: {', '.join(sorted(missing))}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--examples", default="zero3,pytorch", help="comma-separated, of zero3, pytorch")
    parser.add_argument("--json", type=Path, help="write every run's phases and the medians here")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-launch-"))
    load = os.getloadavg()
    print(f"load average at the start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores; "
          f"runs in {workdir}", flush=True)
    result: dict[str, Any] = {"loadavg_start": load, "cores": os.cpu_count(), "pairs": args.pairs, "examples": {}}
    for example in args.examples.split(","):
        config = example_config(example)
        bare_side = "bare-python" if example == "pytorch" else "bare-deepspeed"
        runs: dict[str, list[dict[str, Any]]] = {"labkit": [], bare_side: []}
        for pair in range(args.pairs):
            try:
                lk = labkit_run(config, workdir)
                br = bare_run(config, workdir)
            except RunFailed as exc:  # a shared machine's OOM killer, say: report it, keep measuring
                print(f"  {example} pair {pair + 1}: skipped, {exc}", flush=True)
                continue
            runs["labkit"].append(lk)
            runs[bare_side].append(br)
            print(f"  {example} pair {pair + 1}: labkit first plotted point {lk['total']:.2f} s (first step "
                  f"{cell(lk['first_step_s'])} s), bare first step {cell(br['total'])} s", flush=True)
        if not runs["labkit"]:
            print(f"{example}: no pair completed")
            continue
        summary = print_table(example, runs)
        result["examples"][example] = {
            "config": config.to_dict(), **summary,
            "runs": {side: [{**run, "rows": [[k[0], k[1], v] for k, v in run["rows"].items()]} for run in side_runs]
                     for side, side_runs in runs.items()}}
    result["loadavg_end"] = os.getloadavg()
    print(f"\nload average at the end {result['loadavg_end'][0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))
        print(f"written: {args.json}")


if __name__ == "__main__":
    main()

"""Fault suite: runs never hang, never orphan a process, never lose recorded results.

Real processes and real DeepSpeed CPU ranks (gloo), small models. Every scenario that needs a
run starts when this module starts, in a thread pool (LABKIT_FAULT_WORKERS at a time), and each
test asserts on its scenario's result: the suite costs the slowest scenarios, not their sum.
Only the scenarios of the selected tests run (`-k stop` starts one run).

Time limits are the issue's, measured from the event (the fault, the kill, the stop call) to
the moment the last process was gone: polled every 20 ms, or summary.json's mtime, which the
supervisor writes only after it has seen every process of the run end. Never from a test's
start, so a slow machine (rank start-up takes 20-200 s here) does not eat into a limit.

The figures measured land in LABKIT_FAULT_REPORT (JSON) when it is set; docs/faults.md
tabulates one such run.
"""

from __future__ import annotations

import ast
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psutil
import pytest

from labkit import Run, RunConfig, runs
from labkit.core.records import rank_file, read_records
from labkit.launch import proctree
from labkit.launch.history import recover_stale
from tests.conftest import REPO, run_processes

pytestmark = pytest.mark.faults

SMALL = dict(example="zero3", world_size=2, hidden=256, micro_batch=16, dataset_size=1024)
LONG = 100_000                 # steps: a run that only a fault or a stop ends
STARTUP_S = 480                # the longest we wait for a run to reach its steps (a loaded machine)
WORKERS = int(os.environ.get("LABKIT_FAULT_WORKERS", "5"))  # ~1.1 GB of RAM per 2-rank run
CHAOS_SEED = int(os.environ.get("LABKIT_CHAOS_SEED", str(int(time.time()) % 100_000)))

# The limits.
STOP_LIMIT_S = 6.0
PARENT_KILL_LIMIT_S = 2.0
FAILURE_LIMIT_S = 5.0
HEARTBEAT_S = 5.0
HANG_LIMIT_S = HEARTBEAT_S + 5.0


# -- helpers ----------------------------------------------------------------------------------
def start(root: Path, fault: str = "", warm: bool | None = None, **overrides: Any) -> Run:
    """A run of SMALL; `warm`: as Run's (None: the default, warm on this CPU machine)."""
    config = RunConfig(**{**SMALL, "steps": LONG, **overrides})
    return Run(config, root=root, env={"LABKIT_FAULT": fault}, warm=warm).start()


def wait_until(predicate: Callable[[], bool], timeout: float, poll_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll_s)
    return predicate()


def steps_of(run_dir: Path, rank: int) -> list[int]:
    return [r["step"] for r in read_records(rank_file(run_dir, rank)) if r.get("event") == "step"]


def progress(run_dir: Path, world_size: int = 2) -> int:
    return min(len(steps_of(run_dir, rank)) for rank in range(world_size))


def explain(run_dir: Path) -> str:
    parts = [f"run dir {run_dir}"]
    for name in ("supervisor.log", "launcher.log"):
        path = run_dir / name
        if path.exists():
            parts.append(f"--- {name}\n" + path.read_text(errors="replace")[-2000:])
    for log in sorted((run_dir / "logs").glob("*.log")) if (run_dir / "logs").is_dir() else []:
        parts.append(f"--- {log.name}\n" + log.read_text(errors="replace")[-1500:])
    return "\n".join(parts)


def reach_steps(run: Run, n: int) -> None:
    if not wait_until(lambda: progress(run.run_dir, run.config.world_size) >= n or run.summary is not None,
                      STARTUP_S, poll_s=0.2):
        raise TimeoutError(f"no step {n} within {STARTUP_S} s\n{explain(run.run_dir)}")
    if run.summary is not None:
        raise RuntimeError(f"run ended before step {n}: {run.summary['status']}\n{explain(run.run_dir)}")


def supervisor_pid(run_dir: Path) -> int:
    assert wait_until(lambda: (run_dir / "status.json").exists(), 120)
    return json.loads((run_dir / "status.json").read_text())["supervisor_pid"]


def process_tree(run_dir: Path) -> list[psutil.Process]:
    """The supervisor, everything under it, and anything else naming the run directory."""
    return proctree.tree(run_dir, supervisor_pid(run_dir))


def describe(proc: psutil.Process) -> str:
    try:
        cmdline = proc.cmdline()
        module = cmdline[cmdline.index("-m") + 1] if "-m" in cmdline else " ".join(cmdline[:3])
        return f"{proc.pid} {module}"
    except (psutil.Error, ValueError, IndexError):
        return str(proc.pid)


def gone(proc: psutil.Process) -> bool:
    return not proctree.alive(proc)


class DeathWatch:
    """Polls a set of processes every 20 ms from a thread; records when each one was gone."""

    def __init__(self, procs: list[psutil.Process]):
        self.procs = procs
        self.names = {p.pid: describe(p) for p in procs}
        self.ranks = {p.pid for p in procs if proctree.is_rank(p)}
        self.deaths: dict[int, float] = {}
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        deadline = time.time() + 60
        while len(self.deaths) < len(self.procs) and time.time() < deadline:
            for proc in self.procs:
                if proc.pid not in self.deaths and gone(proc):
                    self.deaths[proc.pid] = time.time()
            time.sleep(0.02)

    def join(self) -> DeathWatch:
        self._thread.join()
        return self

    @property
    def survivors(self) -> list[str]:
        return [self.names[p.pid] for p in self.procs if p.pid not in self.deaths]

    def last(self, ranks_only: bool = False) -> float:
        times = [t for pid, t in self.deaths.items() if not ranks_only or pid in self.ranks]
        return max(times) if times else float("nan")


def wall_times(run_dir: Path, rank: int) -> list[tuple[dict[str, Any], float]]:
    """Each record of a rank with its wall-clock time (records carry seconds since the rank's start)."""
    records = read_records(rank_file(run_dir, rank))
    start = next(r for r in records if r.get("event") == "start")
    origin = start["wall_time"] - start["time_s"]
    return [(r, origin + r["time_s"]) for r in records]


def log_time(run_dir: Path, needle: str) -> float:
    """Wall time of the first supervisor.log line containing `needle` (lines start HH:MM:SS.mmm)."""
    for line in (run_dir / "supervisor.log").read_text().splitlines():
        if needle in line:
            stamp = datetime.strptime(line[:12], "%H:%M:%S.%f").time()
            reference = datetime.fromtimestamp((run_dir / "supervisor.log").stat().st_mtime)
            moment = datetime.combine(reference.date(), stamp)
            if moment > reference + timedelta(hours=1):  # the run crossed midnight
                moment -= timedelta(days=1)
            return moment.timestamp()
    raise AssertionError(f"{needle!r} not in supervisor.log\n{explain(run_dir)}")


def listening_sockets(procs: list[psutil.Process]) -> list[tuple[str, str, int]]:
    found = []
    for proc in procs:
        try:
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    found.append((describe(proc), conn.laddr.ip, conn.laddr.port))
        except psutil.Error:
            continue
    return found


def strict_json_files(root: Path) -> list[str]:
    """Every JSON file of the store parsed strictly; rank files line by line. Returns problems."""
    problems = []
    for path in sorted(root.rglob("*")):
        if path.suffix in (".json", ".exit") and not path.name.startswith("."):
            try:
                json.loads(path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                problems.append(f"{path}: {exc}")
        elif path.suffix == ".jsonl":
            lines = path.read_text().split("\n")
            # A SIGKILL can cut a record longer than a page: only the unfinished last line may be bad.
            for number, line in enumerate(lines[:-1], start=1):
                try:
                    json.loads(line)
                except json.JSONDecodeError as exc:
                    problems.append(f"{path}:{number}: {exc}")
    return problems


# -- scenarios: each starts its own run(s) and returns what it measured ----------------------------
SCENARIOS: dict[str, Callable[[Path], dict[str, Any]]] = {}


def scenario(name: str):
    def register(function):
        SCENARIOS[name] = function
        return function
    return register


def uses(*names: str):
    """The scenarios a test needs: only those of the selected tests are started (and the test is slow)."""
    def mark(function):
        function.scenarios = names
        return pytest.mark.slow(function)
    return mark


def _stop(root: Path, warm: bool) -> dict[str, Any]:
    run = start(root, warm=warm)
    reach_steps(run, 3)
    procs = process_tree(run.run_dir)
    listening = listening_sockets(procs)  # measured mid-run, every rank initialised
    watch = DeathWatch(procs)
    started = time.time()
    status = run.stop()
    stop_s = time.time() - started
    watch.join()
    row = runs(root).set_index("run_id").loc[run.run_dir.name]  # the store lists it and reloads it
    return {"run_dir": str(run.run_dir), "status": status, "stop_s": stop_s, "gone_s": watch.last() - started,
            "processes": sorted(watch.names.values()), "survivors": watch.survivors, "listening": listening,
            "steps_recorded": progress(run.run_dir), "summary": run.summary,
            "listed_status": row.status, "reloaded_status": Run.load(run.run_dir).status,
            "launch": run.launch_mode, "leftovers": [describe(p) for p in run_processes(run.run_dir)]}


@scenario("stop")
def _stop_warm(root: Path) -> dict[str, Any]:
    return _stop(root, warm=True)


@scenario("stop_cold")
def _stop_cold(root: Path) -> dict[str, Any]:
    return _stop(root, warm=False)


HELPER = """
import json, sys, time
from labkit import Run, RunConfig
run = Run(RunConfig(**json.loads(sys.argv[1])), root=sys.argv[2], env={"LABKIT_FAULT": ""},
          warm=sys.argv[3] == "warm").start()
print("RUN_DIR=" + str(run.run_dir), run.launch_mode, flush=True)
time.sleep(3600)
"""


def _parent_kill(root: Path, launch: str) -> dict[str, Any]:
    """The process holding the Run (a Jupyter kernel, the CLI) is SIGKILLed mid-run. Warm: its run forked
    from the session's zygote, which lives on; the supervisor watches the killed process, not its parent."""
    helper = subprocess.Popen([sys.executable, "-c", HELPER, json.dumps({**SMALL, "steps": LONG}), str(root), launch],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        line = ""
        while not line.startswith("RUN_DIR="):  # DeepSpeed logs to stdout too
            line = helper.stdout.readline()
            if not line:
                raise RuntimeError("the helper exited before it started its run")
        run_dir_text, launch_mode = line.strip().removeprefix("RUN_DIR=").split(" ", 1)
        run_dir = Path(run_dir_text)
        run = Run.load(run_dir)
        reach_steps(run, 2)
        procs = process_tree(run_dir)
        watch = DeathWatch(procs)
        killed = time.time()
        helper.kill()
    finally:
        helper.kill()
        helper.wait()
    watch.join()
    assert wait_until(lambda: run.summary is not None, 30), explain(run_dir)
    noticed = log_time(run_dir, "outcome:")
    return {"run_dir": str(run_dir), "status": run.status, "cause": run.cause,
            "ranks_gone_after_kill_s": watch.last(ranks_only=True) - killed,
            "ranks_gone_after_notice_s": watch.last(ranks_only=True) - noticed,
            "all_gone_after_kill_s": watch.last() - killed, "noticed_after_s": noticed - killed,
            "launch": launch_mode, "survivors": watch.survivors,
            "leftovers": [describe(p) for p in run_processes(run_dir)]}


@scenario("parent_kill")
def _parent_kill_warm(root: Path) -> dict[str, Any]:
    return _parent_kill(root, "warm")


@scenario("parent_kill_cold")
def _parent_kill_cold(root: Path) -> dict[str, Any]:
    return _parent_kill(root, "cold")


# kind, rank, step, expected status
FAILURES = {
    "raise": ("raise", 1, 3, "failed"),
    "sigkill": ("kill", 0, 4, "failed"),
    "torch_oom": ("oom", 1, 3, "oom"),
    "cpu_alloc": ("cpualloc", 0, 3, "oom"),
    "memory_error": ("memerror", 1, 4, "oom"),
}


def _failure(kind: str, rank: int, step: int, root: Path) -> dict[str, Any]:
    run = start(root, f"{kind}@rank{rank}:step{step}", steps=40)
    status = run.wait(timeout=STARTUP_S)
    run_dir = run.run_dir
    assert run.summary is not None, explain(run_dir)
    timed = wall_times(run_dir, rank)
    # The fault fires at the top of step k, right after the step k-1 record: that record is
    # when the fault happened (conservative: the real moment is a hair later).
    last_step_wall = max(t for r, t in timed if r.get("event") in ("ready", "step"))
    ended = (run_dir / "summary.json").stat().st_mtime
    raw = {r: rank_file(run_dir, r).read_bytes() for r in range(2)}
    return {"run_dir": str(run_dir), "status": status, "summary": run.summary,
            "ended_s": ended - last_step_wall,
            "steps": {r: steps_of(run_dir, r) for r in range(2)},
            "events": {r: [rec.get("event") for rec in read_records(rank_file(run_dir, r))] for r in range(2)},
            "complete_lines": {r: raw[r].endswith(b"\n") for r in range(2)},
            "leftovers": [describe(p) for p in run_processes(run_dir)]}


for _name, (_kind, _rank, _step, _) in FAILURES.items():
    scenario(f"fail_{_name}")(lambda root, k=_kind, r=_rank, s=_step: _failure(k, r, s, root))


@scenario("hang")
def _hang(root: Path) -> dict[str, Any]:
    run = start(root, "hang@rank1:step3", steps=40, heartbeat_s=HEARTBEAT_S)
    status = run.wait(timeout=STARTUP_S)
    assert run.summary is not None, explain(run.run_dir)
    last_record = max(t for _, t in wall_times(run.run_dir, 1))
    ended = (run.run_dir / "summary.json").stat().st_mtime
    return {"run_dir": str(run.run_dir), "status": status, "cause": run.cause, "ended_s": ended - last_record,
            "steps": {r: steps_of(run.run_dir, r) for r in range(2)},
            "leftovers": [describe(p) for p in run_processes(run.run_dir)]}


@scenario("hang_quiet")
def _hang_quiet(root: Path) -> dict[str, Any]:
    """telemetry=False (the benchmark's baseline) writes no step records, only a heartbeat about once a second:
    without it a stuck rank would go unnoticed for the whole startup allowance."""
    run = start(root, "hang@rank1:step40", telemetry=False, heartbeat_s=HEARTBEAT_S)
    status = run.wait(timeout=STARTUP_S)
    assert run.summary is not None, explain(run.run_dir)
    records = read_records(rank_file(run.run_dir, 0))
    return {"run_dir": str(run.run_dir), "status": status, "cause": run.cause, "summary": run.summary,
            "beat_steps": [r["step"] for r in records if r["event"] == "beat"],
            "step_records": sum(r["event"] == "step" for r in records),
            "leftovers": [describe(p) for p in run_processes(run.run_dir)]}


@scenario("dead_supervisor")
def _dead_supervisor(root: Path) -> dict[str, Any]:
    """The supervisor is SIGKILLed mid-run: no summary.json, nobody ends the ranks. A fresh look at the store (as
    after a kernel restart) must not list the run as running."""
    run = start(root)
    reach_steps(run, 2)
    os.kill(supervisor_pid(run.run_dir), 9)
    run._supervisor.wait()
    row = runs(root).set_index("run_id").loc[run.run_dir.name]  # only reads
    left_before = [describe(p) for p in run_processes(run.run_dir)]
    summary_before = (run.run_dir / "summary.json").exists()
    recovered = recover_stale(root)
    return {"run_dir": str(run.run_dir), "listed_status": row.status, "listed_cause": row.cause,
            "left_before_recovery": left_before, "summary_before_recovery": summary_before,
            "recovered": [str(path) for path in recovered], "summary": run.summary,
            "leftovers": [describe(p) for p in run_processes(run.run_dir)]}


@scenario("slow_start")
def _slow_start(root: Path) -> dict[str, Any]:
    run = start(root, "slowstart@rank1:8", steps=10, heartbeat_s=3.0)
    status = run.wait(timeout=STARTUP_S)
    records = read_records(rank_file(run.run_dir, 1))
    start_s = next(r["time_s"] for r in records if r["event"] == "start")
    ready_s = next((r["time_s"] for r in records if r["event"] == "ready"), float("nan"))
    return {"run_dir": str(run.run_dir), "status": status, "cause": run.cause,
            "rank1_start_to_ready_s": ready_s - start_s,
            "leftovers": [describe(p) for p in run_processes(run.run_dir)]}


def _kill_launcher(root: Path, which: str, warm: bool = False) -> dict[str, Any]:
    run = start(root, warm=warm)
    reach_steps(run, 2)
    procs = process_tree(run.run_dir)
    victim = next(p for p in procs if describe(p).endswith(which))
    watch = DeathWatch([p for p in procs if p.pid != victim.pid])
    killed = time.time()
    victim.kill()
    status = run.wait(timeout=60)
    watch.join()
    return {"run_dir": str(run.run_dir), "status": status, "cause": run.cause, "gone_s": watch.last() - killed,
            "survivors": watch.survivors, "leftovers": [describe(p) for p in run_processes(run.run_dir)]}


@scenario("kill_runner")
def _kill_runner(root: Path) -> dict[str, Any]:
    return _kill_launcher(root, "deepspeed.launcher.runner")


@scenario("kill_launch_py")
def _kill_launch_py(root: Path) -> dict[str, Any]:
    return _kill_launcher(root, "deepspeed.launcher.launch")


@scenario("kill_warm_launcher")
def _kill_warm_launcher(root: Path) -> dict[str, Any]:
    """A warm run's stand-in for the runner and launch.py (labkit.launch.warm_launch), the ranks' parent."""
    return _kill_launcher(root, "labkit.launch.warm_launch", warm=True)


PAIR = {"a": dict(micro_batch=16, steps=5), "b": dict(micro_batch=32, steps=8)}


@scenario("pair")
def _pair(root: Path) -> dict[str, Any]:
    handles = {name: start(root, **values) for name, values in PAIR.items()}  # both start before either waits
    out: dict[str, Any] = {}
    for name, run in handles.items():
        status = run.wait(timeout=STARTUP_S)
        argv = json.loads((run.run_dir / "launch.json").read_text())["argv"]
        files = sorted(p.name for p in run.run_dir.glob("rank*"))
        records = {r: read_records(rank_file(run.run_dir, r)) for r in range(2)}
        exits = {r: json.loads((run.run_dir / f"rank{r}.exit").read_text()) for r in range(2)}
        out[name] = {"run_dir": str(run.run_dir), "status": status, "port": int(argv[argv.index("--master_port") + 1]),
                     "files": files, "records": records, "exits": exits,
                     "leftovers": [describe(p) for p in run_processes(run.run_dir)]}
    return out


# Kills at random moments: (phase, what to SIGKILL). Each iteration is its own run, so they
# run side by side; LABKIT_CHAOS_SEED replays a failing draw.
CHAOS = [
    ("launching", "supervisor"),          # maybe before status.json or the launcher exists
    ("starting", "everything"),           # supervisor + launcher group, ranks importing
    ("stepping", "supervisor"),           # the launcher group is orphaned mid-run
    ("stepping", "supervisor+workers"),
    ("stepping", "worker"),
    ("finishing", "supervisor"),          # around done / summary.json writing
]


def _chaos(index: int, root: Path) -> dict[str, Any]:
    phase, target = CHAOS[index]
    rng = random.Random(CHAOS_SEED * 100 + index)
    run = start(root, steps=LONG if phase != "finishing" else 30, world_size=1)  # 1 rank: cheaper, same paths
    run_dir = run.run_dir
    if phase == "launching":
        time.sleep(rng.uniform(0.0, 1.5))
    elif phase == "starting":
        wait_until(lambda: (run_dir / "status.json").exists(), 60)
        time.sleep(rng.uniform(0.0, 6.0))
    elif phase == "stepping":
        reach_steps(run, 1)
        time.sleep(rng.uniform(0.0, 2.0))
    else:
        wait_until(lambda: any(r.get("event") == "done" for r in read_records(rank_file(run_dir, 0))), STARTUP_S)
        time.sleep(rng.uniform(0.0, 4.0))
    try:
        sup = psutil.Process(run._supervisor.pid)
    except psutil.NoSuchProcess:  # it ended and was reaped (a warm run's by the zygote, a cold one's stays a zombie)
        sup = None
    tree = proctree.descendants(sup.pid) if sup is not None and not gone(sup) else []
    victims = {
        "supervisor": tree[:1],
        "everything": tree,
        "supervisor+workers": tree[:1] + [p for p in tree if describe(p).endswith("labkit.rank.worker")],
        "worker": [p for p in tree if describe(p).endswith("labkit.rank.worker")][:1],
    }[target]
    moment = time.time()
    killed = []
    for proc in victims:
        name = describe(proc)
        try:
            proc.kill()
            killed.append(name)
        except psutil.Error:
            pass
    status = run.wait(timeout=60)  # must recover: end what the supervisor left, write the summary
    if run.summary is None:
        status = run.stop()
    leftovers_at_once = [describe(p) for p in run_processes(run_dir)]
    wait_until(lambda: not run_processes(run_dir), 10)
    return {"run_dir": str(run_dir), "phase": phase, "target": target, "killed": killed,
            "seed": CHAOS_SEED, "after_start_s": moment - (run_dir / "config.json").stat().st_mtime,
            "status": status, "summary": run.summary, "reloaded_status": Run.load(run_dir).status,
            "leftovers_at_once": leftovers_at_once, "leftovers": [describe(p) for p in run_processes(run_dir)]}


for _i in range(len(CHAOS)):
    scenario(f"chaos_{_i}")(lambda root, i=_i: _chaos(i, root))


# -- the fleet: every selected scenario at once ------------------------------------------------
class Fleet:
    def __init__(self, root: Path, names: list[str]):
        self.root = root
        self.started = time.monotonic()
        self.pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="scenario")
        self.futures: dict[str, Future] = {}
        self.wall: dict[str, float] = {}
        for name in names:
            (root / name).mkdir(parents=True, exist_ok=True)
            self.futures[name] = self.pool.submit(self._timed, name)

    def _timed(self, name: str) -> dict[str, Any]:
        began = time.monotonic()
        try:
            return SCENARIOS[name](self.root / name)
        finally:
            self.wall[name] = time.monotonic() - began

    def result(self, name: str) -> dict[str, Any]:
        return self.futures[name].result(timeout=STARTUP_S + 300)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        report = os.environ.get("LABKIT_FAULT_REPORT")
        if report:
            results = {name: (f.result() if f.done() and not f.exception() else repr(f.exception()))
                       for name, f in self.futures.items() if f.done()}
            Path(report).write_text(json.dumps({"seed": CHAOS_SEED, "workers": WORKERS, "wall_s": self.wall,
                                                "fleet_s": time.monotonic() - self.started, "results": results},
                                               indent=1, default=str))


@pytest.fixture(scope="module", autouse=True)
def fleet(request, tmp_path_factory):
    names: list[str] = []
    for item in request.session.items:
        if getattr(item, "module", None) is request.module:
            for name in getattr(item.function, "scenarios", ()):
                if name not in names:
                    names.append(name)
    root = tmp_path_factory.mktemp("faults")
    fleet = Fleet(root, names)
    yield fleet
    fleet.close()
    # Nothing any scenario started may outlive the module, whatever the assertions said.
    stray = proctree.naming(root)
    for proc in stray:
        proc.kill()
    assert not stray, f"processes outlived the fault suite: {[describe(p) for p in stray]}"


# -- stop, parent death --------------------------------------------------------------------------
# Each launch's processes: warm, the supervisor, its launcher (labkit.launch.warm_launch) and the ranks; cold,
# the supervisor, DeepSpeed's runner and launch.py, a guard and a worker per rank.
PROCESSES = {"warm": 4, "cold": 7}


@pytest.mark.slow
@pytest.mark.parametrize("launch", ["warm", "cold"])
def test_stop_ends_every_process_within_6s(fleet, launch):
    r = fleet.result("stop" if launch == "warm" else "stop_cold")
    assert r["launch"] == launch, r
    assert r["status"] == "stopped"
    assert len(r["processes"]) >= PROCESSES[launch], r["processes"]
    assert r["stop_s"] < STOP_LIMIT_S and r["gone_s"] < STOP_LIMIT_S, r
    assert not r["survivors"] and not r["leftovers"], r
    # What the ranks recorded before the stop is kept.
    assert r["summary"]["steps_completed"] >= 3 and r["summary"]["status"] == "stopped"
    assert r["steps_recorded"] >= 3
    assert r["listed_status"] == r["reloaded_status"] == "stopped"


test_stop_ends_every_process_within_6s.scenarios = ("stop", "stop_cold")


@pytest.mark.slow
@pytest.mark.parametrize("launch", ["warm", "cold"])
def test_parent_sigkill_ends_every_rank_within_2s(fleet, launch):
    r = fleet.result("parent_kill" if launch == "warm" else "parent_kill_cold")
    assert r["launch"] == launch, r
    assert r["status"] == "stopped" and "parent process" in r["cause"], r
    # The limit, from the SIGKILL itself to the last rank gone.
    assert r["ranks_gone_after_kill_s"] < PARENT_KILL_LIMIT_S, r
    assert not r["survivors"] and not r["leftovers"], r


test_parent_sigkill_ends_every_rank_within_2s.scenarios = ("parent_kill", "parent_kill_cold")


# -- a rank fails ---------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAILURES))
def test_failing_rank_ends_run_within_5s_and_is_named(fleet, name):
    kind, rank, _step, expected = FAILURES[name]
    r = fleet.result(f"fail_{name}")
    summary = r["summary"]
    assert r["status"] == expected and summary["status"] == expected, summary
    assert summary["failed_rank"] == rank and summary["cause"].startswith(f"rank {rank}: "), summary
    cause = summary["cause"]
    if kind == "kill":
        assert "SIGKILL" in cause and "no traceback" in cause
    else:
        words = {"raise": "RuntimeError: injected fault", "oom": "OutOfMemoryError",
                 "cpualloc": "can't allocate memory", "memerror": "MemoryError"}
        assert words[kind] in cause, cause
    assert r["ended_s"] < FAILURE_LIMIT_S, r
    assert not r["leftovers"], r


test_failing_rank_ends_run_within_5s_and_is_named.scenarios = tuple(f"fail_{n}" for n in FAILURES)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAILURES))
def test_crash_at_step_k_keeps_exactly_k_minus_1_steps(fleet, name):
    """A fault at step k fires at the top of step k, before its forward pass. Then every rank's
    file holds exactly the step records 1..k-1, each a whole line (a peer cannot finish step k
    without the failed rank), the failed rank adds one `error` record unless it was SIGKILLed,
    and summary.json (written for failed runs too) counts k-1 completed steps."""
    kind, rank, step, _ = FAILURES[name]
    r = fleet.result(f"fail_{name}")
    assert r["steps"] == {0: list(range(1, step)), 1: list(range(1, step))}, r["steps"]
    assert r["complete_lines"] == {0: True, 1: True}
    tail = r["events"][rank][-1]
    assert tail == ("step" if kind == "kill" else "error"), r["events"][rank]
    assert r["summary"]["steps_completed"] == step - 1
    assert all(r["summary"]["per_rank"][str(other)]["steps"] >= step - 1 for other in (0, 1) if other != rank)
    assert Path(r["run_dir"], "summary.json").is_file()


test_crash_at_step_k_keeps_exactly_k_minus_1_steps.scenarios = tuple(f"fail_{n}" for n in FAILURES)


def _supervisor_for(tmp_path: Path, returncode: int) -> Any:
    from labkit.launch import supervisor

    (tmp_path / "logs").mkdir()
    (tmp_path / "launch.json").write_text(json.dumps({"argv": [], "env": {}, "world_size": 2, "heartbeat_s": 5,
                                                      "startup_timeout_s": 60}))
    (tmp_path / "rank1.exit").write_text(json.dumps({"rank": 1, "pid": 1, "returncode": returncode}))
    return supervisor


@pytest.mark.parametrize("counter,expected", [((0, 1), "oom"), ((3, 3), "failed"), ((None, None), "failed")])
def test_sigkill_is_oom_only_when_the_kernel_counted_an_oom_kill(tmp_path, monkeypatch, counter, expected):
    """exit -9 without a traceback: `oom` only if the cgroup's oom_kill counter rose during the run."""
    supervisor = _supervisor_for(tmp_path, -9)
    readings = iter(counter)
    monkeypatch.setattr(supervisor, "_cgroup_oom_kills", lambda: next(readings))
    outcome = supervisor.Supervisor(tmp_path, os.getpid()).diagnose(None)
    assert (outcome.status, outcome.rank) == (expected, 1)
    assert outcome.cause.startswith("rank 1: ") and ("OOM killer" in outcome.cause or "OOM kill" in outcome.cause)


def test_oom_kill_long_before_the_sigkill_does_not_make_it_oom(tmp_path, monkeypatch):
    """Every process here shares one cgroup: an OOM kill elsewhere, minutes earlier, is no evidence."""
    supervisor = _supervisor_for(tmp_path, -9)
    monkeypatch.setattr(supervisor, "_cgroup_oom_kills", lambda: 5)
    sup = supervisor.Supervisor(tmp_path, os.getpid())
    sup.oom_kill_times = [time.time() - 60]
    assert sup.diagnose(None).status == "failed"


def test_oom_kill_counter_is_readable_here():
    """The counter the -9 classification needs: cgroup v2 memory.events or v1 memory.oom_control."""
    from labkit.launch.supervisor import _cgroup_oom_kills

    if not any(Path(p).exists() for p in ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory")):
        pytest.skip("no memory cgroup on this machine")
    assert isinstance(_cgroup_oom_kills(), int)


# -- hangs --------------------------------------------------------------------------------------
@uses("hang")
def test_stuck_rank_ends_run_within_heartbeat_plus_5s(fleet):
    r = fleet.result("hang")
    # Rank 0 waits for rank 1 inside a collective: both fall silent, so the cause lists the
    # silent ranks without telling the stuck one from its waiting peer.
    assert r["status"] == "hung" and "heartbeat" in r["cause"], r
    assert r["steps"] == {0: [1, 2], 1: [1, 2]}
    assert HEARTBEAT_S <= r["ended_s"] < HANG_LIMIT_S, r
    assert not r["leftovers"], r


@uses("hang_quiet")
def test_run_without_per_step_records_still_shows_a_hang(fleet):
    r = fleet.result("hang_quiet")
    assert r["status"] == "hung" and "heartbeat" in r["cause"], r
    assert r["beat_steps"] and r["step_records"] == 0, r
    assert r["beat_steps"][-1] < 40  # rank 0 waits for rank 1 inside step 40's collective
    assert 0 < r["summary"]["steps_completed"] < 40  # counted from the heartbeats
    assert not r["leftovers"], r


@uses("dead_supervisor")
def test_run_store_does_not_list_a_run_with_a_dead_supervisor_as_running(fleet):
    r = fleet.result("dead_supervisor")
    assert r["listed_status"] == "failed" and "supervisor died" in r["listed_cause"], r
    # Listing only read: the ranks ran on and no summary was written, until recover_stale was called.
    assert r["left_before_recovery"] and not r["summary_before_recovery"], r
    assert r["recovered"] == [r["run_dir"]] and r["summary"]["status"] == "failed", r
    assert "supervisor died" in r["summary"]["cause"], r
    assert not r["leftovers"], r


@uses("slow_start")
def test_slow_start_is_not_a_hang(fleet):
    r = fleet.result("slow_start")
    assert r["rank1_start_to_ready_s"] >= 8.0, r  # the rank really was silent for longer than the heartbeat
    assert r["status"] == "finished", r
    assert not r["leftovers"], r


# -- the launcher dies ----------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("which", ["kill_runner", "kill_launch_py", "kill_warm_launcher"])
def test_killed_launcher_leaves_nothing_and_never_finishes(fleet, which):
    r = fleet.result(which)
    assert r["status"] not in ("finished", "running"), r
    assert r["status"] == "failed" and "launcher" in r["cause"], r
    assert r["gone_s"] < FAILURE_LIMIT_S, r
    assert not r["survivors"] and not r["leftovers"], r


test_killed_launcher_leaves_nothing_and_never_finishes.scenarios = ("kill_runner", "kill_launch_py",
                                                                    "kill_warm_launcher")


# -- two runs at once -----------------------------------------------------------------------------
@uses("pair")
def test_two_runs_at_once_own_ports_no_cross_talk(fleet):
    r = fleet.result("pair")
    assert r["a"]["port"] != r["b"]["port"]
    for name, values in PAIR.items():
        run = r[name]
        assert run["status"] == "finished", run["run_dir"]
        assert run["files"] == ["rank0.exit", "rank0.jsonl", "rank1.exit", "rank1.jsonl"]
        global_batch = values["micro_batch"] * 2
        for rank in (0, 1):
            records = run["records"][rank]
            assert {rec["rank"] for rec in records} == {rank}
            start_record = records[0]
            assert start_record["event"] == "start" and start_record["world_size"] == 2
            assert start_record["pid"] == run["exits"][rank]["pid"]  # the process this run's guard started
            steps = [rec for rec in records if rec["event"] == "step"]
            assert [rec["step"] for rec in steps] == list(range(1, values["steps"] + 1))
            for rec in steps:  # samples_per_s = global batch / step time
                assert rec["samples_per_s"] * rec["step_time_s"] == pytest.approx(global_batch, rel=1e-6)
        assert not run["leftovers"]


# -- the run store survives kills at any moment ---------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CHAOS)), ids=[f"{p}-{t}" for p, t in CHAOS])
def test_store_stays_readable_after_kill_at_random_moment(fleet, index):
    r = fleet.result(f"chaos_{index}")
    where = f"seed {r['seed']}, killed {r['killed']} {r['after_start_s']:.2f} s after start"
    assert r["summary"] is not None, where
    assert r["status"] in ("finished", "failed", "oom", "hung", "stopped"), where
    assert r["reloaded_status"] == r["status"], where
    assert not r["leftovers"], (where, r["leftovers"])
    assert strict_json_files(Path(r["run_dir"])) == [], where
    table = runs(Path(r["run_dir"]).parent)  # the store lists it with its final status
    assert table.set_index("run_id").loc[Path(r["run_dir"]).name, "status"] == r["status"]


test_store_stays_readable_after_kill_at_random_moment.scenarios = tuple(f"chaos_{i}" for i in range(len(CHAOS)))


# -- security -------------------------------------------------------------------------------------
# torch's TCPStore (rank 0's rendezvous server) listens on `::` whatever MASTER_ADDR says;
# labkit.rank.rendezvous binds it to 127.0.0.1 itself and labkit.launch.launcher pins gloo to `lo`.
@uses("stop")
def test_nothing_listens_beyond_loopback(fleet):
    listening = fleet.result("stop")["listening"]
    assert listening, "expected the TCPStore and gloo to listen"
    wide = [entry for entry in listening if entry[1] not in ("127.0.0.1", "::1")]
    assert not wide, f"sockets listening beyond loopback: {wide}"


def test_no_shell_true_in_labkit():
    offenders = []
    for path in sorted((REPO / "labkit").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            if name in ("os.system", "os.popen", "subprocess.getoutput", "subprocess.getstatusoutput"):
                offenders.append(f"{path.name}:{node.lineno}: {name}")
            for keyword in node.keywords:
                if keyword.arg == "shell" and not (isinstance(keyword.value, ast.Constant) and not keyword.value.value):
                    offenders.append(f"{path.name}:{node.lineno}: shell={ast.unparse(keyword.value)}")
    assert not offenders


@pytest.mark.slow
def test_make_lab_binds_loopback_with_token_auth():
    text = (REPO / "Makefile").read_text()
    recipe = re.search(r"^lab:.*\n((?:\t.*\n?)+)", text, re.MULTILINE)
    assert recipe, "no lab target"
    command = recipe.group(1).replace("\\\n", " ")
    assert "--ip=127.0.0.1" in command
    assert not re.search(r"--ip=(0\.0\.0\.0|\*|::)|token=''|token=\"\"|token= |password=''|"
                         r"disable_check_xsrf|allow_remote_access|--no-token", command), command
    # No config file in the project switches auth off behind the command line's back.
    for config in [*REPO.glob("jupyter_*config.*"), *(REPO / "notebooks").glob("jupyter_*config.*")]:
        assert not re.search(r"token\s*=\s*(''|\"\")|disable_check_xsrf\s*=\s*True", config.read_text()), config
    dry = subprocess.run(["make", "-n", "lab"], cwd=REPO, capture_output=True, text=True, timeout=60)
    jupyter = [line for line in dry.stdout.splitlines() if "jupyter lab" in line]
    assert jupyter and "--ip=127.0.0.1" in jupyter[-1], dry.stdout[-2000:]


# -- bad inputs are refused before any process starts ---------------------------------------------
BAD_CLI = [
    (["--micro-batch", "0"], "micro_batch"),
    (["--world-size", "100000"], "world_size"),
    (["--world-size", "2", "--micro-batch", "32", "--train-batch", "100"], "train_batch"),
    (["--lr", "-1"], "lr"),
    (["--lr", "nan"], "lr"),
    (["--heartbeat-s", "0"], "heartbeat_s"),
    (["--startup-timeout-s", "-5"], "startup_timeout_s"),
    (["--grad-accum", "-2"], "grad_accum"),
    (["--steps", "0"], "steps"),
    (["--hidden", "0"], "hidden"),
    (["--depth", "0"], "depth"),
    (["--dataset-size", "8", "--micro-batch", "64"], "micro_batch"),
    (["--census-every", "0"], "census_every"),
    (["--warmup-steps", "-1"], "warmup_steps"),
    (["--seed", "-1"], "seed"),
    (["--stop-at-target"], "stop_at_target"),
    (["--target-loss", "-1"], "target_loss"),
    (["--device-memory-budget-bytes", "0"], "device_memory_budget_bytes"),
    (["--hostfile", "/no/such/hostfile"], "hostfile"),
    (["--ds-override", '{"zero_optimisation": {"stage": 2}}'], "ds_overrides"),
    (["--ds-override", '{"train_batch_size": 8}'], "ds_overrides"),
    (["--ds-override", "not json"], "ds_overrides"),
    (["--ds-override", "[1, 2]"], "ds_overrides"),
    (["--ds-override", '{"zero_optimization": {"stage3_no_such_knob": 1}}'], "ds_overrides.zero_optimization"),
    (["--example", "offload", "--stage", "0"], "offload_optimizer"),
    (["--example", "pytorch", "--world-size", "2"], "world_size"),
    (["--example", "pytorch", "--stage", "2"], "stage"),
]
# Refused by argparse itself (exit 2, "argument --flag: ..."): the flag is named.
BAD_CLI_TYPES = [
    (["--micro-batch", "abc"], "--micro-batch"),
    (["--lr", "fast"], "--lr"),
    (["--example", "bert"], "--example"),
    # Fields with a fixed set of values are argparse choices (listed by --help).
    (["--stage", "5"], "--stage"),
    (["--precision", "fp8"], "--precision"),
    (["--optimizer", "lamb"], "--optimizer"),
    (["--lr-scaling", "cubic"], "--lr-scaling"),
]


def _cli_args(args: list[str], out: Path) -> list[str]:
    base = ["run", "--out", str(out)]
    return base + (args if "--example" in args else ["--example", "zero3", *args])


@pytest.mark.parametrize("args,field", BAD_CLI, ids=[f"{f}:{' '.join(a)[:40]}" for a, f in BAD_CLI])
def test_bad_cli_input_is_refused_naming_the_field(args, field, tmp_path, monkeypatch, capsys):
    # In-process (the fleet's runs start in this process's threads, so nothing global is patched):
    # Run.start() creates the run directory before it starts the supervisor, so no directory
    # means no process.
    from labkit import cli

    monkeypatch.setenv("LABKIT_RUNS_DIR", str(tmp_path / "runs"))
    out = tmp_path / "out"
    code = cli.main(_cli_args(args, out))
    err = capsys.readouterr().err
    assert code == 2
    assert re.search(rf"^error: {re.escape(field)}: \S", err, re.MULTILINE), err
    assert not out.exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("args,flag", BAD_CLI_TYPES, ids=[a[1] for a, _ in BAD_CLI_TYPES])
def test_bad_cli_value_types_are_refused_naming_the_flag(args, flag, tmp_path, capsys):
    from labkit import cli

    with pytest.raises(SystemExit) as info:
        cli.main(_cli_args(args, tmp_path / "out"))
    assert info.value.code == 2
    assert f"argument {flag}: " in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_bad_cli_inputs_end_to_end_start_nothing(tmp_path):
    """The real `python -m labkit run`: exit code 2, the field named, no run directory, no process."""
    # One bad value, one bad triplet, one bad DeepSpeed override, one impossible combination.
    wanted = ("micro_batch", "train_batch", "ds_overrides", "offload_optimizer")
    cases = [next(case for case in BAD_CLI if case[1] == field) for field in wanted]
    env = {**os.environ, "LABKIT_RUNS_DIR": str(tmp_path / "runs")}
    procs = []
    for number, (args, field) in enumerate(cases):  # side by side: each pays DeepSpeed's import
        out = tmp_path / f"out{number}"
        procs.append((subprocess.Popen([sys.executable, "-m", "labkit", *_cli_args(args, out)], cwd=REPO, env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), field, out))
    for proc, field, out in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, err[-2000:]
        assert f"error: {field}: " in err, err[-2000:]
        assert not out.exists()
    assert not (tmp_path / "runs").exists()
    assert not proctree.naming(tmp_path)


def test_out_directory_in_use_is_refused(tmp_path, capsys):
    from labkit import cli

    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    assert cli.main(_cli_args(["--steps", "2"], out)) == 2
    assert "is not empty" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]


# Widget values: the control panel (labkit.ui.panel) builds its RunConfig from the controls, so a
# bad combination is refused by Launch with the field named, and nothing starts.
BAD_WIDGETS = [
    ({"example": "pytorch"}, "world_size"),             # the plain loop is one process; the panel asks 2 ranks
    ({"example": "offload", "stage": 0}, "offload_optimizer"),
    ({"micro_batch": 5000}, "micro_batch"),             # more than each rank's share of dataset_size 1024
]


@pytest.mark.parametrize("values,field", BAD_WIDGETS, ids=[f for _, f in BAD_WIDGETS])
def test_bad_widget_values_are_refused_naming_the_field(values, field, tmp_path):
    panel_module = pytest.importorskip("labkit.ui.panel")
    panel = panel_module.LabPanel(root=tmp_path / "runs", **{**SMALL, "steps": 5})
    try:
        for name, value in values.items():
            panel.controls[name].value = value
        assert panel.launch() is None and panel.run is None
        assert f"{field}: " in panel.message.value, panel.message.value
        assert not (tmp_path / "runs").exists()
    finally:
        panel.close()

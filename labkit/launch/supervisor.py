"""Supervises one run: starts DeepSpeed's launcher, watches the ranks, ends every process.

    python -m labkit.launch.supervisor RUN_DIR --parent-pid PID [--lease-fds FD,FD]

`labkit.launch.run.Run.start()` starts this in its own session (a warm launch: the zygote forks it, and it forks
the ranks through `labkit.launch.warm_launch` instead of DeepSpeed's launcher; a spawned one, on GPUs: it starts the
ranks' guards through `labkit.launch.warm_launch`). It exists because the
`deepspeed` launcher does not protect its children (measured with 0.19.8: signalling only
its PID leaves the ranks running; it exits 0 when launch.py is SIGKILLed; a stuck rank
hangs for 10 minutes). So this process:

- starts the launcher in a new process group and becomes the subreaper of its tree, so
  ranks orphaned by a killed launcher are still ours to find and end;
- reads every rank's records as they arrive; success is judged from the ranks' `done`
  records, never from the launcher's exit code;
- ends the run when a rank fails (naming the root-cause rank, not a peer that merely
  lost its connection), when a rank falls silent past the heartbeat (after a startup
  allowance for JIT op builds), when asked to stop (SIGTERM), or when the parent (the
  Jupyter kernel, the CLI) dies;
- ends a run by SIGTERM to the whole group and the tree, a grace period, then SIGKILL;
- writes summary.json atomically, whatever happened.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from labkit.core.failures import classify_exit, describe_exit, is_knock_on, last_exception_line
from labkit.core.files import read_json, write_json_atomic
from labkit.core.records import RecordTail, rank_file, rank_log
from labkit.launch import proctree
from labkit.launch.launch_spec import LAUNCH_FILE, LaunchSpec
from labkit.launch.multinode import pdsh_failed_hosts, rank_hosts, stop_remote
from labkit.launch.warm_launch import ForkedLauncher
from labkit.rank.faults import supervisor_exit_delay_s
from labkit.rank.script import TEARDOWN_SIGNALS
from labkit.runtime.build_locks import StaleLockSweeper
from labkit.runtime.ops import DEFAULT_EXTENSIONS_DIR

POLL_S = 0.2
SETTLE_S = 1.0        # after a first failure, wait this long for peers' records to name the root cause
GRACE_S = 3.0         # SIGTERM -> SIGKILL (CPU ranks)
KILL_WAIT_S = 2.0     # after SIGKILL, how long to wait for the processes to be gone (CPU ranks)
# GPU ranks: a process ends only once the driver has torn down its CUDA context; with tens of GB allocated
# (a rank at its memory limit, the max-batch search's probes) that takes seconds, more under load. Stop waits
# that long before it reports a process left (and before the device lease it holds is free for the next run).
GPU_GRACE_S = 15.0
GPU_KILL_WAIT_S = 30.0
DONE_GRACE_S = 3.0    # after every rank's done record, how long the launcher may take to exit
OOM_WINDOW_S = 3.0    # an oom_kill count rise this close to a rank's SIGKILL makes it an OOM kill
LOCK_POLL_S = 1.0     # before the first step: how often to look at op-build locks (stale ones are removed,
                      # held ones are builds in progress: not a hang)
PR_SET_CHILD_SUBREAPER = 36


def stop_timeouts(accelerator: str | None) -> tuple[float, float]:
    """(SIGTERM grace, wait after SIGKILL) for ranks on `accelerator` (DS_ACCELERATOR of the run; None: unknown,
    treated as a GPU): a CUDA context of tens of GB needs seconds to tear down, a CPU rank none."""
    return (GRACE_S, KILL_WAIT_S) if accelerator == "cpu" else (GPU_GRACE_S, GPU_KILL_WAIT_S)


def log(message: str) -> None:
    """A timestamped line in supervisor.log: what the supervisor saw and did, and when."""
    now = time.time()  # one reading: a second boundary between two readings put stamps 1 s off
    print(f"{time.strftime('%H:%M:%S', time.localtime(now))}.{int(now * 1000) % 1000:03d} {message}", flush=True)


@dataclass
class RankState:
    rank: int
    tail: RecordTail
    pid: int | None = None
    local: bool = True          # on this host: its pid can be checked here
    last_step: int = 0
    last_progress: float = field(default_factory=time.monotonic)
    done: bool = False
    warning: str | None = None  # a done record's warning (a script's teardown abort judged finished)
    error: dict[str, Any] | None = None
    vanished_at: float | None = None

    def absorb(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            self.last_progress = time.monotonic()
            event = record.get("event")
            if event == "start":
                self.pid = record.get("pid")
                self.local = record.get("host") in (None, socket.gethostname())
            elif event in ("step", "beat"):  # "beat": runs with per-step telemetry off
                self.last_step = record["step"]
            elif event == "done":
                self.done = True
                self.warning = record.get("warning")
            elif event == "error":
                self.error = record


@dataclass
class Outcome:
    status: str                 # finished / failed / oom / hung / stopped
    cause: str | None = None
    rank: int | None = None


class Supervisor:
    def __init__(self, run_dir: Path, parent_pid: int, lease_fds: tuple[int, ...] = ()):
        self.run_dir = run_dir
        self.parent_pid = parent_pid
        self.parent = proctree.ProcessWatch(parent_pid)
        self.lease_fds = lease_fds  # GPU and port leases: the launcher holds them too (labkit.launch.device_lease)
        self.spec = spec = LaunchSpec.from_dict(_read_run_file(run_dir / LAUNCH_FILE))
        self.argv = spec.argv
        # launch.json keeps only what labkit set; an exported job (`labkit export`) too runs in the
        # environment of whoever starts it.
        self.env: dict[str, str] = {**os.environ, **spec.env}
        self.world_size = spec.world_size
        self.heartbeat_s = spec.heartbeat_s
        self.startup_timeout_s = spec.startup_timeout_s
        # A warm launch (labkit.launch.zygote forked this supervisor) or a spawned one (a GPU run): the ranks are
        # started here, not by DeepSpeed's runner.
        self.forked = spec.forked_launch()
        self.multi_node = spec.multi_node
        self.script_mode = spec.script  # labkit.rank.script: a learner's script on every rank
        # Multi-node: each rank's host as the hostfile names it, to name the node a rank died on.
        self.hosts = rank_hosts(spec.hostfile) if spec.hostfile else []
        # pdsh jobs: their ranks are ended over ssh (mpirun and srun end their own on SIGTERM).
        self.remote_stop = self.multi_node and spec.launcher == "pdsh"
        self.ranks = [RankState(r, RecordTail(rank_file(run_dir, r))) for r in range(self.world_size)]
        self.stop_reason: str | None = None
        self.oom_kills_seen = _cgroup_oom_kills()
        self.oom_kill_times: list[float] = []  # wall times at which a poll saw the count rise
        self.launch_py: psutil.Process | None = None
        self.grace_s, self.kill_wait_s = stop_timeouts(self.env.get("DS_ACCELERATOR"))
        self.lock_sweeper = StaleLockSweeper(self.env.get("TORCH_EXTENSIONS_DIR") or DEFAULT_EXTENSIONS_DIR)
        self.next_lock_poll = 0.0
        # Before step 1, the time in which a live process held an op-build lock in the run's op cache: the ranks
        # wait on a build (a niced one on a busy machine took over 15 minutes), which the startup allowance does not
        # count. Any op's build counts: the ranks cannot be seen waiting on one lock rather than another.
        self.build_wait_s = 0.0
        self.building_since: float | None = None  # the poll that last saw a build in progress

    # -- lifecycle ---------------------------------------------------------------------
    def run(self) -> Outcome:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self._on_stop_signal)
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # not Linux: orphans are then found through the process group only
        (self.run_dir / "logs").mkdir(exist_ok=True)
        argv = list(self.argv)
        # Per-rank logs: the launcher's own option, inserted before the user module.
        argv.insert(argv.index("--module"), f"--enable_each_rank_log={self.run_dir / 'logs'}")
        self.launcher: subprocess.Popen | ForkedLauncher
        if self.forked is not None:  # its ranks inherit the lease descriptors through the fork
            self.launcher = ForkedLauncher(self.forked, self.env, self.run_dir / "logs",
                                           self.run_dir / "launcher.log", spawn=self.spec.launch == "spawned")
            argv = self.launcher.args
        else:
            with open(self.run_dir / "launcher.log", "ab") as launcher_log:
                self.launcher = subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL, stdout=launcher_log,
                                                 stderr=subprocess.STDOUT, start_new_session=True,
                                                 pass_fds=self.lease_fds,
                                                 # Multi-node: the runner reads `.deepspeed_env` from its working
                                                 # directory and pdsh `cd`s every node into it: the shared run dir.
                                                 cwd=self.run_dir if self.multi_node else None)
        self.started = time.monotonic()
        how = {"warm": "warm launch (ranks forked from the zygote)", "spawned": "spawned launch (ranks started here)",
               "cold": "launcher"}[self.spec.launch]
        log(f"{how} pid {self.launcher.pid}: {' '.join(argv)}")
        write_json_atomic(self.run_dir / "status.json", {
            "status": "running", "supervisor_pid": os.getpid(), "launcher_pid": self.launcher.pid,
            "pgid": self.launcher.pid, "started_at": time.time(), "host": host_identity()})
        try:
            outcome = self.watch()
        except BaseException as exc:  # a bug here must still end the run's processes
            outcome = Outcome("failed", f"supervisor error: {type(exc).__name__}: {exc}")
            raise
        finally:
            log(f"outcome: {outcome}")
            still_running = "; ".join(self.terminate())
            log(f"still running after the stop: {still_running}" if still_running
                else "every process of the run has ended")
        return outcome

    def _on_stop_signal(self, signum: int, _frame: object) -> None:
        self.stop_reason = self.stop_reason or f"stopped by request ({signal.Signals(signum).name})"

    def watch(self) -> Outcome:
        while True:
            now = time.monotonic()
            for state in self.ranks:
                state.absorb(state.tail.poll())
            if self.stop_reason:
                return Outcome("stopped", self.stop_reason)
            if not self.parent.alive():
                return Outcome("stopped", f"parent process {self.parent_pid} exited")
            if all(state.done for state in self.ranks):
                # Every record is on disk: give the launcher a moment, then end what lingers
                # (launch.py polls once a second and interpreter teardown is slow).
                log("every rank recorded done; waiting briefly for the launcher to exit")
                for state in self.ranks:
                    if state.warning:
                        log(f"warning: {state.warning}")
                log(f"launcher exit code {self.launcher_exit(timeout=DONE_GRACE_S)}")
                return Outcome("finished")
            self.watch_oom_kills()
            failure = self.first_failure(now)
            launcher_code = self.launcher.poll()
            launch_py_died = launcher_code is None and self.launch_py_died()
            if failure or launcher_code is not None or launch_py_died:
                self.settle()
                if all(state.done for state in self.ranks):
                    # The last done records landed while this pass looked elsewhere and the
                    # launcher exited 0 meanwhile: a finished run, not a failed one.
                    return Outcome("finished")
                return self.diagnose(self.launcher.poll(), launch_py_died)
            hung = self.hung_ranks(now)
            if hung:
                return Outcome("hung", hung, None)
            self.watch_build_locks(now)
            time.sleep(POLL_S)

    def watch_build_locks(self, now: float) -> None:
        """Before the first step, every LOCK_POLL_S: remove op-build locks no process holds (an interrupted build
        left them; the ranks would wait on them forever), with a line saying so (labkit.runtime.build_locks); and
        count the time a live process holds one (a build in progress) as building, not as startup."""
        if any(state.last_step for state in self.ranks) or now < self.next_lock_poll:
            return
        self.next_lock_poll = now + LOCK_POLL_S
        for lock in self.lock_sweeper.poll(now):
            log(f"removed a stale build lock {lock.path} (no process held it: an interrupted build of op "
                f"{lock.op} left it, and the ranks would have waited on it forever)")
        if self.building_since is not None:
            self.build_wait_s += now - self.building_since
        held = self.lock_sweeper.held
        if held and self.building_since is None:
            log(f"waiting on a build: {'; '.join(lock.describe() for lock in held)} (not counted against the "
                f"startup allowance of {self.startup_timeout_s:g} s)")
        self.building_since = now if held else None

    def building_s(self, now: float) -> float:
        """How long the ranks have waited on op builds so far (labkit.runtime.build_locks)."""
        return self.build_wait_s + (now - self.building_since if self.building_since is not None else 0.0)

    def launch_py_died(self) -> bool:
        """DeepSpeed's launch.py (the runner's child, the ranks' parent) is gone while the runner
        lives on: the runner only notices when it is next scheduled and exits 0 (0.19.8), which
        took seconds on a loaded machine, while the orphaned ranks kept training. A warm or spawned launch has no
        launch.py: its launcher's own exit says it."""
        if self.forked is not None:
            return False
        if self.launch_py is None:
            try:
                self.launch_py = next((c for c in psutil.Process(self.launcher.pid).children()
                                       if "deepspeed.launcher.launch" in c.cmdline()), None)
            except psutil.Error:
                return False
            return False
        return not proctree.alive(self.launch_py)

    def watch_oom_kills(self) -> None:
        kills = _cgroup_oom_kills()
        if kills is not None and self.oom_kills_seen is not None and kills > self.oom_kills_seen:
            self.oom_kill_times.append(time.time())
            log(f"the cgroup's oom_kill count rose to {kills}")
        self.oom_kills_seen = kills

    def launcher_exit(self, timeout: float) -> int | None:
        try:
            return self.launcher.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def settle(self) -> None:
        """Give peers a moment to write their own error records before choosing the root cause."""
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline:
            for state in self.ranks:
                state.absorb(state.tail.poll())
            time.sleep(POLL_S / 2)
        self.launcher.poll()

    # -- what went wrong ---------------------------------------------------------------
    def exit_info(self, rank: int) -> dict[str, Any] | None:
        return read_json(self.run_dir / f"rank{rank}.exit")

    def first_failure(self, now: float) -> bool:
        for state in self.ranks:
            if state.error:
                return True
            if _failed_exit(self.exit_info(state.rank)):
                return True
            if state.pid and state.local and not state.done and not psutil.pid_exists(state.pid):
                state.vanished_at = state.vanished_at or now
                if now - state.vanished_at > SETTLE_S:  # the guard writes the exit file just after
                    return True
        return False

    def diagnose(self, launcher_code: int | None, launch_py_died: bool = False) -> Outcome:
        """The root cause: the earliest failure that is not a knock-on of another rank's."""
        evidence = []  # (knock_on, time, rank, status, cause)
        for state in self.ranks:
            info = self.exit_info(state.rank)
            # A spawned rank's guard that died itself (its exit recorded by the launcher): its worker, orphaned, may
            # still have logged the other ranks' teardown as its own error, a knock-on of this death.
            guard_died = info is not None and info.get("recorded_by") == "launcher" and _failed_exit(info)
            if state.error and not guard_died:
                record = state.error
                message = (record.get("message") or "").strip().splitlines()
                text = f"{record['error_type']}: {message[0] if message else ''}".rstrip(": ")
                status = "oom" if record.get("oom") else "failed"
                evidence.append((is_knock_on(text), record.get("wall_time", 0.0), state.rank, status, text))
            elif info and _failed_exit(info):
                mtime = (self.run_dir / f"rank{state.rank}.exit").stat().st_mtime
                if info["returncode"] == -9:
                    # SIGKILL leaves no traceback of its own: an older one in the log is not its cause.
                    status, text = (self.classify_remote_sigkill() if self.multi_node
                                    else self.classify_sigkill(mtime))
                else:
                    log_text = self.rank_log(state.rank)
                    status, text = classify_exit(log_text, info["returncode"])
                    if self.script_mode and status == "failed" and not last_exception_line(log_text) \
                            and info["returncode"] in TEARDOWN_SIGNALS:
                        text += self.script_abort_hint(state)
                if guard_died:
                    text = f"its rank guard (pid {info['pid']}) {text}"
                evidence.append((is_knock_on(text), mtime, state.rank, status, text))
            elif state.vanished_at is not None:
                evidence.append((False, time.time(), state.rank, "failed",
                                 "process vanished without an error record or exit status"))
        if evidence:
            _, _, rank, status, text = min(evidence)
            where = f" on node {self.hosts[rank]}" if rank < len(self.hosts) else ""
            return Outcome(status, f"rank {rank}{where}: {text}", rank)
        if launcher_code is not None:
            who = (f"the {self.spec.launch} launcher (labkit.launch.warm_launch)" if self.forked
                   else "DeepSpeed launcher")
            return Outcome("failed", f"{who} exited with code {launcher_code} before every rank "
                           f"finished (last steps: {self.last_steps()}){self.failed_nodes()}; see launcher.log")
        if launch_py_died:
            pid = f" (pid {self.launch_py.pid})" if self.launch_py is not None else ""
            return Outcome("failed", f"DeepSpeed's launch.py{pid} died before every rank "
                           f"finished (last steps: {self.last_steps()}); see launcher.log")
        return Outcome("failed", "run ended without a cause on record")

    @staticmethod
    def script_abort_hint(state: RankState) -> str:
        """Why a script's SIGABRT or SIGSEGV is a failure (labkit.rank.script judges a script's exit)."""
        if state.last_step:
            return (f" before its script exited cleanly (last step recorded: {state.last_step}; no exit record "
                    "with status 0)")
        return (" (the script calls no labkit.record, so labkit cannot tell an abort in training from the known "
                "C++ teardown abort at exit; one labkit.record line per step lets it)")

    def classify_sigkill(self, exited_at: float) -> tuple[str, str]:
        """A rank SIGKILLed without a traceback (its guard recorded that at `exited_at`): OOM only if
        the cgroup's oom_kill count rose around that moment. The count is the whole cgroup's, so
        an OOM kill elsewhere in the run's lifetime must not turn a plain `kill -9` into "oom"."""
        self.watch_oom_kills()
        if self.oom_kills_seen is None:
            return "failed", describe_exit(-9)  # no counter to ask: the hint names the OOM killer as likely
        if any(exited_at - OOM_WINDOW_S <= t <= exited_at + OOM_WINDOW_S for t in self.oom_kill_times):
            return "oom", "killed by the kernel's OOM killer (SIGKILL, no traceback)"
        return "failed", "killed by SIGKILL (no traceback; the kernel recorded no OOM kill then)"

    def failed_nodes(self) -> str:
        """Multi-node: the nodes pdsh reported failing (a lost ssh connection, a node gone), as text."""
        if not self.multi_node:
            return ""
        try:
            failed = pdsh_failed_hosts((self.run_dir / "launcher.log").read_text(errors="replace"))
        except OSError:
            return ""
        return "".join(f"; node {host}: " + ("ssh connection failed (exit 255)" if code == 255 else
                                              f"its launch exited with code {code}")
                       for host, code in failed.items())

    @staticmethod
    def classify_remote_sigkill() -> tuple[str, str]:
        """A multi-node rank's SIGKILL: this machine's OOM counter says nothing about that node
        (its ranks run under the node's sshd, not in this cgroup), so no OOM claim either way."""
        return "failed", ("killed by SIGKILL (no traceback); if the node's kernel log (dmesg) shows an "
                          "OOM kill then, it ran out of host memory")

    def rank_log(self, rank: int) -> str:
        log = rank_log(self.run_dir, rank)
        return log.read_text(errors="replace") if log else ""

    def last_steps(self) -> str:
        return ", ".join(f"rank {s.rank}: {s.last_step}" for s in self.ranks)

    def hung_ranks(self, now: float) -> str | None:
        silent = []
        for state in self.ranks:
            if state.done:
                continue
            if state.last_step == 0:
                # Process start, distributed init and JIT op builds come before step 1; a build in progress
                # (its lock held by a live process) is progress, however slow the machine.
                if now - self.started - self.building_s(now) > self.startup_timeout_s:
                    silent.append(state.rank)
            elif now - state.last_progress > self.heartbeat_s:
                silent.append(state.rank)
        if not silent:
            return None
        built = self.building_s(now)
        builds = f", not counting {built:.0f} s of op builds" if built >= 1 else ""
        return (f"no progress from rank(s) {silent} within the heartbeat ({self.heartbeat_s:g} s; "
                f"startup allowance {self.startup_timeout_s:g} s{builds}); last steps: {self.last_steps()}")

    # -- ending every process ----------------------------------------------------------
    def stop_remote_ranks(self) -> dict[str, str]:
        """End this run's processes on every node (only this run's: labkit.launch.multinode.stop_remote),
        before anything here is signalled, and check they are gone."""
        hosts = list(dict.fromkeys(self.hosts))
        log(f"ending this run's processes on {', '.join(hosts)} over ssh")
        left = stop_remote(self.run_dir, hosts)
        for host in hosts:
            log(f"{host}: {left[host]}" if host in left else f"{host}: none of this run's processes is left")
        return left

    def tree(self) -> list[psutil.Process]:
        """Every process below this one (the subreaper of the run's tree) and in the launcher's process group."""
        return proctree.union(proctree.descendants(os.getpid(), itself=False), proctree.group(self.launcher.pid))

    def terminate(self) -> list[str]:
        """End every process of the run; returns what could not be verified gone (empty: all gone)."""
        left = [f"{host}: {what}" for host, what in self.stop_remote_ranks().items()] if self.remote_stop else []
        if self.remote_stop:
            # Not SIGTERM: the runner's handler would `pdsh pkill -f ... deepspeed.launcher.launch`,
            # ending every DeepSpeed launch of this user on those hosts. Its ranks are gone already.
            try:
                os.kill(self.launcher.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        # The grace is the ranks': a worker exits, its guard records how. DeepSpeed's launch.py does not exit
        # on SIGTERM (0.19.8: it lingers until SIGKILL), so once no rank is left, what remains gets SIGKILL at
        # once. mpirun and srun (multi-node, not pdsh) end their remote ranks on SIGTERM: they get the grace too.
        waited = proctree.alive if self.multi_node and not self.remote_stop else proctree.is_rank
        survivors = proctree.terminate(self.tree, grace_s=self.grace_s, kill_wait_s=self.kill_wait_s,
                                       groups=[self.launcher.pid], wait_for=waited)
        self.launcher.poll()
        reap_children()
        for path in remove_shm_segments(self.spec.master_addr, self.spec.master_port):
            log(f"removed {path}")
        return left + [f"pid {p.pid}" for p in survivors if proctree.alive(p)]


def host_identity() -> dict[str, str]:
    """Where a PID means something: this host (and boot) and PID namespace. A run store on a shared
    filesystem, or one written from a container, holds PIDs of processes this process cannot see;
    `Run` only declares a supervisor dead when its status.json names the same identity."""
    def read(path: str) -> str:
        try:
            return Path(path).read_text().strip() if path.startswith("/proc/sys") else os.readlink(path)
        except OSError:
            return ""

    return {"hostname": socket.gethostname(), "boot_id": read("/proc/sys/kernel/random/boot_id"),
            "pid_namespace": read("/proc/self/ns/pid")}


def remove_shm_segments(master_addr: str, master_port: int) -> list[Path]:
    """Unlink the shared-memory buffers of DeepSpeed's CPU all-reduce (ops/csrc/cpu/comm/shm.cpp).

    Each local rank creates /dev/shm/deepspeed_allreduce_buffer_<uid>_<master_addr>_<master_port>_<rank>
    (~66 MB) and DeepSpeed never unlinks it: every CPU run leaked world_size x 66 MB of RAM
    (15 GB of this machine's 24 GB after a few hours of lab work). The names carry the run's own
    port, so only its buffers match; call this once every process of the run has ended.
    """
    addr, port = master_addr, master_port
    removed = []
    for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_*"):
        try:
            path.unlink()
            removed.append(path)
        except OSError:
            continue
    return removed


def _failed_exit(info: dict[str, Any] | None) -> bool:
    """A rank's exit file says it failed: a non-zero code, unless its guard judged a script's crash
    a teardown abort after a clean exit (labkit.rank.script.judge_exit)."""
    return info is not None and info["returncode"] != 0 and not info.get("teardown_abort")


def _read_run_file(path: Path) -> dict[str, Any]:
    """A JSON file the run cannot go on without (Run wrote it before starting the supervisor)."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise RuntimeError(f"{path} is missing or not a JSON object: the run directory changed under its supervisor")
    return data


def reap_children() -> None:
    """As subreaper we inherit orphaned ranks; collect their exit status so no zombie stays."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _cgroup_oom_kills() -> int | None:
    """The OOM-kill counter of this process's memory cgroup (the ranks share it): proof that a
    SIGKILLed rank was the OOM killer's victim. cgroup v2 keeps it in memory.events, cgroup v1
    in memory.oom_control (both as `oom_kill N`); None where neither can be read."""
    for path in _oom_counter_files():
        try:
            for line in path.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            continue
    return None


def _oom_counter_files() -> list[Path]:
    root = Path("/sys/fs/cgroup")
    files = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:  # "0::/path" (v2) or "4:memory:/path" (v1)
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            files.append(root / path.lstrip("/") / "memory.events")
        elif "memory" in controllers.split(","):
            files.append(root / "memory" / path.lstrip("/") / "memory.oom_control")
    # Inside a cgroup namespace /proc/self/cgroup may show "/" while the mount is the cgroup itself.
    files += [root / "memory.events", root / "memory" / "memory.oom_control"]
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Supervise one labkit run.")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--lease-fds", default="", help="inherited lease descriptors to hand to the launcher")
    args = parser.parse_args(argv)
    lease_fds = tuple(int(fd) for fd in args.lease_fds.split(",") if fd)
    supervisor = Supervisor(args.run_dir, args.parent_pid, lease_fds)
    outcome = Outcome("failed", "supervisor crashed")
    try:
        outcome = supervisor.run()
    finally:
        from labkit.launch.summary import summarize

        config = _read_run_file(args.run_dir / "config.json")
        summary = summarize(args.run_dir, config, status=outcome.status, cause=outcome.cause,
                            failed_rank=outcome.rank)
        write_json_atomic(args.run_dir / "summary.json", summary)
        write_json_atomic(args.run_dir / "status.json", {"status": outcome.status, "cause": outcome.cause,
                                                         "finished_at": time.time()})
        # Fault suite: a supervisor slow to exit after its summary holds the run's device lease meanwhile.
        time.sleep(supervisor_exit_delay_s())
    return 0


if __name__ == "__main__":
    sys.exit(main())

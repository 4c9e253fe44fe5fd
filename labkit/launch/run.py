"""`Run`: the handle notebooks, widgets and the CLI hold on one launched run.

    run = Run(RunConfig(example="zero3", world_size=2, steps=20)).start()
    run.wait()            # or run.stop()
    run.status            # running / finished / failed / oom / hung / stopped (only reads)
    run.summary           # summary.json as a dict

`start()` writes the run directory, then starts `labkit.launch.supervisor`, which owns every
process of the run and outlives nothing: if this Python process dies, the supervisor
notices and ends the run. If the supervisor itself dies first (SIGKILLed, OOM-killed), the run
is `lost`: `recover()` (which `wait()` and `stop()` call) ends what it left and writes its summary.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from labkit.core.config import ConfigError, RunConfig, hostfile_slots
from labkit.core.files import read_json, write_json_atomic, write_text_atomic
from labkit.core.records import RecordTail, rank_file
from labkit.launch import device_lease, proctree, zygote
from labkit.launch.launch_spec import LaunchSpec
from labkit.launch.launcher import build_command, command_text
from labkit.launch.store import check_output_dir, new_run_dir
from labkit.launch.summary import rank_records, summarize
from labkit.launch.warm_launch import WARM_ENV, spawn_spec, warm_spec
from labkit.launch.zygote import ForkedSupervisor
from labkit.runtime.devices import Devices, detect_devices

FINAL_STATUSES = ("finished", "failed", "oom", "hung", "stopped")
STOP_TIMEOUT_S = 6.0
LOST_CAUSE = ("the run's supervisor died without ending the run; its processes may still run "
              "(Run.recover() or `labkit runs` ends them and writes summary.json)")
SUPERVISOR_EXIT_WAIT_S = 10.0  # wait() gives a done run's supervisor this long to exit (it may hold a lease longer)


def stop_timeout_s(accelerator: str | None) -> float:
    """How long `stop()` waits for the supervisor to end a run on `accelerator` (its DS_ACCELERATOR): its SIGTERM
    grace and SIGKILL wait (labkit.launch.supervisor.stop_timeouts: GPU ranks tear down CUDA contexts), plus a
    margin."""
    from labkit.launch.supervisor import stop_timeouts

    grace, kill_wait = stop_timeouts(accelerator)
    return max(STOP_TIMEOUT_S, grace + kill_wait + 1.0)


def run_name(config: RunConfig) -> str:
    stage = "torch" if config.stage is None else f"z{config.stage}"
    offload = "-off" if config.offload_optimizer else ""
    if config.script:
        return f"script-{Path(config.script).stem}-w{config.world_size}"
    model = "" if config.model == "mlp" else "-" + config.model.split(":")[0].split(".")[-1]
    return f"{config.example}{model}-{stage}{offload}-w{config.world_size}-b{config.global_batch}"


def launch_mode(argv: list[str], devices: Devices, world_size: int, *, warm: bool) -> tuple[str, str]:
    """(LaunchSpec.launch, what to say) for a launch command: unless `warm` is off (`--cold`), CPU runs of labkit's
    worker on one node fork their ranks from the zygote ("warm") and GPU ones have the supervisor start them
    ("spawned", labkit.launch.warm_launch: no fork after CUDA); multi-node and script runs use DeepSpeed's launcher.
    Pure."""
    if not warm:
        return "cold", "cold"
    if (warm_spec(argv) if devices.is_cpu else spawn_spec(argv, world_size)) is None:
        return "cold", "cold: multi-node and script runs use DeepSpeed's own launcher"
    return ("warm", "warm") if devices.is_cpu else ("spawned", "spawned")


COLD_WORDS = ("0", "false", "no", "off")  # LABKIT_WARM's spellings of "cold" (any case)
WARM_WORDS = ("", "1", "true", "yes", "on")


def warm_setting(env: Mapping[str, str] | None = None) -> bool:
    """LABKIT_WARM in `env` (default os.environ): unset or 1/true/yes/on: warm; 0/false/no/off: cold. Anything else
    is a ConfigError naming the variable, rather than silently warm."""
    value = (os.environ if env is None else env).get(WARM_ENV)
    if value is None or value.strip().lower() in WARM_WORDS:
        return True
    if value.strip().lower() in COLD_WORDS:
        return False
    raise ConfigError(WARM_ENV, f"must be 0 (cold launches; also false, no, off) or 1 (warm; also true, yes, on), "
                      f"got {value!r}")


def warm_by_default() -> bool:
    """Runs launch warm (on a GPU, spawned) unless LABKIT_WARM=0 (or false, no, off: `warm_setting`; the CLI's --cold,
    the panel's "cold launch" box)."""
    return warm_setting()


def warm_up(env: dict[str, str] | None = None) -> zygote.Zygote | None:
    """Start this process's zygote now, in the background, so that the first warm run finds it preloaded, and lend
    it to the processes started from here (a notebook's `!labkit run`, the tests' CLI runs and kernels): the panel
    calls it when shown, the test session at its start. Nothing on a GPU machine (GPU runs launch spawned) or with warm
    launches off (None)."""
    base_env = {**os.environ, **(env or {})}
    if not warm_setting(base_env) or not detect_devices().is_cpu:
        return None
    # A run's whole environment, not only what the imports fix: the zygote loads the built ops, and a PATH with
    # another ninja first would make torch rebuild them (labkit.launch.launcher.build_command).
    _, run_env = build_command(RunConfig(example="zero3", world_size=1), Path(tempfile.gettempdir()), master_port=0,
                               base_env=base_env, accelerator="cpu")
    return zygote.share(run_env)


def check_extra_env(env: Any) -> dict[str, str]:
    """`env` (what a Run or the panel adds to the ranks' environment) as a dict of str to str, or a ConfigError naming
    `env` and the culprit: a variable's name non-empty, without "=" or NUL; its value a string without NUL. Pure."""
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise ConfigError("env", f"must be a dict of variable names to strings, got {type(env).__name__}")
    for name, value in env.items():
        if not isinstance(name, str) or not name or "=" in name or "\0" in name:
            raise ConfigError("env", f"{name!r} is not a variable name (a non-empty string without '=')")
        if not isinstance(value, str):
            raise ConfigError("env", f"{name}={value!r}: the value must be a string (an environment holds only "
                              f"strings), got {type(value).__name__}")
        if "\0" in value:
            raise ConfigError("env", f"{name}={value!r}: the value holds a NUL character")
    return dict(env)


def _pid_in(status: dict[str, Any]) -> int | None:
    """The supervisor's pid a status.json names, when it is an integer (a damaged file's is not)."""
    pid = status.get("supervisor_pid")
    return pid if isinstance(pid, int) and not isinstance(pid, bool) else None


class Run:
    def __init__(self, config: RunConfig, *, out: str | os.PathLike | None = None,
                 root: str | os.PathLike | None = None, env: dict[str, str] | None = None, launcher: str = "pdsh",
                 warm: bool | None = None):
        """`out`: the run directory to use (must be empty or absent); else a new one under `root`.
        `launcher`: DeepSpeed's multi-node launcher of a run with a hostfile, pdsh or openmpi.
        `warm`: fork the ranks from this process's zygote (labkit.launch.zygote), which imported torch and
        DeepSpeed once, instead of DeepSpeed's launcher starting four interpreters per rank (single-node CPU runs
        of labkit's worker); on GPUs, have the supervisor start each rank's guard as launch.py would (`launch_mode`);
        others launch cold. None: warm unless LABKIT_WARM=0 (`labkit run --cold`; `warm_setting`)."""
        self.config = config
        self.launcher = launcher
        self.warm = warm_by_default() if warm is None else warm
        self.launch_mode: str | None = None  # after start(): "warm", "spawned", or "cold" and why
        self._out = Path(out) if out is not None else None
        self._root = root
        self._extra_env = check_extra_env(env)  # before anything is written: a ConfigError naming env
        self.run_dir: Path | None = None
        self._supervisor: subprocess.Popen | ForkedSupervisor | None = None
        self._stop_requested = False
        self._progress_tail: RecordTail | None = None  # rank 0's file, read incrementally by progress()
        self._progress = 0
        self.device_ids: list[str] = []  # the devices (or emulated slots) this run leased

    @classmethod
    def load(cls, run_dir: str | os.PathLike) -> Run:
        """Reopen a past run (after a kernel restart, or from another process)."""
        run_dir = Path(run_dir)
        config = RunConfig.from_saved(json.loads((run_dir / "config.json").read_text()))
        run = cls(config)
        run.run_dir = run_dir
        return run

    @property
    def _dir(self) -> Path:
        """The run directory, for code that only runs once the run was started (or loaded)."""
        if self.run_dir is None:
            raise RuntimeError("this run has not been started: it has no run directory yet")
        return self.run_dir

    # -- starting ----------------------------------------------------------------------
    def start(self) -> Run:
        if self.run_dir is not None:
            raise RuntimeError(f"this run was already started in {self.run_dir}")
        if not self.config.script:
            from labkit.models.builders import check_importable

            check_importable(self.config)  # a bad import string fails here, before anything is launched
        base_env = {**os.environ, **self._extra_env}
        from labkit.launch.environment import check_environment

        multinode = bool(self.config.hostfile) or self.launcher != "pdsh"
        # LABKIT_FAULT, TORCH_EXTENSIONS_DIR, ...: refused here, not in a rank; a multi-node run's paths are the nodes'
        check_environment(base_env, paths=not multinode)
        if multinode:
            from labkit.launch.multinode import check_run_launcher

            check_run_launcher(self.launcher, self.config.hostfile, base_env.get("PATH", ""))
        if self._out is not None:
            check_output_dir(self._out, "--out")  # a file there, or a path that cannot be made: before any lease
        devices = detect_devices()
        # Refuses busy GPUs before anything is written; takes free ones, not always the first N.
        kind, candidates, count = self._lease_plan(devices, base_env)
        self.device_ids, leases = device_lease.take_free(kind, candidates, count,
                                                         f"a run starting in process {os.getpid()}")
        try:
            port, port_lease = device_lease.take_port()
            leases += port_lease
            # CPU ranks leasing emulated slots still launch as CPU ranks (--num_gpus).
            return self._launch(devices, base_env, leases, [] if devices.is_cpu else self.device_ids, port)
        finally:
            device_lease.release(leases)  # the supervisor holds its own copies for the run's lifetime

    def _lease_plan(self, devices: Devices, base_env: dict[str, str]) -> tuple[str, list[str], int]:
        """(lease kind, devices the run may lease, how many it needs). Multi-node runs lease nothing
        (the cluster scheduler's business); CPU ranks share the cores, unless CI emulates devices."""
        if self.config.hostfile:
            return devices.accelerator, [], 0
        if devices.is_cpu:
            emulated = device_lease.emulated_ids(base_env)
            return "emulated", emulated, self.config.world_size if emulated else 0
        return devices.accelerator, device_lease.visible_ids(
            devices.device_count, base_env.get(devices.visible_devices_env), devices.visible_devices_env), \
            self.config.world_size

    def _launch(self, devices: Devices, base_env: dict[str, str], leases: list[int], device_ids: list[str],
                port: int) -> Run:
        if self._out is not None:
            try:
                self._out.mkdir(parents=True, exist_ok=True)
            except OSError as exc:  # made a file or unmakeable since start()'s check
                raise ConfigError("out", f"--out {self._out} cannot be made: {exc.strerror or exc}") from None
            if any(self._out.iterdir()):
                raise FileExistsError(f"--out directory {self._out} is not empty")
            self.run_dir = self._out
        else:
            self.run_dir = new_run_dir(run_name(self.config), self._root)
        device_lease.describe(leases, f"run {self.run_dir}")
        argv, env = build_command(self.config, self.run_dir, master_port=port, base_env=base_env,
                                  accelerator=devices.accelerator, device_ids=device_ids or None,
                                  visible_devices_env=devices.visible_devices_env)
        if self.config.hostfile:
            # Before anything is launched: every node must see the run directory (ConfigError if
            # not), and gets the environment through DeepSpeed's `.deepspeed_env`, read from the
            # runner's working directory, which the supervisor makes the run directory.
            from labkit.launch.multinode import (
                OMPI_AS_ROOT,
                check_shared_run_dir,
                deepspeed_env_for,
                launcher_command,
                ssh_hosts,
            )

            argv = launcher_command(argv, self.launcher, Path(__file__).resolve().parents[1])
            hosts = ssh_hosts(self.launcher, list(hostfile_slots(self.config.hostfile)))
            if hosts:
                check_shared_run_dir(self.run_dir, hosts)
            write_text_atomic(self.run_dir / ".deepspeed_env", deepspeed_env_for(argv, env, self.launcher))
            if self.launcher == "openmpi" and os.geteuid() == 0:
                env.update(OMPI_AS_ROOT)
        write_json_atomic(self.run_dir / "config.json", self.config.to_dict())
        write_json_atomic(self.run_dir / "ds_config.json", self.config.ds_config())
        # Private: they hold the variables labkit and the caller (`env=`) set, which may be tokens.
        write_text_atomic(self.run_dir / "command.txt", command_text(argv, env, base_env) + "\n", private=True)
        mode, self.launch_mode = launch_mode(argv, devices, self.config.world_size, warm=self.warm)
        # Only what labkit (and `env=`) set, never the whole environment (cloud keys, tokens): the
        # supervisor inherits the rest from this process.
        spec = LaunchSpec.from_command(argv, {k: v for k, v in env.items() if os.environ.get(k) != v},
                                       world_size=self.config.world_size, heartbeat_s=self.config.heartbeat_s,
                                       startup_timeout_s=self.config.startup_timeout_s,
                                       launch=mode)
        spec.write(self.run_dir)
        if mode == "warm":
            try:
                self._supervisor = zygote.shared(env).supervise(self.run_dir, env, leases)
                return self
            except zygote.ZygoteUnavailable as exc:
                self.launch_mode = f"cold: {exc}"
                spec.replace(launch="cold").write(self.run_dir)  # the supervisor reads it once it starts
        with open(self.run_dir / "supervisor.log", "ab") as log:  # the supervisor keeps its own copy
            self._supervisor = subprocess.Popen(
                [sys.executable, "-m", "labkit.launch.supervisor", str(self.run_dir), "--parent-pid", str(os.getpid()),
                 "--lease-fds", ",".join(map(str, leases))],
                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                pass_fds=leases)
        return self

    # -- watching ----------------------------------------------------------------------
    @property
    def summary(self) -> dict[str, Any] | None:
        return read_json(self.run_dir / "summary.json") if self.run_dir else None

    @property
    def status(self) -> str:
        """created / starting / running, or the final status. Only reads: a run whose supervisor died
        without a summary (`lost`) reads "failed" until `recover()` ends what it left and writes one."""
        if self.run_dir is None:
            return "created"
        summary = self.summary
        if summary:
            return summary["status"]
        if self._supervisor_alive():
            return "running"
        if self._supervisor_lost():
            return "failed"
        return "starting"

    @property
    def lost(self) -> bool:
        """Its supervisor is gone and left no summary.json (SIGKILLed, OOM-killed, a reboot): nobody ends
        what it left running until someone calls `recover()`."""
        return self._supervisor_lost()

    def recover(self) -> bool:
        """End what a lost run's supervisor left running and write the summary it could not write; returns
        whether the run was lost. An explicit call, made where the run is the caller's to end: `wait()`,
        `stop()`, the CLI, the panel's own run, `labkit.launch.history.recover_stale`."""
        if not self._supervisor_lost():
            return False
        self._recover_from_dead_supervisor()
        return True

    @property
    def holds_devices(self) -> bool:
        """Whether the run may still hold its device lease: it leased devices and its supervisor (which
        holds the lease, with DeepSpeed's launcher, until it exits) is alive. A run that reads `done`
        still holds its GPUs for the seconds its supervisor takes to end."""
        return bool(self.device_ids) and self.run_dir is not None and self._supervisor_alive()

    @property
    def done(self) -> bool:
        return self.status in FINAL_STATUSES

    @property
    def cause(self) -> str | None:
        summary = self.summary
        if summary:
            return summary.get("cause")
        return LOST_CAUSE if self._supervisor_lost() else None

    def _status_file(self) -> dict[str, Any]:
        """The supervisor's status.json: {} when absent, unreadable or not an object (a damaged file must not break a
        listing)."""
        try:
            status = read_json(self.run_dir / "status.json") if self.run_dir else None
        except OSError:  # a directory, a permission
            return {}
        return status if isinstance(status, dict) else {}

    def _supervisor_pid(self) -> int | None:
        if self._supervisor is not None:
            return self._supervisor.pid
        return _pid_in(self._status_file())

    def _supervisor_alive(self) -> bool:
        if self._supervisor is not None:
            return self._supervisor.poll() is None
        pid = self._supervisor_pid()
        return pid is not None and pid > 0 and proctree.supervisor_alive(pid, self._dir)

    def _supervisor_lost(self) -> bool:
        """The supervisor is gone and left no summary.json: nobody is ending the run's processes."""
        if self.run_dir is None or self.summary or self._supervisor_alive():
            return False
        if self._supervisor is None:
            status = self._status_file()
            if _pid_in(status) is None:
                return False  # a reloaded run whose supervisor has not written status.json yet
            from labkit.launch.supervisor import host_identity

            if status.get("host") != host_identity():
                return False  # its PID means nothing here: another host, boot or PID namespace
        return not self.summary  # it writes summary.json just before it exits: look again

    @property
    def waiting_on(self) -> str | None:
        """What a run that has not reached its first step is waiting for, when it is an op build (or a
        stale build lock left by an interrupted one, which it would wait on forever); else None."""
        if self.run_dir is None or self.summary or self.progress() > 0:
            return None
        from labkit.runtime.build_locks import find_build_locks
        from labkit.runtime.ops import DEFAULT_EXTENSIONS_DIR

        spec = LaunchSpec.read(self.run_dir)
        env = spec.env if spec else {}
        extensions = (env.get("TORCH_EXTENSIONS_DIR") or os.environ.get("TORCH_EXTENSIONS_DIR")
                      or DEFAULT_EXTENSIONS_DIR)
        locks = find_build_locks(extensions)
        return "; ".join(lock.describe() for lock in locks) or None

    def records(self) -> dict[int, list[dict[str, Any]]]:
        """Every rank's records so far (complete lines only)."""
        return rank_records(self._dir, self.config.world_size)

    def progress(self) -> int:
        """Steps completed by rank 0 so far. Polled twice a second by the CLI: it reads only the
        bytes rank 0 wrote since the last call, so a poll costs the same at step 10 and 10,000."""
        if self.run_dir is None:
            return 0
        if self._progress_tail is None:
            self._progress_tail = RecordTail(rank_file(self.run_dir, 0))
        for record in self._progress_tail.poll():
            if record.get("event") in ("step", "beat"):  # "beat": per-step telemetry off
                self._progress = record["step"]
        return self._progress

    def wait(self, timeout: float | None = None, poll_s: float = 0.2) -> str:
        """Block until the run ends (or `timeout` seconds pass); returns the status.

        Ctrl-C (a kernel interrupt) stops the run before it is passed on: the kernel lives on, and
        its supervisor would keep the run going unattended."""
        try:
            return self._wait(timeout, poll_s)
        except KeyboardInterrupt:
            self.stop()
            raise

    def _wait(self, timeout: float | None = None, poll_s: float = 0.2) -> str:
        deadline = None if timeout is None else time.monotonic() + timeout
        # Not `while not self.done`: `status` reads "failed" as soon as the supervisor is gone,
        # and a supervisor killed without writing summary.json leaves the ranks to us.
        while self.run_dir is not None and not self.summary:
            if self.recover():
                break
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(poll_s)
        if self._supervisor is not None and self.done:
            try:
                self._supervisor.wait(timeout=SUPERVISOR_EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                pass
        return self.status

    # -- stopping ----------------------------------------------------------------------
    def stop(self, timeout: float | None = None) -> str:
        """End every process of the run (SIGTERM to the group, grace, SIGKILL); keep its records."""
        if self.run_dir is None or self.summary:
            return self.status
        if timeout is None:
            # Multi-node: the supervisor ends the remote ranks over ssh first; not cut short.
            from labkit.launch.multinode import REMOTE_STOP_TIMEOUT_S

            spec = LaunchSpec.read(self.run_dir)
            accelerator = (spec.env if spec else {}).get("DS_ACCELERATOR", os.environ.get("DS_ACCELERATOR"))
            timeout = stop_timeout_s(accelerator) + (REMOTE_STOP_TIMEOUT_S if self.config.hostfile else 0.0)
        self._stop_requested = True
        pid = self._supervisor_pid()
        if pid and self._supervisor_alive():
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        self._wait(timeout=timeout)
        if not self.summary:
            # The supervisor itself is stuck or gone: end its process group and the run's.
            self._recover_from_dead_supervisor(kill_supervisor=True)
        return self.status

    def _recover_from_dead_supervisor(self, kill_supervisor: bool = False) -> None:
        """End what the supervisor left running and write the summary it could not write."""
        status = self._status_file()
        groups = []
        # The launcher's group id comes from a file that may be days old: only a group one of this run's
        # processes is in.
        if status.get("pgid") and proctree.is_run_group(status["pgid"], self._dir):
            groups.append(status["pgid"])
        supervisor = self._supervisor_pid()
        if kill_supervisor and supervisor and self._supervisor_alive():
            groups.append(supervisor)  # its own session: start_new_session=True
        # Killed before it wrote status.json, it never told us the launcher's group: the launcher,
        # launch.py and every rank name the run directory on their command lines.
        proctree.terminate(lambda: proctree.run_processes(self._dir), grace_s=0.0, kill_wait_s=2.0, groups=groups)
        spec = LaunchSpec.read(self._dir)
        if self.config.hostfile:
            # Multi-node: the ranks on the other nodes are not ours to find here; end them over ssh.
            from labkit.launch.multinode import ssh_hosts, stop_remote

            hosts = ssh_hosts(spec.launcher if spec else "pdsh", list(hostfile_slots(self.config.hostfile)))
            if hosts:
                stop_remote(self._dir, hosts)
        if self._supervisor is not None:
            try:
                self._supervisor.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        from labkit.launch.supervisor import remove_shm_segments

        if spec:
            remove_shm_segments(spec.master_addr, spec.master_port)
        if not self.summary:
            records = self.records()
            if records and all(any(r.get("event") == "done" for r in rank) for rank in records.values()):
                # Every rank recorded done: the training is complete, only its ending was lost.
                outcome = ("finished", "every rank finished; the supervisor died before it ended the run, "
                                       "so its leftover processes were killed")
            elif self._stop_requested:
                outcome = ("stopped", "stopped by request; the run's supervisor did not answer, "
                                      "so its processes were killed")
            else:
                outcome = ("failed", "the run's supervisor died; its processes were killed")
            summary = summarize(self._dir, self.config.to_dict(), status=outcome[0], cause=outcome[1])
            write_json_atomic(self._dir / "summary.json", summary)
            write_json_atomic(self._dir / "status.json", {"status": outcome[0], "cause": outcome[1],
                                                          "finished_at": time.time()})

    def __repr__(self) -> str:
        return f"Run({self.run_dir}, status={self.status})"


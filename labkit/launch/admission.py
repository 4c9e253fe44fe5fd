"""Admission: start a run only while it fits beside the runs already going, so a notebook on a small
laptop gets slower, never killed.

    from labkit.launch.admission import Admission
    admission = Admission.here()                 # this machine: its memory, cores, what it learned
    estimate = admission.estimate(config)        # bytes of each rank and of the launchers, rank threads
    admission.check_alone(estimate, "stage 3")   # NotEnoughMemory (a ConfigError) if it cannot fit at all
    decision = admission.decide(estimate, running)   # running: [(Estimate, its process tree's RSS now)]
    decision.admit, decision.describe()          # False, "waiting for memory: needs 1.73 GB, 0.94 GB available"

What a run costs, before it starts (`estimate`): per rank, the model states the memory model predicts
(`labkit.core.memory.model_state_bytes`: parameters, gradients, optimizer states; on a GPU only what
optimizer offload keeps on the host counts here) plus its activations on CPU, plus the BASE RSS of a
DeepSpeed rank on this machine (Python, torch, DeepSpeed, gloo: ~480 MiB here, 40x the states of the
notebooks' ci models); per run, the launcher's processes (supervisor, DeepSpeed's runner and launch.py,
~620 MiB here, and one rank guard per rank). The base and launcher figures are LEARNED from the runs
this machine has seen (`LearnedMemory`: the largest of the last `KEEP` observations, kept per machine in
the run store, so a new kernel starts with what the last one learned); before any run, the priors below,
measured here.

What the machine has now (`Capacity`): `psutil.virtual_memory().available`, or, with `LABKIT_MEMORY_LIMIT_BYTES`
set (a simulated smaller machine), at most that limit less what this process's tree (the kernel or the CLI,
and every run it started) holds now; less a safety margin (`MARGIN_FRACTION` of the machine, at least
`MIN_MARGIN_BYTES`). The runs already going hold part of their estimate already (it is in their RSS, so it
is gone from `available`): a new run is admitted while its estimate plus what the running ones may still
grow into (estimate less RSS, when positive) fits in what is left. A run that needs more than the machine
could ever give it (`room_bytes`: its memory, or the limit, less this process tree and the margin) is refused
before anything launches (`NotEnoughMemory`); one that only needs more than other programs leave free now
waits, and says so: they may let go of it.

Cores (CPU ranks): at most one rank process per core (`RANKS_PER_CORE`) and one rank thread per core
(`THREADS_PER_CORE`; OpenMP threads per rank x ranks, `labkit.launch.launcher.threads_per_rank`) at once.
A small run's time is mostly its processes starting (Python, torch, DeepSpeed: one busy thread each), so one
rank process per core keeps every core busy without runs taking turns; once they train, OpenMP threads beyond
the cores spin-wait on each other (measured below: 37x slower steps), so runs that overlap get their share of the
cores (`share_cores`: two 1-rank runs on 2 cores, one thread each) and a run whose threads would go past the
cores waits. Timed comparisons need stricter: `labkit.study.sweep.fair_parallel` (threads x ranks x launches <=
cores: no neighbour even while it starts), which the sweep applies. Measured on the lab's 2-core machine
(docs/laptop.md): a second 2-rank run beside the first (4 rank threads and processes) finished notebook 03 no
sooner and took it past 3.5 GB; one rank process per core runs 02's and 04's 1-rank runs two at a time, one thread
each. A run alone is never held back for cores. Devices (GPUs, emulated slots): the leases a run takes
(`labkit.launch.device_lease`) must be free.
The queue is first in, first out: a run that waits holds back the ones behind it, so none starves.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from labkit.core.config import ConfigError, RunConfig
from labkit.core.schema import host_bytes, state_bytes
from labkit.launch.proctree import arguments

MiB = 2**20
MEMORY_LIMIT_ENV = "LABKIT_MEMORY_LIMIT_BYTES"
# The OS, the browser and the page cache the ranks' libraries live in need room too: never fill the last
# 10% (a laptop swapping is the slowness this module exists to avoid), nor the last 256 MiB of a small limit.
MARGIN_FRACTION = 0.10
MIN_MARGIN_BYTES = 256 * MiB
# CPU ranks at once per core (see the module doc): one busy process per core while they start, and one OpenMP
# thread per core once they train. Threads beyond the cores spin-wait on each other (libgomp, torch's OpenMP,
# spins before it sleeps, while the thread it waits for is descheduled): measured 2026-11-29 on the lab's 2-core
# machine, a 1-rank MLP of 2 threads took 3.2 ms a step alone and 120 ms beside another such run; notebook 02's
# six 1-rank runs, two such at a time, 50-290 ms against 18-34 ms one at a time, its stage-1 offload ratio (whole
# step) 0.61x instead of 0.87x (docs/laptop.md; until then this allowed two threads per core).
RANKS_PER_CORE = 1
THREADS_PER_CORE = 1
# Priors, until this machine has finished a run: measured 2026-11-24 on the lab's 2-core machine (torch
# 2.13.0 CPU, DeepSpeed 0.19.8), ci-sized MLP runs (hidden 1024, depth 2), psutil every 0.5 s plus the
# ranks' own peak RSS (ru_maxrss): a rank's peak RSS less its census (states) and saved activations was
# 481.5 MiB (ZeRO-3, 2 ranks), 479.0 (ZeRO-1, 2 ranks), 406.0 (plain PyTorch, 1 process): the largest.
PRIOR_RANK_BASE_BYTES = round(481.5 * MiB)
# The launcher's processes of one run, same runs: DeepSpeed's runner 299 MiB and launch.py 299 MiB (both
# import torch and DeepSpeed), labkit's supervisor 23 MiB; and each rank's guard (labkit.rank.guard) 22.
PRIOR_LAUNCHER_BYTES = 621 * MiB
GUARD_BYTES = 22 * MiB
KEEP = 20  # observations kept per figure: the estimate is their largest
# How often a launcher of several runs (lessons.launch_all, the sweep) reads their process trees' RSS and
# admits the next: psutil walks each tree (~8 ms on the lab's machine), too costly for every poll.
SAMPLE_S = 1.0
# Saved activations of labkit's MLP per sample (the worker's saved-tensor count): the input, each hidden
# layer's ReLU output (the next Linear saves the same tensor) and the log-softmax output, 4 bytes each
# (fp32; bf16 halves the hidden ones: an upper bound), and the int64 label. Measured: 276,484 bytes for
# micro-batch 32 of input 100, hidden 1024 x 2, output 10; this gives 276,480.
ACTIVATION_ELEMENT_BYTES = 4
LABEL_BYTES = 8
_RANK_GUARD_MODULE = "labkit.rank.guard"
_WORKER_MODULE = "labkit.rank.worker"


class NotEnoughMemory(ConfigError):
    """A run that does not fit in this machine's memory even alone: refused before anything launches.
    `needed_bytes`: its estimate; `available_bytes`: the most runs could have here (`room_bytes`)."""

    def __init__(self, message: str, *, needed_bytes: int, available_bytes: int):
        super().__init__("memory", message)
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes


def gb(value: float) -> str:
    return f"{value / 1e9:.2f} GB"


# -- what a run costs --------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Estimate:
    """What one run will hold at its peak, and what it occupies, before it starts."""

    ranks: int            # rank processes on this machine
    rank_bytes: int       # each: base RSS + model states + activations (on CPU) + the built-in data
    launcher_bytes: int   # supervisor, DeepSpeed's runner and launch.py, the rank guards
    cpu_ranks: int = 0    # rank processes on the cores (CPU ranks), 0 for GPU ranks
    threads: int = 0      # their OpenMP threads
    devices: int = 0      # device leases it takes (GPUs, emulated slots)
    states_known: bool = True  # False: a model labkit cannot count before it has run once (base alone)
    data_bytes: int = 0   # of rank_bytes: the data each rank generates (`data_bytes`)

    @property
    def total_bytes(self) -> int:
        return self.ranks * self.rank_bytes + self.launcher_bytes

    def describe(self) -> str:
        known = "" if self.states_known else ", model states unknown until it has run once"
        data = (f", of which the generated data {self.data_bytes / MiB:,.0f} MiB"
                if self.data_bytes * 2 > self.rank_bytes else "")  # said where it is most of a rank
        return (f"{gb(self.total_bytes)} ({self.ranks} rank(s) x {self.rank_bytes / MiB:,.0f} MiB{data} + launcher "
                f"{self.launcher_bytes / MiB:,.0f} MiB{known})")


@dataclass(frozen=True)
class ModelFacts:
    """What sizes a model's ranks: parameters and saved-activation bytes per sample (None: unknown)."""

    n_params: int | None
    activation_bytes_per_sample: float | None


def model_signature(config: RunConfig) -> str:
    """The fields that decide a model's parameters and activations (its learned facts are kept by it)."""
    return json.dumps({k: getattr(config, k) for k in ("model", "data", "input_size", "hidden", "depth",
                                                         "output_size", "precision")}, sort_keys=True)


def builtin_model_facts(config: RunConfig) -> ModelFacts | None:
    """Counted without building anything for labkit's MLP; None for other models."""
    if config.model != "mlp" or config.script:
        return None
    from labkit.core.memory import n_params_mlp

    per_sample = ACTIVATION_ELEMENT_BYTES * (config.input_size + config.depth * config.hidden
                                             + config.output_size) + LABEL_BYTES
    return ModelFacts(n_params_mlp(config.input_size, config.hidden, config.depth, config.output_size), per_sample)


def data_bytes(config: RunConfig) -> int:
    """The lab's MLP data, which every rank generates in its own memory (labkit.models.data): the training inputs
    (fp32) and labels (int64) it holds, plus at the larger of two moments what it holds beside them: the teacher's
    activations while labelling them (inputs @ w1, its tanh, @ w2), or, where the run evaluates (`eval_every`), the
    training inputs drawn again to reach the teacher's weights for the held-out set (`make_eval_set`), with that set.
    0 for other data (not counted)."""
    if config.model != "mlp" or config.data or config.script:
        return 0
    from labkit.models.data import TEACHER_HIDDEN

    samples, width = config.dataset_size, config.input_size
    held = samples * (4 * width + 8)
    labelling = samples * 4 * (2 * TEACHER_HIDDEN + config.output_size)
    evaluation = samples * 4 * width + config.eval_samples * (4 * width + 8) if config.eval_every else 0
    return held + max(labelling, evaluation)


def estimate(config: RunConfig, *, rank_base_bytes: int, launcher_bytes: int, model: ModelFacts | None,
             is_cpu: bool = True, cores: int = 1, leases_devices: bool = False) -> Estimate:
    """The estimate of `config` on a machine whose rank base and launcher bytes are the ones given (pure).

    On CPU the model states and activations are host memory; on a GPU only what optimizer offload puts
    on the host is. Multi-node runs (a hostfile): only the launcher runs here, the ranks are the cluster's."""
    from labkit.core.memory import mlp_persistent_params, model_state_bytes
    from labkit.launch.launcher import threads_per_rank

    if config.hostfile:
        return Estimate(ranks=0, rank_bytes=0, launcher_bytes=launcher_bytes)
    states = activations = 0
    known = model is not None and model.n_params is not None
    if model is not None and model.n_params is not None:
        stage = config.stage or 0
        persistent = (mlp_persistent_params(config.input_size, config.hidden, config.depth, config.output_size)
                      if config.model == "mlp" and stage == 3 else 0)
        predicted = model_state_bytes(model.n_params, stage, config.world_size, config.precision,
                                      bool(config.offload_optimizer) and stage > 0, persistent_params=persistent,
                                      optimizer=config.optimizer)
        states = predicted["host_bytes"] + (predicted["device_bytes"] if is_cpu else 0)
    if is_cpu and model is not None and model.activation_bytes_per_sample is not None:
        activations = math.ceil(model.activation_bytes_per_sample * config.micro_batch)
    data = data_bytes(config)
    return Estimate(ranks=config.world_size, rank_bytes=rank_base_bytes + states + activations + data, data_bytes=data,
                    launcher_bytes=launcher_bytes + config.world_size * GUARD_BYTES,
                    cpu_ranks=config.world_size if is_cpu else 0,
                    threads=threads_per_rank(config, cores) * config.world_size if is_cpu else 0,
                    devices=config.world_size if leases_devices else 0, states_known=known)


def share_cores(configs: Mapping[str, RunConfig], cores: int) -> dict[str, RunConfig]:
    """The configs of CPU runs that will overlap (`lessons.launch_all`), each run whose `threads_per_rank` is unset
    given its share of the cores: the cores split evenly between as many runs as the widest run lets them hold at
    once (one rank process per core), so that runs training together never put more threads than cores on them
    (THREADS_PER_CORE). Where the widest run takes every core (notebook 03's 1- and 2-rank runs on 2 cores) the runs
    keep the default (cores / ranks: the thread counts the notebook teaches) and run one at a time; so does a run
    alone. A set `threads_per_rank` and a multi-node run (its ranks are the cluster's) are kept."""
    here = [c for c in configs.values() if not c.hostfile]  # a multi-node run's ranks are the cluster's
    if len(here) < 2:
        return dict(configs)
    at_once = max(1, min(len(here), (RANKS_PER_CORE * cores) // max(c.world_size for c in here)))
    return {label: c if c.threads_per_rank is not None or c.hostfile else
            dataclasses.replace(c, threads_per_rank=max(1, cores // (c.world_size * at_once)))
            for label, c in configs.items()}


# -- what the machine has ------------------------------------------------------------------------
@dataclass(frozen=True)
class Capacity:
    """What the admission may fill now: memory (after the margin), cores, devices (None: not leased)."""

    available_bytes: int
    cores: int
    devices: int | None = None

    @property
    def rank_limit(self) -> int:
        return RANKS_PER_CORE * self.cores

    @property
    def thread_limit(self) -> int:
        return THREADS_PER_CORE * self.cores


def memory_limit(env: dict[str, str] | None = None) -> int | None:
    """LABKIT_MEMORY_LIMIT_BYTES (an int or a float such as 8e9), or None when unset."""
    value = (os.environ if env is None else env).get(MEMORY_LIMIT_ENV, "").strip()
    if not value:
        return None
    try:
        limit = float(value)
    except ValueError:
        raise ConfigError(MEMORY_LIMIT_ENV, f"must be a number of bytes such as 8e9, got {value!r}") from None
    if not limit > 0 or math.isinf(limit):
        raise ConfigError(MEMORY_LIMIT_ENV, f"must be a positive number of bytes, got {value!r}")
    return int(limit)


def margin_bytes(machine_bytes: int) -> int:
    """The safety margin of a machine (or a simulated limit) of `machine_bytes`."""
    return max(MIN_MARGIN_BYTES, round(MARGIN_FRACTION * machine_bytes))


def available_bytes(*, vm_available: int, vm_total: int, limit: int | None, tree_rss: int) -> tuple[int, str]:
    """(what the admission may fill now, what limits it), pure: the machine's available memory, or with a simulated
    `limit` at most `limit - tree_rss` (this process and everything it started), less the safety margin."""
    free, source = vm_available, "psutil available"
    if limit is not None and limit - tree_rss < vm_available:
        free, source = limit - tree_rss, f"{MEMORY_LIMIT_ENV} {gb(limit)} less this process tree's {gb(tree_rss)}"
    return max(0, free - margin_bytes(limit if limit is not None else vm_total)), source


def room_bytes(*, vm_total: int, limit: int | None, tree_rss: int) -> tuple[int, str]:
    """(the most runs could ever have here, what it is), pure: the machine's memory, or the simulated limit, less
    this process tree (the kernel, with nothing of ours running) and the margin. A run needing more is refused;
    one that needs more than is available NOW (other programs hold it) waits instead: they may let go."""
    machine = vm_total if limit is None else min(limit, vm_total)
    source = f"{gb(vm_total)} of memory" if limit is None or limit >= vm_total else f"{MEMORY_LIMIT_ENV} {gb(limit)}"
    return (max(0, machine - tree_rss - margin_bytes(machine)),
            f"{source} less this process tree's {gb(tree_rss)} and a {MARGIN_FRACTION:.0%} safety margin")


def tree_rss(process: psutil.Process | None = None) -> int:
    """RSS summed over a process and all its descendants (this one by default); a process that ends
    while it is read counts 0."""
    process = process or psutil.Process()
    total = 0
    try:
        procs = [process, *process.children(recursive=True)]
    except psutil.Error:
        return 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            continue
    return total


def runs_module(cmdline: Sequence[str], module: str) -> bool:
    """Whether a command line is `python ... -m module ...` (DeepSpeed's launch.py names the rank guard
    too, as its `--module` argument: it is no guard)."""
    cmdline = arguments(cmdline)
    return "-m" in cmdline and cmdline.index("-m") + 1 < len(cmdline) and cmdline[cmdline.index("-m") + 1] == module


@dataclass(frozen=True)
class RunTree:
    """A running run's processes now: RSS of its ranks (each rank guard's descendants; warm, each forked worker and
    its descendants) and of the rest (supervisor, DeepSpeed's runner and launch.py or the warm launcher, the guards
    themselves)."""

    rank_bytes: int = 0
    launcher_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.rank_bytes + self.launcher_bytes


def run_tree(supervisor_pid: int | None) -> RunTree:
    """The RSS of a run's process tree (its supervisor's), split into ranks and launchers."""
    if not supervisor_pid:
        return RunTree()
    try:
        supervisor = psutil.Process(supervisor_pid)
        procs = [supervisor, *supervisor.children(recursive=True)]
    except psutil.Error:
        return RunTree()
    guards: set[int] = set()
    workers: set[int] = set()  # a warm launch's ranks: forked workers, no guard above them (labkit.launch.warm_launch)
    info: dict[int, tuple[int, int]] = {}  # pid -> (parent pid, rss)
    for proc in procs:
        try:
            info[proc.pid] = (proc.ppid(), proc.memory_info().rss)
            cmdline = proc.cmdline()
            if runs_module(cmdline, _RANK_GUARD_MODULE):
                guards.add(proc.pid)
            elif runs_module(cmdline, _WORKER_MODULE):
                workers.add(proc.pid)
        except psutil.Error:
            continue
    ranks = launchers = 0
    for pid, (parent, rss) in info.items():
        # A rank's: a worker, or below a guard or a worker (a guard itself is the launcher's, as GUARD_BYTES).
        node = pid if pid in workers else parent
        while node in info and node not in guards and node not in workers:
            node = info[node][0]
        if node in guards or node in workers:
            ranks += rss
        else:
            launchers += rss
    return RunTree(ranks, launchers)


def occupies(run: Any) -> bool:
    """Whether a run still occupies what the next launch needs: its ranks have not all recorded `done`
    (or an error), or it leased devices (GPUs, emulated slots) and its supervisor, which holds the lease
    with DeepSpeed's launcher until it exits, is still there: the next `Run.start()` would be refused.
    CPU ranks lease nothing, so their supervisor's teardown (a few seconds) does not hold back the next."""
    if getattr(run, "holds_devices", False):
        return True
    if run.done:
        return False
    for rank in range(run.config.world_size):
        try:
            with open(run.run_dir / f"rank{rank}.jsonl", "rb") as handle:
                handle.seek(0, os.SEEK_END)
                handle.seek(max(0, handle.tell() - 4096))
                tail = handle.read()
        except FileNotFoundError:
            return True
        if b'"event":"done"' not in tail and b'"event":"error"' not in tail:
            return True
    return False


# -- the decision ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Decision:
    admit: bool
    waiting_for: str | None = None  # "memory", "cores" (rank processes), "threads", "devices"
    needed: int = 0                 # bytes, rank processes or threads, devices the run would bring the machine to
    available: int = 0              # what there is of it

    def describe(self) -> str:
        if self.admit:
            return "admitted"
        if self.waiting_for == "memory":
            return f"waiting for memory: needs {gb(self.needed)}, {gb(self.available)} available"
        if self.waiting_for == "cores":
            return f"waiting for cores: {self.needed} rank processes, at most {self.available} at once"
        if self.waiting_for == "threads":
            return f"waiting for cores: {self.needed} rank threads, at most {self.available} at once"
        return f"waiting for devices: {self.needed} leases needed, {self.available} free"


def decide(candidate: Estimate, running: Sequence[tuple[Estimate, int]], capacity: Capacity, *,
           count_cores: bool = True) -> Decision:
    """Whether `candidate` may start beside `running` ((estimate, RSS of its process tree now) each), pure.

    Memory: its estimate plus what the running runs may still grow into (their estimate less their RSS,
    when positive) must fit in `capacity.available_bytes`. Cores (`count_cores`, CPU): with others running, all
    rank processes at most `capacity.rank_limit`, their threads `capacity.thread_limit`. Devices: the leases of
    all at most `capacity.devices`."""
    growth = sum(max(0, est.total_bytes - rss) for est, rss in running)
    needed = candidate.total_bytes + growth
    if needed > capacity.available_bytes:
        return Decision(False, "memory", needed, capacity.available_bytes)
    if count_cores and running:
        ranks = candidate.cpu_ranks + sum(est.cpu_ranks for est, _ in running)
        if ranks > capacity.rank_limit:
            return Decision(False, "cores", ranks, capacity.rank_limit)
        threads = candidate.threads + sum(est.threads for est, _ in running)
        if threads > capacity.thread_limit:
            return Decision(False, "threads", threads, capacity.thread_limit)
    if capacity.devices is not None:
        leases = candidate.devices + sum(est.devices for est, _ in running)
        if leases > capacity.devices:
            free = max(0, capacity.devices - sum(est.devices for est, _ in running))
            return Decision(False, "devices", candidate.devices, free)
    return Decision(True)


def admit_from(queue: Sequence[Estimate], running: Sequence[tuple[Estimate, int]], capacity: Capacity, *,
               count_cores: bool = True) -> tuple[int, Decision | None]:
    """How many runs at the head of `queue` may start now, in order, and why the next one waits (None when
    all may start). First in, first out: nothing overtakes a run that waits. Pure."""
    going = list(running)
    for index, candidate in enumerate(queue):
        decision = decide(candidate, going, capacity, count_cores=count_cores)
        if not decision.admit:
            return index, decision
        going.append((candidate, 0))  # it has started: none of its estimate is in its RSS yet
    return len(queue), None


def oversubscribed(config: RunConfig, candidate: Estimate, cores: int) -> str | None:
    """A warning for a run on this machine whose `threads_per_rank`, as set, puts more OpenMP threads than cores on
    it, or None (the default, cores / ranks, is not the learner's choice; a multi-node run's ranks are the nodes').
    A warning, not a refusal: that slowness is something a learner may want to see."""
    if config.threads_per_rank is None or config.hostfile or candidate.threads <= THREADS_PER_CORE * cores:
        return None
    return (f"threads_per_rank {config.threads_per_rank} x {candidate.cpu_ranks} rank(s) = {candidate.threads} "
            f"OpenMP threads on {cores} core(s): threads beyond the cores spin-wait on each other (on the lab's "
            f"2-core machine a 1-rank step of 3.2 ms took 120 ms with a second such run beside it, 4 threads on 2 "
            f"cores: docs/laptop.md); leave threads_per_rank out for cores / ranks")


def refusal(candidate: Estimate, room: int, label: str, where: str = "") -> NotEnoughMemory | None:
    """The error for a run that needs more than `room_bytes` (pure), or None when it can fit."""
    if candidate.total_bytes <= room:
        return None
    return NotEnoughMemory(
        f"{label} needs {gb(candidate.total_bytes)} but at most {gb(room)} is available to runs on this machine"
        f"{f' ({where})' if where else ''}: estimate {candidate.describe()}. Fewer ranks (world_size), a smaller "
        f"model{', micro-batch or dataset_size' if candidate.data_bytes else ' or micro-batch'}, or optimizer "
        f"offload on a GPU make it smaller",
        needed_bytes=candidate.total_bytes, available_bytes=room)


# -- what this machine has learned ----------------------------------------------------------------
@dataclass
class LearnedMemory:
    """Observations of this machine's runs, kept in the run store (`path`): rank base RSS, launcher RSS, and
    per model signature its parameters and activation bytes per sample. Figures are the largest of the last
    KEEP observations, the priors before any."""

    path: Path
    rank_base: list[int] = field(default_factory=list)
    launcher: list[int] = field(default_factory=list)
    models: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def for_machine(cls, root: str | os.PathLike | None = None) -> LearnedMemory:
        """This machine's file in the run store (`root`, default LABKIT_RUNS_DIR or runs/)."""
        from labkit.launch.store import default_root

        host = "".join(c if c.isalnum() or c in "-_." else "_" for c in socket.gethostname()) or "localhost"
        return cls.load(Path(root or default_root()) / ".admission" / f"{host}.json")

    @classmethod
    def load(cls, path: Path) -> LearnedMemory:
        from labkit.core.files import read_json

        data = read_json(path) or {}
        return cls(path, [int(v) for v in data.get("rank_base_bytes", [])][-KEEP:],
                   [int(v) for v in data.get("launcher_bytes", [])][-KEEP:], dict(data.get("models", {})))

    def save(self) -> None:
        from labkit.core.files import write_json_atomic

        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path, {"rank_base_bytes": self.rank_base[-KEEP:],
                                      "launcher_bytes": self.launcher[-KEEP:], "models": self.models})

    @property
    def rank_base_bytes(self) -> int:
        return max(self.rank_base) if self.rank_base else PRIOR_RANK_BASE_BYTES

    @property
    def launcher_bytes(self) -> int:
        return max(self.launcher) if self.launcher else PRIOR_LAUNCHER_BYTES

    def model(self, config: RunConfig) -> ModelFacts | None:
        builtin = builtin_model_facts(config)
        if builtin is not None:
            return builtin
        seen = self.models.get(model_signature(config))
        return ModelFacts(seen.get("n_params"), seen.get("activation_bytes_per_sample")) if seen else None

    def observe(self, config: RunConfig, summary: dict[str, Any], *, is_cpu: bool,
                launcher_peak_bytes: int | None = None) -> bool:
        """Learn from a run that ended: each rank's peak RSS less its measured states (those on the host)
        and activations (on CPU) is one base observation; `launcher_peak_bytes` (sampled while it ran) less
        its guards one launcher observation. Script runs teach nothing: their census is unknown. Returns
        whether anything was learned (then `save()`)."""
        if config.script or config.hostfile:
            return False
        learned = False
        per_rank = summary.get("per_rank") or {}
        activation_seen = 0
        for values in per_rank.values():
            peak, activation = values.get("peak_rss_bytes"), values.get("activation_bytes") or 0
            if not peak or values.get("param_bytes") is None:
                continue
            on_host = host_bytes(values) if not is_cpu else state_bytes(values)
            self.rank_base.append(int(peak - on_host - (activation if is_cpu else 0) - data_bytes(config)))
            activation_seen = max(activation_seen, activation)
            learned = True
        if launcher_peak_bytes:
            self.launcher.append(int(launcher_peak_bytes - config.world_size * GUARD_BYTES))
            learned = True
        if builtin_model_facts(config) is None and summary.get("n_params"):
            self.models[model_signature(config)] = {
                "n_params": int(summary["n_params"]),
                "activation_bytes_per_sample": activation_seen / config.micro_batch if activation_seen else None}
            learned = True
        self.rank_base, self.launcher = self.rank_base[-KEEP:], self.launcher[-KEEP:]
        return learned


# -- the thin object the launchers use ---------------------------------------------------------------
class Admission:
    """This machine's admission: learned figures, cores, devices; reads psutil when asked (`capacity`)."""

    def __init__(self, learned: LearnedMemory, *, is_cpu: bool, cores: int, devices: int | None = None):
        self.learned = learned
        self.is_cpu = is_cpu
        self.cores = cores
        self.devices = devices
        self._launcher_peaks: dict[int, int] = {}  # supervisor pid -> launcher RSS peak seen

    @classmethod
    def here(cls, root: str | os.PathLike | None = None) -> Admission:
        """This machine, as `Run.start()` will use it: CPU ranks share the cores; GPU runs and, in CI,
        emulated slots (LABKIT_EMULATED_DEVICES) lease devices."""
        from labkit.launch import device_lease
        from labkit.launch.launcher import usable_cores
        from labkit.runtime.devices import detect_devices

        found = detect_devices()
        emulated = device_lease.emulated_ids(dict(os.environ)) if found.is_cpu else []
        devices = len(emulated) if found.is_cpu else found.device_count
        # the cores the ranks may run on (a container's or a job's share), as their default thread count counts them
        return cls(LearnedMemory.for_machine(root), is_cpu=found.is_cpu, cores=usable_cores(),
                   devices=devices if devices else None)

    def estimate(self, config: RunConfig) -> Estimate:
        return estimate(config, rank_base_bytes=self.learned.rank_base_bytes,
                        launcher_bytes=self.learned.launcher_bytes, model=self.learned.model(config),
                        is_cpu=self.is_cpu, cores=self.cores, leases_devices=self.devices is not None)

    def capacity(self) -> Capacity:
        """What may be filled now (psutil, the simulated limit), the cores and the devices."""
        vm = psutil.virtual_memory()
        limit = memory_limit()
        free, _ = available_bytes(vm_available=vm.available, vm_total=vm.total, limit=limit,
                                  tree_rss=tree_rss() if limit is not None else 0)
        return Capacity(free, self.cores, self.devices)

    def check_alone(self, candidate: Estimate, label: str) -> None:
        """Raise NotEnoughMemory if `candidate` needs more than this machine (or the simulated limit) could give
        it with nothing else of ours running (`room_bytes`), and ConfigError if it leases more devices than there
        are."""
        if self.devices is not None and candidate.devices > self.devices:  # no lease would ever come free
            from labkit.core.config import ConfigError

            where = "LABKIT_EMULATED_DEVICES slots" if self.is_cpu else "GPUs"
            raise ConfigError("world_size", f"{label} leases {candidate.devices} devices, one per rank, but this "
                              f"machine has {self.devices} {where}: fewer ranks (world_size)")
        room, where = room_bytes(vm_total=psutil.virtual_memory().total, limit=memory_limit(), tree_rss=tree_rss())
        error = refusal(candidate, room, label, where)
        if error is not None:
            raise error

    def admit_alone(self, config: RunConfig, label: str) -> tuple[Estimate, Decision]:
        """A run started by itself (the CLI, the panel): its estimate, refused with NotEnoughMemory if it could
        never fit here, and whether it may start now, beside whatever other programs hold."""
        candidate = self.estimate(config)
        self.check_alone(candidate, label)
        return candidate, self.decide(candidate, [])

    def decide(self, candidate: Estimate, running: Sequence[tuple[Estimate, int]], *,
               count_cores: bool = True) -> Decision:
        return decide(candidate, running, self.capacity(), count_cores=count_cores)

    def sample(self, supervisor_pid: int | None) -> int:
        """The RSS of a running run's process tree now; keeps the launchers' peak for `learn`."""
        tree = run_tree(supervisor_pid)
        if supervisor_pid:
            self._launcher_peaks[supervisor_pid] = max(self._launcher_peaks.get(supervisor_pid, 0),
                                                       tree.launcher_bytes)
        return tree.total_bytes

    def learn(self, config: RunConfig, run_dir: str | os.PathLike | None, supervisor_pid: int | None = None) -> None:
        """After a run ended: learn from its summary (and the launcher peak sampled), and keep it."""
        from labkit.core.files import read_json

        summary = read_json(Path(run_dir) / "summary.json") if run_dir else None
        peak = self._launcher_peaks.pop(supervisor_pid, None) if supervisor_pid else None
        if summary and self.learned.observe(config, summary, is_cpu=self.is_cpu, launcher_peak_bytes=peak):
            self.learned.save()

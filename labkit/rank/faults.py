"""Fault hooks for the fault-injection suite, read from LABKIT_FAULT.

Format: comma-separated `kind@rankR:stepS`, e.g. `raise@rank1:step5` or
`hang@rank0:step3,kill@rank1:step4`. `slowstart@rankR:N` sleeps N seconds before
distributed init (a slow JIT build). Kinds:

  raise     RuntimeError                      kill      SIGKILL itself (no traceback)
  oom       torch.OutOfMemoryError            memerror  bare MemoryError
  cpualloc  the CPU allocator's RuntimeError  hang      sleep forever while alive
  exit      sys.exit(3)                       slowstart sleep N s at start

The run's supervisor has one: `slowexit@supervisor:N` sleeps N seconds after it wrote summary.json,
before it exits, still holding the run's device lease (a loaded machine's slow teardown).
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from dataclasses import dataclass

KINDS = ("raise", "kill", "oom", "memerror", "cpualloc", "hang", "exit", "slowstart")
SUPERVISOR_KINDS = ("slowexit",)
SUPERVISOR = -1  # Fault.rank of a fault of the supervisor
_SPEC = re.compile(r"(?P<kind>[a-z]+)@(?:rank(?P<rank>\d+)|(?P<supervisor>supervisor)):(?:step)?(?P<at>\d+)")


class FaultSpecError(ValueError):
    pass


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    at: int  # step number, or seconds for slowstart and slowexit


def parse_faults(spec: str) -> list[Fault]:
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        match = _SPEC.fullmatch(part)
        kinds = SUPERVISOR_KINDS if match and match["supervisor"] else KINDS
        if match is None or match["kind"] not in kinds:
            raise FaultSpecError(f"LABKIT_FAULT: cannot parse {part!r}; expected kind@rankR:stepS with kind in {KINDS} "
                                 f"or kind@supervisor:N with kind in {SUPERVISOR_KINDS}")
        faults.append(Fault(match["kind"], SUPERVISOR if match["supervisor"] else int(match["rank"]), int(match["at"])))
    return faults


def supervisor_exit_delay_s(spec: str | None = None) -> float:
    """Seconds the supervisor sleeps before it exits (`slowexit@supervisor:N`); 0 for a spec it cannot
    parse (the ranks fail on it and name it)."""
    spec = os.environ.get("LABKIT_FAULT", "") if spec is None else spec
    try:
        return float(sum(f.at for f in parse_faults(spec) if f.kind == "slowexit"))
    except FaultSpecError:
        return 0.0


class FaultHooks:
    def __init__(self, rank: int, spec: str | None = None):
        spec = os.environ.get("LABKIT_FAULT", "") if spec is None else spec
        self.faults = [f for f in parse_faults(spec) if f.rank == rank]

    def at_start(self) -> None:
        for fault in self.faults:
            if fault.kind == "slowstart":
                time.sleep(fault.at)

    def at_step(self, step: int) -> None:
        for fault in self.faults:
            if fault.kind != "slowstart" and fault.at == step:
                _inject(fault.kind)


def _inject(kind: str) -> None:
    import torch

    if kind == "raise":
        raise RuntimeError("injected fault: rank raised")
    if kind == "oom":
        raise torch.OutOfMemoryError("injected fault: out of memory (tried to allocate 80.00 GiB)")
    if kind == "memerror":
        raise MemoryError()
    if kind == "cpualloc":
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:118] data. DefaultCPUAllocator: "
                           "can't allocate memory: you tried to allocate 85899345920 bytes. Error code 12")
    if kind == "exit":
        sys.exit(3)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        while True:
            time.sleep(3600)

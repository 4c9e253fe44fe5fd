"""torch's op-build locks under TORCH_EXTENSIONS_DIR: who holds them, and the stale ones.

torch builds a JIT extension under a `lock` file in the op's folder (`torch.utils.file_baton`): the
builder creates it with O_EXCL and keeps it open, everyone else polls until it disappears. A build
interrupted hard (Ctrl-C during `make lab`, a timeout's SIGKILL) leaves the file behind, and every later
run then waits forever at step 0 with no message. A lock no process has open is stale: nothing will
ever remove it. `make ops` clears stale locks; a run waiting on a build says so (`Run.waiting_on`), and
its supervisor removes a lock it finds stale twice, STALE_CONFIRM_S apart (`StaleLockSweeper`), with a line in
supervisor.log: torch's `FileBaton.release` closes the lock before it removes it, so one look can catch a
finished build in between, whose own remove must not find the file gone.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

STALE_CONFIRM_S = 2.0  # a lock must look stale this long before a run removes it


@dataclass(frozen=True)
class BuildLock:
    path: Path
    op: str                 # the op's folder name (cpu_adam, fused_adam, deepspeed_shm_comm, ...)
    holder_pids: tuple[int, ...]  # processes that have the lock open (the build)
    certain: bool           # False when some processes' descriptors could not be read (another user's)

    @property
    def stale(self) -> bool:
        return not self.holder_pids and self.certain

    def describe(self) -> str:
        if self.holder_pids:
            return f"DeepSpeed is building op {self.op} (process {', '.join(map(str, self.holder_pids))}; {self.path})"
        if self.stale:
            return (f"stale build lock {self.path}: no process holds it (a build was interrupted); every run "
                    f"needing op {self.op} would wait on it forever: a run's supervisor removes it within seconds "
                    "(`make ops` too)")
        return f"build lock {self.path} for op {self.op}: held by a process this user cannot see, or stale"


def find_build_locks(extensions_dir: str | os.PathLike) -> list[BuildLock]:
    """Every build lock under `extensions_dir` (one level of op folders, and torch's per-version subfolders)."""
    root = Path(extensions_dir)
    paths = sorted(set(root.glob("*/lock")) | set(root.glob("*/*/lock")))
    if not paths:
        return []
    holders, certain = _open_files({p.resolve() for p in paths})
    return [BuildLock(p, p.parent.name, tuple(sorted(holders.get(p.resolve(), ()))), certain) for p in paths]


def report_stale_locks(extensions_dir: str | os.PathLike, clear: bool = False) -> list[BuildLock]:
    """Print every build lock found; with `clear`, remove the stale ones (no process holds them)."""
    locks = find_build_locks(extensions_dir)
    for lock in locks:
        if lock.stale and clear:
            lock.path.unlink(missing_ok=True)
            print(f"removed a stale build lock (an interrupted build left it; no process held it): {lock.path}")
        else:
            print(lock.describe())
    return locks


def _open_files(targets: set[Path]) -> tuple[dict[Path, set[int]], bool]:
    """Which processes have any of `targets` open, through /proc/<pid>/fd; and whether every process was readable."""
    found: dict[Path, set[int]] = {}
    certain = True
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except PermissionError:
            certain = False
            continue
        except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
            continue  # exited meanwhile
        for fd in fds:
            try:
                target = Path(os.readlink(fd))
            except OSError:
                continue
            if target in targets:
                found.setdefault(target, set()).add(int(entry.name))
    return found, certain


@dataclass
class StaleLockSweeper:
    """Removes the build locks under `extensions_dir` that no process holds, once each has looked stale on two
    polls at least `confirm_s` apart. `poll()` returns the locks it removed (the caller says so); `held` is the
    locks a live process held at the last poll (builds in progress)."""

    extensions_dir: str | os.PathLike
    confirm_s: float = STALE_CONFIRM_S
    held: list[BuildLock] = field(default_factory=list)
    _first_seen: dict[Path, float] = field(default_factory=dict)

    def poll(self, now: float | None = None) -> list[BuildLock]:
        now = time.monotonic() if now is None else now
        locks = find_build_locks(self.extensions_dir)
        self.held = [lock for lock in locks if lock.holder_pids]
        stale = {lock.path: lock for lock in locks if lock.stale}
        self._first_seen = {path: self._first_seen.get(path, now) for path in stale}
        removed = []
        for path, since in list(self._first_seen.items()):
            if now - since >= self.confirm_s:
                path.unlink(missing_ok=True)
                removed.append(stale[path])
                del self._first_seen[path]
        return removed

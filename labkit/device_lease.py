"""One run per GPU at a time: a run on GPUs that a live run holds is refused before it starts.

Two DeepSpeed runs on the same GPUs both start (each on its own port) and then compete for
device memory: one dies with an out-of-memory error that says nothing about its own batch,
or both crawl. A workshop notebook and the live panel can easily do that, so `Run.start()`
takes a lease on each GPU the run will use and refuses with `DevicesBusy` (a `ConfigError`
naming `world_size`) when another run holds one. CPU ranks share the cores instead and
take no lease; multi-node runs (a hostfile) are the cluster scheduler's business.

A lease is an flock on `<lease dir>/<accelerator><id>.lock`. `Run.start()` takes it and
hands the descriptor to the run's supervisor, which hands it on to DeepSpeed's launcher
(`pass_fds`): the kernel drops the lock when the last of them exits, even by SIGKILL, so a
lease never outlives its run, and a killed supervisor does not free GPUs its ranks still use.
Every run (CPU ones too) also leases its rendezvous port (`take_port`), so two runs started
at the same moment never pick the same one.
"""

from __future__ import annotations

import errno
import fcntl
import os
import tempfile
from pathlib import Path

from labkit.config import ConfigError

# Shared by every user of the machine (sticky, world-writable, like /tmp): GPUs are too.
DEFAULT_LEASE_DIR = Path(tempfile.gettempdir()) / "labkit-device-leases"


class DevicesBusy(ConfigError):
    """The GPUs a run needs are held by another live run."""

    def __init__(self, message: str):
        super().__init__("world_size", message)


def run_devices(world_size: int, device_count: int, visible: str | None) -> list[str]:
    """The device ids a single-node run of `world_size` ranks uses: DeepSpeed's launcher gives
    rank i the i-th visible device (`CUDA_VISIBLE_DEVICES` or its accelerator's equivalent)."""
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible else [str(i) for i in range(device_count)]
    return ids[:world_size]


def take(accelerator: str, device_ids: list[str], holder: str,
         lease_dir: str | os.PathLike | None = None) -> list[int]:
    """Lock every device or none; returns the descriptors that hold the locks.

    Raises DevicesBusy naming the run that holds a device."""
    lease_dir = Path(lease_dir or DEFAULT_LEASE_DIR)
    if not lease_dir.exists():
        lease_dir.mkdir(parents=True, exist_ok=True)
        try:
            os.chmod(lease_dir, 0o1777)
        except PermissionError:
            pass  # another user created it at the same moment
    fds: list[int] = []
    try:
        for device in device_ids:
            path = lease_dir / f"{accelerator}{device}.lock"
            # O_NOFOLLOW: the directory is shared; a planted symlink must not redirect our writes.
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
            fds.append(fd)
            try:
                os.fchmod(fd, 0o666)  # past the umask: the next run may be another user's
            except PermissionError:
                pass
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                owner = path.read_text(errors="replace").strip() or "another run"
                raise DevicesBusy(f"{accelerator} device {device} is in use by {owner}; stop that run "
                                  f"(Run.stop(), the panel's Stop) or wait for it to end") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, holder.encode(), 0)
    except BaseException:
        release(fds)
        raise
    return fds


def take_port(lease_dir: str | os.PathLike | None = None) -> tuple[int, list[int]]:
    """A free rendezvous port and the lease that keeps other labkit runs off it until this run ends."""
    from labkit.launcher import free_port

    for _ in range(50):
        port = free_port()
        try:
            return port, take("port", [str(port)], f"a run starting in process {os.getpid()}", lease_dir)
        except DevicesBusy:
            continue  # another run picked it a moment ago and has not bound it yet
    raise RuntimeError("no free rendezvous port: 50 candidates were all leased")


def describe(fds: list[int], holder: str) -> None:
    """Name the holder (the run directory, once it exists) for whoever is refused next."""
    for fd in fds:
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode(), 0)


def release(fds: list[int]) -> None:
    """Close this process's descriptors; a lock lives on in any process that inherited them."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass

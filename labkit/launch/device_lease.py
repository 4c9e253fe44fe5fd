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
import stat
import tempfile
from pathlib import Path

from labkit.core.config import ConfigError

# Shared by every user of the machine (sticky, world-writable, like /tmp): GPUs are too.
DEFAULT_LEASE_DIR = Path(tempfile.gettempdir()) / "labkit-device-leases"


class DevicesBusy(ConfigError):
    """The GPUs a run needs are held by another live run."""

    def __init__(self, message: str):
        super().__init__("world_size", message)


class LeaseFileForbidden(DevicesBusy):
    """A device's lease file cannot be opened by this user (another user's stale file): the device
    cannot be leased, whether or not a run holds it. `reason` says whose file it is."""

    def __init__(self, path: Path, reason: str):
        self.path = path
        self.reason = reason
        super().__init__(f"cannot lease through {path}: {reason}")


# CI has no GPUs: with this set to N, CPU runs lease N emulated device slots through the same
# code as GPU runs (device choice, the lease's hand-off, the sweep waiting for it).
EMULATED_DEVICES_ENV = "LABKIT_EMULATED_DEVICES"


def visible_ids(device_count: int, visible: str | None, env_name: str = "CUDA_VISIBLE_DEVICES") -> list[str]:
    """The device ids a single-node run may use: the visible devices (`CUDA_VISIBLE_DEVICES` or its
    accelerator's equivalent), else all of them. Refuses UUIDs and MIG ids, which DeepSpeed's launcher
    would crash on (`int("GPU-...")` in its runner) after labkit wrote the run."""
    if visible is None:
        return [str(i) for i in range(device_count)]
    ids = [d.strip() for d in visible.split(",") if d.strip()]
    for device in ids:
        if not device.isdigit():
            raise ConfigError(env_name, f"{env_name}={visible!r}: {device!r} is not a device index. DeepSpeed's "
                                        f"launcher reads {env_name} as integers, so UUIDs and MIG ids crash it; "
                                        f"give indices instead (`nvidia-smi -L` lists each GPU's index and UUID)")
    return ids


def emulated_ids(env: dict[str, str]) -> list[str]:
    """The emulated slots a CPU run leases (none unless `LABKIT_EMULATED_DEVICES` is set)."""
    value = env.get(EMULATED_DEVICES_ENV, "").strip()
    if not value:
        return []
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(EMULATED_DEVICES_ENV, f"must be a positive integer, got {value!r}")
    return [str(i) for i in range(int(value))]


def take_free(accelerator: str, candidates: list[str], count: int, holder: str,
              lease_dir: str | os.PathLike | None = None) -> tuple[list[str], list[int]]:
    """Lease `count` of the `candidates` that no live run holds, in their order; returns (ids, descriptors).

    On an 8-GPU node a second 1-GPU run gets GPU 1 while the first holds GPU 0. Raises DevicesBusy
    naming the holders when fewer than `count` are free, ConfigError when fewer exist at all."""
    if len(candidates) < count:
        raise ConfigError("world_size", f"{count} ranks need {count} {accelerator} devices but only "
                                        f"{len(candidates)} are visible ({','.join(candidates) or 'none'})")
    lease_dir = _lease_dir(lease_dir)
    ids: list[str] = []
    fds: list[int] = []
    holders: list[str] = []
    try:
        for device in candidates:
            if len(ids) == count:
                break
            try:
                fd = _lock(lease_dir, accelerator, device)
            except LeaseFileForbidden as exc:
                # Another user's stale lease file blocks this device only: the next candidate may be free.
                holders.append(f"{accelerator} device {device} (not leasable by you: {exc.path}: {exc.reason})")
                continue
            if fd is None:
                holders.append(f"{accelerator} device {device} ({_holder(lease_dir, accelerator, device)})")
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, holder.encode(), 0)
            ids.append(device)
            fds.append(fd)
        if len(ids) < count:
            raise DevicesBusy(f"{count} {accelerator} devices needed, {len(ids)} free of {len(candidates)}; in use: "
                              f"{'; '.join(holders)}. Stop a run (Run.stop(), the panel's Stop) or wait for it to end")
    except BaseException:
        release(fds)
        raise
    return ids, fds


def take(accelerator: str, device_ids: list[str], holder: str,
         lease_dir: str | os.PathLike | None = None) -> list[int]:
    """Lock every device or none; returns the descriptors that hold the locks.

    Raises DevicesBusy naming the run that holds a device."""
    lease_dir = _lease_dir(lease_dir)
    fds: list[int] = []
    try:
        for device in device_ids:
            fd = _lock(lease_dir, accelerator, device)
            if fd is None:
                raise DevicesBusy(f"{accelerator} device {device} is in use by "
                                  f"{_holder(lease_dir, accelerator, device)}; stop that run "
                                  f"(Run.stop(), the panel's Stop) or wait for it to end")
            fds.append(fd)
            os.ftruncate(fd, 0)
            os.pwrite(fd, holder.encode(), 0)
    except BaseException:
        release(fds)
        raise
    return fds


def _lease_dir(lease_dir: str | os.PathLike | None) -> Path:
    """The shared lease directory, created sticky and world-writable like /tmp, and checked: in a
    directory another user owns, or anyone may rename files in, leases mean nothing."""
    lease_dir = Path(lease_dir or DEFAULT_LEASE_DIR)
    if not lease_dir.exists():
        lease_dir.mkdir(parents=True, exist_ok=True)
        try:
            os.chmod(lease_dir, 0o1777)
        except PermissionError:
            pass  # another user created it at the same moment
    info = os.lstat(lease_dir)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid not in (0, os.getuid()):
        raise DevicesBusy(f"lease directory {lease_dir} is not a directory owned by root or by you "
                          f"(owner uid {info.st_uid}); remove it or ask its owner to")
    if info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
        raise DevicesBusy(f"lease directory {lease_dir} is world-writable without the sticky bit: anyone could "
                          f"delete a live run's lease; run `chmod +t {lease_dir}`")
    return lease_dir


def _lock(lease_dir: Path, accelerator: str, device: str) -> int | None:
    """A descriptor holding the device's flock, or None when a live run holds it."""
    path = lease_dir / f"{accelerator}{device}.lock"
    try:
        # O_CREAT only when absent: under fs.protected_regular, O_CREAT on another user's file in a
        # sticky directory fails even when the file itself is writable. O_NOFOLLOW: the directory is
        # shared; a planted symlink must not redirect our writes.
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
            except FileExistsError:  # another run created it a moment ago
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
            try:
                os.fchmod(fd, 0o666)  # past the umask: the next run may be another user's
            except PermissionError:
                pass
    except PermissionError as exc:
        raise LeaseFileForbidden(path, f"{exc.strerror}: the lease file belongs to uid {_owner(path)}, a stale "
                                       f"file of another user or not writable for you; ask its owner (or root) "
                                       f"to remove it") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
        return None
    return fd


def _holder(lease_dir: Path, accelerator: str, device: str) -> str:
    try:
        return (lease_dir / f"{accelerator}{device}.lock").read_text(errors="replace").strip() or "another run"
    except OSError:
        return "another run"


def _owner(path: Path) -> str:
    try:
        return str(os.lstat(path).st_uid)
    except OSError:
        return "?"


def take_port(lease_dir: str | os.PathLike | None = None) -> tuple[int, list[int]]:
    """A free rendezvous port and the lease that keeps other labkit runs off it until this run ends."""
    from labkit.launch.launcher import free_port

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

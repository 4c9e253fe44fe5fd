"""Per-rank telemetry: one JSON record per line in `rank<N>.jsonl`.

Each record is written by `os.write` on an O_APPEND descriptor (again for the rest after a short write), so it reaches
the kernel before the step ends: a killed rank loses at most the step in progress. The
fsync that makes it durable across a machine crash runs on a background thread, so
telemetry never blocks training. Keys carry their units (`step_time_s`, `rss_bytes`).
"""

from __future__ import annotations

import json
import os
import resource
import socket
import threading
import time
from typing import Any

import psutil

from labkit.core.records import rank_file

BEAT_S = 1.0  # with per-step records off, a heartbeat this often keeps the hang watchdog informed
FSYNC_EVERY_S = 1.0  # durable across a machine crash within a second (a killed rank loses nothing written)


class RankTelemetry:
    def __init__(self, run_dir: str | os.PathLike, rank: int, *, per_step: bool = True):
        self.rank = rank
        self.per_step = per_step
        self.start_time = time.time()
        self._fd = os.open(rank_file(run_dir, rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._process = psutil.Process()
        self._last_beat = 0.0
        from deepspeed.accelerator import get_accelerator

        self._accelerator = get_accelerator()
        self._dirty = threading.Event()
        self._closing = threading.Event()
        self._write_lock = threading.Lock()
        self._closed = False
        self.fsyncs = 0
        self._syncer = threading.Thread(target=self._sync_loop, name="telemetry-fsync", daemon=True)
        self._syncer.start()

    def _sync_loop(self) -> None:
        # At most one fsync per FSYNC_EVERY_S, not one per record: each fsync is a journal commit
        # and a thread wake-up, paid on the cores the ranks train on.
        while not self._closed:
            if self._dirty.wait(timeout=FSYNC_EVERY_S):
                self._dirty.clear()
                try:
                    os.fsync(self._fd)
                except OSError:
                    return
                self.fsyncs += 1
                self._closing.wait(FSYNC_EVERY_S)

    def thread_cpu_s(self) -> float:
        """CPU seconds the fsync thread has used (it runs outside what the loop times)."""
        ident = self._syncer.ident
        if ident is None:  # never started (it is, in __init__): it has used no CPU
            return 0.0
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(ident))
        except (OSError, AttributeError):
            return 0.0

    def _write(self, record: dict[str, Any]) -> None:
        record = {"rank": self.rank, "time_s": round(time.time() - self.start_time, 6), **record}
        data = memoryview((json.dumps(record, separators=(",", ":")) + "\n").encode())
        with self._write_lock:
            # os.write may write less than asked (a signal, a full pipe or disk): the rest follows before
            # any other record, or a partial line would be glued onto the next one.
            while data:
                data = data[os.write(self._fd, data):]
        self._dirty.set()

    def memory(self) -> dict[str, int]:
        """Host memory of this rank; device memory through DeepSpeed's accelerator API."""
        out = {
            "rss_bytes": self._process.memory_info().rss,
            # ru_maxrss is in KiB on Linux.
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
        accel = self._accelerator
        if accel._name != "cpu":
            out["device_allocated_bytes"] = int(accel.memory_allocated())
            # Since the last begin_step(): the step's own peak (the run's peak is the max over steps).
            out["device_peak_bytes"] = int(accel.max_memory_allocated())
            out["device_reserved_bytes"] = int(accel.memory_reserved())
        return out

    def event(self, name: str, **fields: Any) -> None:
        """A lifecycle record (start, ready, done, error): always written."""
        self._write({"event": name, "wall_time": time.time(), **fields})

    def begin_step(self) -> None:
        """Start the device's peak-memory counter afresh, so each step record carries its own peak
        (not deepspeed.initialize's transients, nor an earlier step's)."""
        if self._accelerator._name != "cpu":
            self._accelerator.reset_peak_memory_stats()

    def step(self, **fields: Any) -> None:
        """One record per optimizer step. With per-step telemetry off (the benchmark's baseline),
        only a small heartbeat about once a second: the supervisor must still tell a hang."""
        if self.per_step:
            self._write({"event": "step", **fields})
        elif time.monotonic() - self._last_beat >= BEAT_S:
            self._last_beat = time.monotonic()
            self._write({"event": "beat", "step": fields["step"]})

    def start(self, **fields: Any) -> None:
        self.event("start", pid=os.getpid(), host=socket.gethostname(), **fields)

    def close(self) -> None:
        self._closed = True
        self._closing.set()
        self._dirty.set()
        self._syncer.join(timeout=2)
        try:
            os.fsync(self._fd)
        finally:
            os.close(self._fd)

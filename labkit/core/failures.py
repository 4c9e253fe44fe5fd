"""Naming the cause of a failed run: out of memory, which rank crashed, knock-on errors."""

from __future__ import annotations

import re

# Messages of allocators that ran out of memory: the CUDA/accelerator caching allocator,
# PyTorch's CPU allocator, and the emulated device capacity of labkit on CPU.
OOM_PATTERNS = (
    "out of memory",
    "can't allocate memory",
    "cannot allocate memory",
    "defaultcpuallocator",
    "emulated device capacity",
    # NCCL's own allocations on the device (its buffers, a communicator's setup): "Failed to CUDA calloc N bytes"
    # in NCCL's last error, cudaErrorMemoryAllocation by name.
    "failed to cuda calloc",
    "failed to cuda malloc",
    "cudaerrormemoryallocation",
)

# Errors a healthy rank raises because a peer died: not the root cause.
KNOCK_ON_PATTERNS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "connection refused",
    "socket closed",
    "communicator was aborted",
    "remote process exited",
    "remote peer",
    # DeepSpeed's launcher SIGTERMs the other ranks once one exits with an error: a peer's cause.
    "killed by sigterm",
)


def is_oom(error_type: str, message: str) -> bool:
    if error_type in ("OutOfMemoryError", "MemoryError"):
        return True
    return any(pattern in message.lower() for pattern in OOM_PATTERNS)


def oom_line(log_text: str, tail_lines: int = 40) -> str | None:
    """The line of a rank's log that says the device ran out of memory, where that is why the rank ended: after
    its last traceback, or in its last `tail_lines` lines when it has none (NCCL's watchdog aborts the process
    from C++: "terminate called after throwing ... what(): ... CUDA error: out of memory", no Python traceback).
    A multi-line exception puts it below the line `last_exception_line` finds: torch's NCCL errors read
    "DistBackendError: NCCL error in: ..., unhandled cuda error ... / Last error: / Cuda failure 'out of memory'"."""
    start = log_text.rfind("Traceback (most recent call last):")
    lines = log_text[start:].splitlines() if start >= 0 else log_text.splitlines()[-tail_lines:]
    found = [line.strip() for line in lines if is_oom("", line)]
    return found[-1] if found else None


def classify_exit(log_text: str, returncode: int) -> tuple[str, str]:
    """(status, cause) of a rank that exited non-zero without an error record (not SIGKILL, which the
    supervisor classifies from the kernel's OOM counter): "oom" when its log says the device ran out of memory
    (an out-of-memory inside NCCL included), else "failed"; the cause is the exception line, with the OOM line."""
    logged = last_exception_line(log_text)
    oom = oom_line(log_text)
    if logged is None:
        return ("oom", oom) if oom else ("failed", describe_exit(returncode))
    if oom and oom not in logged:
        return "oom", f"{logged} ({oom})"
    return ("oom" if oom or is_oom(logged.split(":")[0], logged) else "failed"), logged


def is_knock_on(message: str) -> bool:
    return any(pattern in message.lower() for pattern in KNOCK_ON_PATTERNS)


def describe_exit(returncode: int) -> str:
    """A rank's exit code in words; -9 without a traceback is typical of the OOM killer."""
    if returncode < 0:
        import signal

        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        hint = " (no traceback: the kernel's OOM killer sends SIGKILL)" if returncode == -9 else ""
        return f"killed by {name}{hint}"
    return f"exited with code {returncode}"


# torch prefixes an uncaught exception's lines with "[rankN]: " once a process group exists (scripts).
_TRACEBACK_LAST = re.compile(r"^(?:\[rank\d+\]: )?(\w[\w.]*(Error|Exception|Interrupt|Exit)\b.*)$", re.MULTILINE)


def last_exception_line(log_text: str) -> str | None:
    """The 'SomeError: message' line of the last traceback in a rank's log, if any.

    Only what follows the last "Traceback" header counts: an error line logged earlier (a
    warning, a caught and printed exception) is not why the rank ended."""
    start = log_text.rfind("Traceback (most recent call last):")
    if start < 0:
        return None
    matches = _TRACEBACK_LAST.findall(log_text[start:])
    return matches[-1][0] if matches else None

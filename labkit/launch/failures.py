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

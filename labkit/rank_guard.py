"""Runs one rank's worker as a child and records how it ended in `rank<N>.exit`.

DeepSpeed's launch.py knows each rank's exit code but only logs it next to the wrong
command line. A rank killed by SIGKILL (the OOM killer) leaves no traceback, so this
small guard is the only reliable witness of *which* rank died and how.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from labkit.store import write_json_atomic


def main() -> int:
    argv = sys.argv[1:]
    run_dir = Path(argv[argv.index("--run-dir") + 1])
    rank = int(os.environ.get("RANK", "0"))
    child: subprocess.Popen | None = None
    pending: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        if child is None:
            pending.append(signum)  # arrived before the worker existed: passed on once it does
        else:
            child.send_signal(signum)

    # Installed before the worker starts: a stop that lands in between must still reach it.
    for stop_signal in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop_signal, forward)
    child = subprocess.Popen([sys.executable, "-u", "-m", "labkit.worker", *argv])
    for signum in pending:
        child.send_signal(signum)
    returncode = child.wait()
    write_json_atomic(run_dir / f"rank{rank}.exit", {"rank": rank, "pid": child.pid, "returncode": returncode})
    # Exit like the child did, so DeepSpeed's launcher reacts as it would without us.
    if returncode < 0:
        if returncode != -signal.SIGKILL:  # SIGKILL's handler cannot be set (and is the default)
            signal.signal(-returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -returncode)
    return returncode


if __name__ == "__main__":
    sys.exit(main())

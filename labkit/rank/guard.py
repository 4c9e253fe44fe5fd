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

from labkit.core.files import write_json_atomic


def main(argv: list[str] | None = None) -> int:
    """Start the worker (or the learner's script) as a child with `argv` (`sys.argv[1:]` when None), wait, record
    its exit in `rank<N>.exit`, exit like it did."""
    argv = sys.argv[1:] if argv is None else list(argv)
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
    script = None
    if "--script" in argv:  # script mode (labkit.rank.script): the learner's script instead of labkit's worker
        at = argv.index("--script")
        script, argv = argv[at + 1], argv[:at] + argv[at + 2:]
        at = argv.index("--run-dir")
        argv = argv[:at] + argv[at + 2:]  # the script gets DeepSpeed's --local_rank and its own args only
        os.environ["LABKIT_RUN_DIR"] = str(run_dir)
        # A fatal signal (SIGABRT, SIGSEGV) prints the Python stack in the rank's log, or none once the
        # interpreter has finalized: where a script's abort came from (labkit.rank.script).
        os.environ.setdefault("PYTHONFAULTHANDLER", "1")
        child = subprocess.Popen([sys.executable, "-u", script, *argv])
    else:
        child = subprocess.Popen([sys.executable, "-u", "-m", "labkit.rank.worker", *argv])
    for signum in pending:
        child.send_signal(signum)
    teardown_abort = False
    if script:
        returncode, teardown_abort = _watch_script(child, run_dir, rank)
    else:
        returncode = child.wait()
    exit_info = {"rank": rank, "pid": child.pid, "returncode": returncode}
    write_json_atomic(run_dir / f"rank{rank}.exit", {**exit_info, "teardown_abort": True} if teardown_abort
                      else exit_info)
    if teardown_abort:
        # Judged finished (labkit.rank.script): exiting 0 keeps DeepSpeed's launcher from ending the
        # other ranks, which may still be in their own teardown.
        return 0
    # Exit like the child did, so DeepSpeed's launcher reacts as it would without us.
    if returncode < 0:
        if returncode != -signal.SIGKILL:  # SIGKILL's handler cannot be set (and is the default)
            signal.signal(-returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -returncode)
    return returncode


def _watch_script(child: subprocess.Popen, run_dir: Path, rank: int) -> tuple[int, bool]:
    """Records what a script does not: its start, its memory (RSS of its process tree) as
    liveness every SAMPLE_S, and a done record when it finished (`labkit.rank.script.judge_exit`).
    Returns its return code and whether it was a teardown abort judged finished."""
    import psutil

    from labkit.rank.script import SAMPLE_S, guard_events, judge_exit

    start, sample, done = guard_events(run_dir, rank)
    start(child.pid)
    process = psutil.Process(child.pid)
    while True:
        try:
            return_code = child.wait(timeout=SAMPLE_S)
            break
        except subprocess.TimeoutExpired:
            pass
        try:
            tree = [process, *process.children(recursive=True)]
            rss = sum(p.memory_info().rss for p in tree)
        except psutil.Error:
            continue  # exiting: the next wait returns
        if rss:  # 0: the script exited since the wait (a zombie has no memory); the next wait returns
            sample(rss)
    verdict = judge_exit(run_dir, rank, child.pid, return_code)
    done(verdict, return_code)
    return return_code, verdict == "teardown_abort"


if __name__ == "__main__":
    sys.exit(main())

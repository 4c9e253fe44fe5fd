"""Run every benchmark in this folder, one after another: `make bench`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

here = Path(__file__).resolve().parent
failed = []
for script in sorted(here.glob("bench_*.py")):
    print(f"\n=== {script.name}", flush=True)
    if subprocess.run([sys.executable, str(script)], cwd=here.parent).returncode != 0:
        failed.append(script.name)
sys.exit(f"failed: {failed}" if failed else 0)

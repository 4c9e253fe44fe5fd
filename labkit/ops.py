"""Build DeepSpeed's JIT ops once, up front: `python -m labkit.ops`.

DeepSpeed compiles cpu_adam, fused_adam and (on CPU) the shared-memory comm op the first
time a run needs them, 30-90 s each. Built here into TORCH_EXTENSIONS_DIR, every later
run (and test) loads them from that cache instead of stalling its first step.
"""

from __future__ import annotations

import os
import sys
import time

from labkit.launcher import DEFAULT_EXTENSIONS_DIR

# The builders labkit's runs use, by DeepSpeed's class names.
BUILDERS = ("CPUAdamBuilder", "FusedAdamBuilder", "ShareMemCommBuilder")


def build_all() -> list[str]:
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(DEFAULT_EXTENSIONS_DIR))
    # The venv's ninja, as the runs use (launcher.build_command): another one triggers rebuilds.
    bin_dir = os.path.dirname(sys.executable)
    os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    built = []
    for name in BUILDERS:
        builder = accelerator.create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            print(f"{name}: not used by the {accelerator._name} accelerator, skipped")
            continue
        start = time.perf_counter()
        builder.load(verbose=False)
        print(f"{name}: ready in {time.perf_counter() - start:.1f} s")
        built.append(name)
    return built


if __name__ == "__main__":
    build_all()
    sys.exit(0)

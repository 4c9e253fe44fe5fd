"""Which size the notebooks and the sweep run at: `ci` (small, CPU, minutes) or `full` (GPU-sized).

LABKIT_PROFILE picks it; without it, a machine with GPUs runs `full` and a CPU-only one `ci`.
Each notebook's parameters cell reads it, so papermill (`-p profile full`) works too.
"""

from __future__ import annotations

import os

PROFILES = ("ci", "full")


def current_profile() -> str:
    chosen = os.environ.get("LABKIT_PROFILE")
    if chosen:
        if chosen not in PROFILES:
            raise ValueError(f"LABKIT_PROFILE must be one of {PROFILES}, got {chosen!r}")
        return chosen
    from labkit.runtime.devices import detect_devices

    return "ci" if detect_devices().is_cpu else "full"

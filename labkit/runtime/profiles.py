"""Which size the notebooks and `labkit answer` run at: `ci`, `workshop` or `full`.

- `ci`: small models on CPU ranks (or a GPU under 12 GiB), minutes; device capacity emulated where needed.
- `workshop`: 12-70 GiB GPUs (T4, L4, A10G, A100 40GB; sized for 1-4 of 16-24 GB) and a single 80 GB GPU;
  fp16 where bf16 is missing (T4).
- `full`: a node of 2+ 80 GB GPUs (A100/H100 80GB); its multi-rank notebooks want several.

LABKIT_PROFILE picks it, for the notebooks and the CLI alike (`labkit answer --profile` defaults to it);
without it `default_profile` chooses from the GPUs' memory and count. Each notebook's parameters cell reads it,
so papermill (`-p profile workshop`) works too; the sizes are in labkit.study.notebook_sizes.
"""

from __future__ import annotations

import os

from labkit.runtime.devices import Devices

PROFILE_NAMES = ("ci", "workshop", "full")
WORKSHOP_MIN_BYTES = 12 * 2**30  # a GPU smaller than this runs `ci` (with its emulated capacities)
FULL_MIN_BYTES = 70 * 2**30      # 80 GB parts report 79-80 GiB; A100 40GB and 48 GB parts run `workshop`
FULL_MIN_GPUS = 2                # `full` is sized for a node: one 80 GB GPU runs `workshop` (minutes, not an hour)


def default_profile(devices: Devices) -> str:
    """The profile for these devices: CPU -> ci; GPUs by their memory and count (module doc). Pure."""
    if devices.is_cpu or devices.total_memory_bytes < WORKSHOP_MIN_BYTES:
        return "ci"
    if devices.total_memory_bytes >= FULL_MIN_BYTES and devices.device_count >= FULL_MIN_GPUS:
        return "full"
    return "workshop"


def check_profile(chosen: str) -> str:
    """`chosen` (LABKIT_PROFILE's value) if it names a profile, else a ConfigError naming the variable."""
    if chosen not in PROFILE_NAMES:
        from labkit.core.config import ConfigError

        smoke = ("; smoke is `labkit answer`'s alone, the notebooks have no smoke size: unset LABKIT_PROFILE and "
                 "run `labkit answer --profile smoke`" if chosen == "smoke" else "")
        raise ConfigError("LABKIT_PROFILE", f"must be one of {', '.join(PROFILE_NAMES)}, got {chosen!r}{smoke}")
    return chosen


def current_profile() -> str:
    """LABKIT_PROFILE, else `default_profile` of this machine's devices. A value that is no profile: ConfigError (a
    ValueError) naming the variable and the profiles, which `labkit answer` turns into exit 2."""
    chosen = os.environ.get("LABKIT_PROFILE")
    if chosen:
        return check_profile(chosen)
    from labkit.runtime.devices import detect_devices

    return default_profile(detect_devices())

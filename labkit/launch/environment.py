"""The environment variables a run reads, each checked by its own reader before anything launches or is exported.

A bad value is then a ConfigError naming the variable here, not a rank failing after its launch (LABKIT_FAULT,
TORCH_EXTENSIONS_DIR at a file) nor an exported job failing on the cluster after it was submitted."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from labkit.core.config import ConfigError


def check_environment(env: Mapping[str, str], *, paths: bool = True) -> None:
    """Raise ConfigError naming the first variable of `env` whose value its reader refuses. `paths`: also the
    directories (TORCH_EXTENSIONS_DIR), which only this machine's runs use; an exported job's are the cluster's."""
    from labkit.launch.admission import memory_limit
    from labkit.launch.device_lease import emulated_ids
    from labkit.launch.run import warm_setting
    from labkit.launch.store import check_output_dir
    from labkit.rank.faults import FaultSpecError, parse_faults
    from labkit.runtime.profiles import check_profile

    env = dict(env)
    memory_limit(env)
    emulated_ids(env)
    warm_setting(env)
    if env.get("LABKIT_PROFILE"):
        check_profile(env["LABKIT_PROFILE"])
    try:
        parse_faults(env.get("LABKIT_FAULT", ""))
    except FaultSpecError as exc:
        raise ConfigError("LABKIT_FAULT", str(exc).removeprefix("LABKIT_FAULT: ")) from None
    extensions = env.get("TORCH_EXTENSIONS_DIR")
    if paths and extensions and not Path(extensions).is_dir():  # torch makes it at the first build
        check_output_dir(extensions, "TORCH_EXTENSIONS_DIR")

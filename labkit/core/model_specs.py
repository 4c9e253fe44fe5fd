"""The model/data/loss specs a `RunConfig` names: a built-in name (`MODELS`) or an import string
"package.module:callable", checked for syntax here (without importing anything); `labkit.models.builders`
resolves and calls them in the ranks."""

from __future__ import annotations

import re

# Built-in models: name -> (model builder, dataset builder), both import strings.
MODELS: dict[str, tuple[str, str]] = {
    "mlp": ("labkit.models.builders:build_mlp", "labkit.models.builders:build_mlp_dataset"),
    "gpt": ("labkit.models.gpt:build_model", "labkit.models.gpt:build_dataset"),
}
IMPORT_STRING = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*")


def check_spec_syntax(field_name: str, spec: str | None, *, builtin_ok: bool) -> str | None:
    """Why `spec` is not a valid value for `field_name`, or None."""
    if spec is None:
        return None
    if not isinstance(spec, str):
        return f"must be a string, got {spec!r}"
    if builtin_ok and spec in MODELS:
        return None
    if not IMPORT_STRING.fullmatch(spec):
        names = f"one of {tuple(MODELS)} or " if builtin_ok else ""
        return f"must be {names}an import string 'package.module:callable', got {spec!r}"
    return None

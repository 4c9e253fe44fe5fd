"""`make install`'s venv: one that keeps the node's own torch (a CUDA build) when the node's Python has one.

    python -m labkit.runtime.node_venv .venv      # with the node's Python, from the repository root

`python -m venv --system-site-packages` exposes the *base* interpreter's site-packages only. A node Python that
is itself a venv (NGC-style images, conda and venv-hosted clusters, the lab's GPU machine: /opt/torch/.venv) holds
its torch in the venv's site-packages, which the new venv then does not see: pip installed torch again from
the index (or, offline, failed). Such a parent venv is detected (sys.prefix != sys.base_prefix) and the new venv
gets a .pth file that adds the parent's site-packages behind its own, with `site.addsitedir`, so the parent's own
.pth files (editable installs, further parents) work too. pip in the new venv sees those packages as installed.
A plain system Python with torch gets `--system-site-packages`, as before; one without torch a plain venv.
Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import sys
import sysconfig
import venv
from pathlib import Path

PTH_NAME = "_labkit_node_packages.pth"


def has_torch() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def parent_site_dirs() -> list[str]:
    """This interpreter's own site-packages (purelib, platlib), when it runs inside a venv; else []."""
    if sys.prefix == sys.base_prefix:
        return []
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


def parent_includes_system_site() -> bool:
    config = Path(sys.prefix) / "pyvenv.cfg"
    if not config.is_file():
        return False
    for line in config.read_text().splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "include-system-site-packages":
            return value.strip().lower() == "true"
    return False


def create(target: Path, *, with_pip: bool = True) -> str:
    """Create the venv at `target`; returns what it keeps of this interpreter's packages, in words."""
    keep_node = has_torch()
    parents = parent_site_dirs() if keep_node else []
    system = keep_node and (not parents or parent_includes_system_site())
    venv.EnvBuilder(system_site_packages=system, with_pip=with_pip, symlinks=True).create(target)
    if parents:
        site_packages = next((target / "lib").glob("python*/site-packages"))
        lines = [f"import site; site.addsitedir({path!r})" for path in parents]
        (site_packages / PTH_NAME).write_text("\n".join(lines) + "\n")
        return f"keeps the packages of the venv {sys.prefix} (torch among them) through {PTH_NAME}"
    if system:
        return "keeps the system site-packages (torch among them)"
    return "a plain venv: torch comes from the index or the wheelhouse"


def main() -> int:
    if len(sys.argv) != 2:
        print(f"usage: {sys.executable} -m labkit.runtime.node_venv VENV_DIR", file=sys.stderr)
        return 2
    target = Path(sys.argv[1])
    print(f"{target}: {create(target)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

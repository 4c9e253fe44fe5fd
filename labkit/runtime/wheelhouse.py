"""`make wheelhouse`: every wheel the lab needs on an air-gapped node, for its Python and platform, in one folder.

    python -m labkit.runtime.wheelhouse --out wheelhouse --python 3.12 --extras notebooks \
        --node-packages node-freeze.txt

1. labkit itself, as a wheel;
2. DeepSpeed, built here as a wheel from its sdist (PyPI has no DeepSpeed wheels; with DS_BUILD_OPS=0 it is a
   pure-Python wheel whose ops the node JIT-builds, as it would from the sdist);
3. every dependency of those (with the chosen extras), downloaded by pip for the target Python and manylinux
   platform (`--only-binary=:all:`), pinned by constraints.txt;
4. then pruned: torch is left to the node (its CUDA build) unless `--with-torch`, and so is every package the
   node already has (`--node-packages`: the node's `pip list --format=freeze`, or one name per line) at a
   version the requirements accept; what only those packages needed goes too. A package named without a
   version is trusted, except a pure-Python wheel some requirement bounds (e.g. typing-extensions>=4.14): kept,
   small, in case the node's is older. `pip install --no-index` on the node uses what it has first.

On the node: `make install WHEELHOUSE=wheelhouse EXTRAS=...` (pip's `--no-index --find-links`), in a venv that
keeps the node's own torch (labkit.runtime.node_venv). The folder's `manifest.txt` lists what is in it and what
the node must provide.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

REPO = Path(__file__).resolve().parents[2]
DEEPSPEED = "deepspeed==0.19.8"
# manylinux tags pip may take for an x86-64 Linux node (glibc 2.28+: RHEL 8, Ubuntu 20.04 and later).
X86_64_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                    "manylinux_2_12_x86_64", "manylinux2010_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64")
BUILD_REQUIREMENTS = ("setuptools>=68",)  # labkit's build backend: `pip install -e .` offline needs it too


@dataclass
class Wheel:
    path: Path
    name: str                      # canonical project name
    version: str
    requires: list[Requirement] = field(default_factory=list)

    @property
    def pure(self) -> bool:
        return self.path.name.endswith("-none-any.whl")


def read_wheel(path: Path) -> Wheel:
    """A wheel's name, version and Requires-Dist, from its METADATA."""
    with zipfile.ZipFile(path) as archive:
        metadata = next(n for n in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        text = archive.read(metadata).decode("utf-8", errors="replace")
    headers = text.split("\n\n", 1)[0].splitlines()
    value = {k: v for k, _, v in (line.partition(": ") for line in headers) if k in ("Name", "Version")}
    requires = [Requirement(line.partition(": ")[2]) for line in headers if line.startswith("Requires-Dist: ")]
    return Wheel(path, canonicalize_name(value["Name"]), value["Version"], requires)


def target_environment(python: str) -> dict[str, str]:
    """The marker environment of a CPython `python` ("3.12") on x86-64 Linux."""
    env: dict[str, str] = {k: str(v) for k, v in default_environment().items()}
    env.update(python_version=python, python_full_version=f"{python}.0", sys_platform="linux",
               platform_system="Linux", platform_machine="x86_64", os_name="posix",
               implementation_name="cpython", platform_python_implementation="CPython")
    return env


def applies(requirement: Requirement, env: dict[str, str], extras: set[str]) -> bool:
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({**env, "extra": extra}) for extra in (extras or {""}))


def read_node_packages(path: Path | None) -> dict[str, str | None]:
    """{canonical name: version or None} from `pip list --format=freeze` output (or bare names, one a line)."""
    if path is None:
        return {}
    found: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        name, _, version = line.partition("==")
        found[canonicalize_name(name.split(" @ ")[0].strip())] = version.strip() or None
    return found


def check_inputs(out: Path, python: str, node_file: Path | None) -> dict[str, str | None]:
    """The node's packages (`read_node_packages`), after checking every input `build` takes from the user, before
    it deletes, builds or downloads anything: `python` is major.minor of a CPython labkit supports, `node_file`
    reads, `out` is a folder or can be one. ValueError naming the flag and the make variable that sets it."""
    if not re.fullmatch(r"\d\.\d{1,2}", python):
        raise ValueError(f"--python (make's WHEEL_PYTHON) {python!r}: must be the node's CPython as major.minor, "
                         "e.g. 3.12")
    pyproject = REPO / "pyproject.toml"
    if pyproject.is_file():
        import tomllib

        from packaging.specifiers import SpecifierSet

        supported = tomllib.loads(pyproject.read_text())["project"].get("requires-python")
        if supported and Version(python) not in SpecifierSet(supported):
            raise ValueError(f"--python (make's WHEEL_PYTHON) {python!r}: labkit needs Python {supported}")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out (make's WHEELHOUSE_DIR) {str(out)!r}: not a folder")
    if node_file is None:
        return {}
    where = f"--node-packages (make's NODE_PACKAGES) {str(node_file)!r}"
    if not node_file.is_file():
        raise ValueError(f"{where}: {'a folder, not a file' if node_file.is_dir() else 'no such file'} (the node's "
                         "`pip list --format=freeze`, or names one a line)")
    try:
        return read_node_packages(node_file)
    except OSError as exc:
        raise ValueError(f"{where}: cannot be read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{where}: not a text file (the node's `pip list --format=freeze`, or names one "
                         "a line)") from None


def node_satisfies(name: str, node: dict[str, str | None], specifiers: list[Requirement], wheel: Wheel | None) -> bool:
    """Whether the node's own copy of `name` can stand in for the wheel (module doc: the pruning rule)."""
    if name not in node:
        return False
    version = node[name]
    bounded = any(str(r.specifier) for r in specifiers)
    if version is None:
        return not (bounded and wheel is not None and wheel.pure)
    try:
        parsed = Version(version)
    except InvalidVersion:
        return not bounded
    return all(r.specifier.contains(parsed, prereleases=True) for r in specifiers)


def keep_closure(roots: list[Requirement], wheels: dict[str, Wheel], node: dict[str, str | None], env: dict[str, str],
                 *, with_torch: bool) -> tuple[set[str], dict[str, list[Requirement]]]:
    """(wheels to keep, {package the node must provide: the requirements on it}): the requirements walked from
    `roots` through the wheels' Requires-Dist, stopping at what the node provides. Pure."""
    by_name: dict[str, list[Requirement]] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    pending = [(r, frozenset(r.extras)) for r in roots]
    while pending:
        requirement, extras = pending.pop()
        key = str(canonicalize_name(requirement.name))
        by_name.setdefault(key, []).append(requirement)
        if (key, extras) not in seen:
            seen.add((key, extras))
            pending += [(r, frozenset(r.extras)) for r in _needs(wheels.get(key), set(extras), env)]
    keep: set[str] = set()
    from_node: dict[str, list[Requirement]] = {}
    for name, requirements in by_name.items():
        if (name == "torch" and not with_torch) or node_satisfies(name, node, requirements, wheels.get(name)):
            from_node[name] = requirements
        elif name in wheels:
            keep.add(name)
    # A package only the node's packages need is the node's business: walk again from the roots, through kept
    # wheels only.
    reachable: set[str] = set()
    stack = [(str(canonicalize_name(r.name)), set(r.extras)) for r in roots]
    while stack:
        name, wanted = stack.pop()
        if name in reachable or name not in keep:
            continue
        reachable.add(name)
        stack += [(str(canonicalize_name(r.name)), set(r.extras)) for r in _needs(wheels[name], wanted, env)]
    return reachable, from_node


def _needs(wheel: Wheel | None, extras: set[str], env: dict[str, str]) -> list[Requirement]:
    return [] if wheel is None else [r for r in wheel.requires if applies(r, env, extras)]


def pip(*args: str, env: dict[str, str] | None = None) -> None:
    command = [sys.executable, "-m", "pip", *args]
    print("$ " + " ".join(command), flush=True)
    subprocess.run(command, check=True, env=env)


def build(out: Path, *, python: str, platforms: tuple[str, ...], extras: list[str], node_file: Path | None,
          with_torch: bool) -> list[Path]:
    """Fill `out` (module doc); returns the wheels kept. Its inputs are checked first (`check_inputs`)."""
    import os

    node = check_inputs(out, python, node_file)  # before the old wheels go and anything is built
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):
        old.unlink()
    abi = "cp" + python.replace(".", "")
    with tempfile.TemporaryDirectory() as tmp:
        pip("wheel", "-q", "--no-deps", "-w", str(out), str(REPO))
        pip("download", "-q", "--no-deps", "--no-binary", ":all:", DEEPSPEED, "-d", tmp)
        sdist = next(Path(tmp).glob("deepspeed-*.tar.gz"))
        pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(sdist),
            env={**os.environ, "DS_BUILD_OPS": "0"})
        built = {w.name: w for w in map(read_wheel, out.glob("*.whl"))}
        env = target_environment(python)
        wanted = set(extras)
        requirements = [r for r in built["labkit"].requires if applies(r, env, wanted)]
        requirements += [r for r in built["deepspeed"].requires if applies(r, env, set())]
        lines = sorted({str(r).split(";")[0] for r in requirements
                        if canonicalize_name(r.name) not in ("labkit", "deepspeed")
                        and (with_torch or canonicalize_name(r.name) != "torch")} | set(BUILD_REQUIREMENTS))
        (Path(tmp) / "requirements.txt").write_text("\n".join(lines) + "\n")
        constraints = [c for c in (REPO / "constraints.txt").read_text().splitlines()
                       if c.strip() and not c.startswith("#") and (with_torch or not c.startswith("torch=="))]
        (Path(tmp) / "constraints.txt").write_text("\n".join(constraints) + "\n")
        pip("download", "-q", "--only-binary=:all:", "--python-version", python, "--implementation", "cp",
            "--abi", abi, "--abi", "abi3", "--abi", "none", *(f"--platform={p}" for p in platforms),
            "-d", str(out), "-r", str(Path(tmp) / "requirements.txt"), "-c", str(Path(tmp) / "constraints.txt"))
    wheels = {w.name: w for w in map(read_wheel, out.glob("*.whl"))}
    roots = [Requirement(f"labkit[{','.join(extras)}]" if extras else "labkit"),
             *map(Requirement, BUILD_REQUIREMENTS)]
    keep, from_node = keep_closure(roots, wheels, node, target_environment(python), with_torch=with_torch)
    # Build requirements are installed into pip's isolated build environment, which never sees the node's
    # packages: always carried.
    for requirement in map(Requirement, BUILD_REQUIREMENTS):
        name = str(canonicalize_name(requirement.name))
        keep.add(name)
        from_node.pop(name, None)
    for name, wheel in wheels.items():
        if name not in keep:
            wheel.path.unlink()
    kept = sorted(wheels[name].path for name in keep)
    size = sum(p.stat().st_size for p in kept)
    manifest = [f"# labkit wheelhouse for CPython {python} on {platforms[0]} and older manylinux; extras: "
                f"{','.join(extras) or '(none)'}; {len(kept)} wheels, {size / 2**20:.1f} MiB",
                "# install on the node:  make install WHEELHOUSE=<this folder> "
                f"EXTRAS={','.join(extras)}", "", "# wheels:", *(f"{p.name}" for p in kept), "",
                "# the node must provide (requirements on each):",
                *(f"{name}: {', '.join(sorted({str(r.specifier) or 'any' for r in reqs}))}"
                  for name, reqs in sorted(from_node.items()))]
    (out / "manifest.txt").write_text("\n".join(manifest) + "\n")
    print("\n".join(manifest[:2]))
    return kept


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "wheelhouse")
    parser.add_argument("--python", default=f"{sys.version_info[0]}.{sys.version_info[1]}",
                        help="the node's Python, major.minor (default: this one's)")
    parser.add_argument("--platform", action="append", default=None,
                        help=f"a platform tag for pip (repeatable; default: {', '.join(X86_64_PLATFORMS[:3])}, ...)")
    parser.add_argument("--extras", default="", help="labkit's extras, comma-separated (e.g. notebooks)")
    parser.add_argument("--node-packages", type=Path, default=None,
                        help="what the node has: its `pip list --format=freeze`, or names one a line")
    parser.add_argument("--with-torch", action="store_true", help="carry torch too (default: the node's own)")
    args = parser.parse_args()
    extras = [e.strip() for e in args.extras.split(",") if e.strip()]
    try:
        check_inputs(args.out, args.python, args.node_packages)
    except ValueError as exc:
        print(f"wheelhouse: {exc}", file=sys.stderr)
        return 2
    build(args.out, python=args.python, platforms=tuple(args.platform or X86_64_PLATFORMS), extras=extras,
          node_file=args.node_packages, with_torch=args.with_torch)
    return 0


if __name__ == "__main__":
    sys.exit(main())

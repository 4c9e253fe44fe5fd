"""An offline install that keeps the node's own torch.

The node's Python is itself a venv holding torch (as on the lab's GPU machine, /opt/torch/.venv, and on conda- or
venv-hosted clusters): `python -m venv --system-site-packages` from it did not see that torch. The stand-in node
here is a real venv whose site-packages hold this checkout's torch (linked, not copied: a real, importable
torch and its dependencies, as pip would have put them there).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.conftest import REPO

# What `import torch` needs beside itself (torch 2.13's CPU wheel).
TORCH_AND_DEPS = ("torch", "torchgen", "functorch", "torch-*.dist-info", "typing_extensions.py", "sympy", "mpmath",
                  "filelock", "fsspec", "networkx", "jinja2", "markupsafe", "numpy", "numpy.libs")


@pytest.fixture
def node_python(tmp_path: Path) -> Path:
    """A venv (no pip needed) that holds torch in its own site-packages."""
    import sysconfig

    node = tmp_path / "node"
    subprocess.run([sys.base_prefix + "/bin/python3", "-m", "venv", "--without-pip", str(node)], check=True)
    site = next((node / "lib").glob("python*/site-packages"))
    ours = Path(sysconfig.get_paths()["purelib"])
    for pattern in TORCH_AND_DEPS:
        for path in ours.glob(pattern):
            (site / path.name).symlink_to(path)
    return node / "bin" / "python"


@pytest.mark.slow
def test_make_venv_from_a_venv_python_keeps_its_torch(node_python: Path, tmp_path: Path):
    target = tmp_path / "lab-venv"
    before = subprocess.run([str(node_python), "-m", "venv", "--system-site-packages", "--without-pip",
                             str(tmp_path / "old-way")], capture_output=True, text=True)
    assert before.returncode == 0
    hidden = subprocess.run([str(tmp_path / "old-way" / "bin" / "python"), "-c", "import torch"],
                            capture_output=True, text=True)
    assert hidden.returncode != 0  # what `make install` did before: the node's torch was gone
    subprocess.run(["make", "--no-print-directory", f"VENV={target}", f"PYTHON={node_python}",
                    f"{target}/bin/python"], cwd=REPO, check=True, capture_output=True, text=True)
    seen = subprocess.run([str(target / "bin" / "python"), "-c", "import torch; print(torch.__file__)"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert seen.startswith(str(node_python.parent.parent)), seen  # the node's own torch
    listed = subprocess.run([str(target / "bin" / "python"), "-m", "pip", "list", "--format=freeze"],
                            capture_output=True, text=True, check=True).stdout
    assert any(line.startswith("torch==") for line in listed.splitlines())  # pip will not install it again


def test_wheelhouse_keeps_what_the_node_lacks_and_no_more(tmp_path: Path):
    """The pruning of labkit.runtime.wheelhouse on real wheel metadata: a closure from labkit's requirements that
    stops at torch and at what the node has (at an accepted version), and drops what only those needed."""
    from labkit.runtime.wheelhouse import keep_closure, read_node_packages, read_wheel, target_environment

    def wheel(name: str, version: str, requires: list[str], pure: bool = True) -> Path:
        tag = "py3-none-any" if pure else "cp312-cp312-manylinux_2_17_x86_64"
        path = tmp_path / f"{name}-{version}-{tag}.whl"
        meta = "\n".join([f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)])
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr(f"{name}-{version}.dist-info/METADATA", meta + "\n\nbody\n")
        return path

    paths = [wheel("labkit", "0.1.0", ["deepspeed==0.19.8", "pandas>=2.1", "plotly>=7",
                                       "nbval>=0.11; extra == 'notebooks'"]),
             wheel("deepspeed", "0.19.8", ["torch>=2.0", "pydantic>=2", "numpy"]),
             wheel("pandas", "2.3.0", ["numpy>=1.26", "tzdata"], pure=False), wheel("tzdata", "2025.1", []),
             wheel("numpy", "2.3.0", [], pure=False), wheel("plotly", "7.1.0", ["narwhals"]),
             wheel("narwhals", "2.0", []), wheel("pydantic", "2.12", ["typing-extensions>=4.14.1"]),
             wheel("typing_extensions", "4.15.0", []), wheel("nbval", "0.11.0", ["ipykernel"]),
             wheel("ipykernel", "7.0", [])]
    wheels = {w.name: w for w in map(read_wheel, paths)}
    node_file = tmp_path / "freeze.txt"
    node_file.write_text("torch==2.11.0\npandas==2.2.3\nnumpy==2.5.2\nplotly==5.0\ntyping-extensions\n")
    node = read_node_packages(node_file)
    keep, from_node = keep_closure([Requirement("labkit[notebooks]")], wheels, node, target_environment("3.12"),
                                   with_torch=False)
    assert keep == {"labkit", "deepspeed", "plotly", "narwhals", "pydantic", "typing-extensions", "nbval",
                    "ipykernel"}
    # pandas and numpy: the node's (tzdata went with pandas); torch: the node's; plotly 5.0 < 7: carried;
    # typing-extensions without a version but bounded by pydantic, and a small pure wheel: carried.
    assert {"torch", "pandas", "numpy"} <= set(from_node) and "tzdata" not in keep
    keep_all, _ = keep_closure([Requirement("labkit")], wheels, {}, target_environment("3.12"), with_torch=False)
    assert "nbval" not in keep_all and {"pandas", "numpy", "tzdata"} <= keep_all


@pytest.mark.parametrize("python,node,message", [
    ("3.12", "typo.txt", r"--node-packages \(make's NODE_PACKAGES\) '.*typo.txt': no such file"),
    ("3.12", ".", r"--node-packages \(make's NODE_PACKAGES\) '.*': a folder, not a file"),
    ("3.12", "binary.txt", r"NODE_PACKAGES\) '.*binary.txt': not a text file"),
    ("abc", None, r"--python \(make's WHEEL_PYTHON\) 'abc': must be the node's CPython as major.minor, e.g. 3.12"),
    ("3.12.1", None, r"WHEEL_PYTHON\) '3.12.1': must be .* major.minor"),
    ("2.9", None, r"WHEEL_PYTHON\) '2.9': labkit needs Python >=3.11"),
])
def test_wheelhouse_refuses_bad_inputs_before_it_deletes_or_builds_anything(tmp_path: Path, python, node, message):
    """A typo in NODE_PACKAGES was read only after minutes of building and downloading, and after the old wheels in
    --out were deleted; WHEEL_PYTHON was not checked at all."""
    from labkit.runtime.wheelhouse import build

    out = tmp_path / "wheelhouse"
    out.mkdir()
    (out / "kept-1.0-py3-none-any.whl").write_bytes(b"an earlier wheelhouse's wheel")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00torch")
    with pytest.raises(ValueError, match=message):
        build(out, python=python, platforms=("manylinux_2_28_x86_64",), extras=[],
              node_file=None if node is None else tmp_path / node, with_torch=False)
    assert [p.name for p in out.iterdir()] == ["kept-1.0-py3-none-any.whl"]


def test_python_m_wheelhouse_exits_2_naming_the_make_variable(tmp_path: Path, monkeypatch, capsys):
    from labkit.runtime.wheelhouse import main

    out = tmp_path / "wheelhouse"
    monkeypatch.setattr(sys, "argv", ["wheelhouse", "--out", str(out), "--python", "3.12",
                                      "--node-packages", str(tmp_path / "typo")])
    assert main() == 2
    err = capsys.readouterr().err
    assert err.startswith("wheelhouse: --node-packages (make's NODE_PACKAGES)") and "no such file" in err
    assert not out.exists()


@pytest.mark.slow
def test_make_wheelhouse_for_a_node_writes_the_wheels_and_a_manifest(tmp_path: Path):
    """A real `python -m labkit.runtime.wheelhouse` (PyPI reachable here): labkit and DeepSpeed built, the rest
    downloaded for CPython 3.12 on manylinux, torch and a node's packages left out."""
    node = tmp_path / "node.txt"
    node.write_text("torch==2.11.0\nnumpy==2.5.2\npandas==2.3.3\npsutil==7.0.0\ntqdm==4.67.1\npackaging==25.0\n"
                    "pytest==8.4.2\n")
    out = tmp_path / "wheelhouse"
    subprocess.run([sys.executable, "-m", "labkit.runtime.wheelhouse", "--out", str(out), "--python", "3.12",
                    "--extras", "notebooks", "--node-packages", str(node)], cwd=REPO, check=True, timeout=1200,
                   env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    names = {p.name.split("-")[0].lower() for p in out.glob("*.whl")}
    assert {"labkit", "deepspeed", "nbval", "ipykernel", "pydantic", "plotly", "setuptools"} <= names
    assert not {"torch", "numpy", "pandas", "psutil"} & names
    # The node's Python, not this one's: binary wheels are cp312 or abi3 (a cp311-abi3 wheel runs on 3.12 too).
    assert not [p.name for p in out.glob("*.whl") if "-cp311-cp311-" in p.name]
    assert any("-cp312-cp312-" in p.name for p in out.glob("*.whl"))
    assert "torch: <3,>=2.4, >=2.0.0" in (out / "manifest.txt").read_text()  # what the node must provide

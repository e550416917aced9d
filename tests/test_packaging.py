"""The wheel and the sdist as a pip user gets them: a portable manylinux tag, the licence inside, the
metadata, the wheel installed into a clean virtual environment of another Python minor version (where
``lora-pin parse`` and ``lora-pin simulate`` run, and a manager serves a mixed batch equal to PEFT), and
every module of the package compiled by every supported CPython present.

The wheel is built here with maturin's zig linker (``ziglang`` from requirements/dev.txt), once for the
module; it takes a minute or two on a cold cargo cache.
"""

from __future__ import annotations

import email
import email.message
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The newest glibc a wheel may need: torch's own Linux wheels are manylinux_2_28.
MAX_GLIBC = (2, 28)
OTHER_MINORS = ("3.13", "3.12", "3.10")
SUPPORTED_MINORS = ("3.10", "3.11", "3.12", "3.13")
pytestmark = pytest.mark.slow


def maturin(*args: str, out: Path) -> Path:
    """Runs ``maturin ARGS --out out`` in the repository; returns the one file it wrote."""
    before = set(out.iterdir()) if out.exists() else set()
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    subprocess.run(
        [str(bin_dir / "maturin"), *args, "--out", str(out)], cwd=ROOT, env=env, check=True, timeout=1200
    )
    (made,) = set(out.iterdir()) - before
    return made


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return maturin("build", "--release", "--zig", out=tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="module")
def sdist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return maturin("sdist", out=tmp_path_factory.mktemp("sdist"))


def test_the_wheel_is_abi3_and_manylinux_2_28_or_older(wheel: Path) -> None:
    name, _version, python, abi, platforms = wheel.name.removesuffix(".whl").split("-")
    assert (name, python, abi) == ("lora_pin", "cp310", "abi3")
    for platform in platforms.split("."):
        assert platform.startswith("manylinux_"), f"{platform}: not a manylinux tag"
        major, minor, _arch = platform.removeprefix("manylinux_").split("_", 2)
        assert (int(major), int(minor)) <= MAX_GLIBC, f"{platform} needs a glibc newer than 2.28"


def test_the_wheel_ships_the_licence_and_complete_metadata(wheel: Path) -> None:
    licence = (ROOT / "LICENSE").read_text()
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence
    with zipfile.ZipFile(wheel) as z:
        (dist_info,) = {n.split("/")[0] for n in z.namelist() if ".dist-info/" in n}
        assert z.read(f"{dist_info}/licenses/LICENSE").decode() == licence
        meta = email.message_from_bytes(z.read(f"{dist_info}/METADATA"))
    assert meta["License-Expression"] == "Apache-2.0" and meta["License-File"] == "LICENSE"
    assert meta["Requires-Python"] == ">=3.10"
    classifiers = meta.get_all("Classifier") or []
    for minor in ("3.10", "3.11", "3.12", "3.13"):
        assert f"Programming Language :: Python :: {minor}" in classifiers
    assert {"hf", "metrics", "test"} <= set(meta.get_all("Provides-Extra") or [])
    requires = meta.get_all("Requires-Dist") or []
    assert "prometheus-client>=0.20 ; extra == 'metrics'" in requires
    assert {"transformers>=4.45 ; extra == 'hf'", "peft>=0.13 ; extra == 'hf'"} <= set(requires)
    assert meta["Keywords"]


def test_the_sdist_ships_the_licence_and_the_documents_the_readme_names(sdist: Path) -> None:
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        files = {n.removeprefix(f"{top}/") for n in tar.getnames()}
        member = tar.extractfile(f"{top}/LICENSE")
        assert member is not None
        assert member.read().decode() == (ROOT / "LICENSE").read_text()
    assert {"LICENSE", "README.md", "SECURITY.md", "BENCHMARKS.md", "pyproject.toml"} <= files


def other_python() -> str | None:
    """A CPython of another minor version than this one, with venv and ensurepip: on PATH or under pyenv."""
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    for minor in (m for m in OTHER_MINORS if m != here):
        found = python_of(minor, probe="import venv, ensurepip")
        if found is not None:
            return found
    return None


def python_of(minor: str, probe: str = "pass") -> str | None:
    """A CPython ``minor`` (``"3.13"``) on PATH or under pyenv's versions that runs ``probe``; None when
    there is none (a pyenv shim of a version not installed fails the probe)."""
    if minor == f"{sys.version_info.major}.{sys.version_info.minor}":
        return sys.executable
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = shutil.which(f"python{minor}")
    candidates = [found] if found else []
    candidates += [str(p) for p in sorted(pyenv.glob(f"{minor}.*/bin/python{minor}"), reverse=True)]
    for exe in candidates:
        if subprocess.run([exe, "-c", probe], capture_output=True, check=False).returncode == 0:
            return exe
    return None


# Compiles in memory (no __pycache__ written into the tree) and prints each module that fails.
COMPILE_ALL = """
import pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).rglob("*.py")):
    try:
        compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
    except Exception as e:
        print(f"{path}: {type(e).__name__}: {e}")
"""


@pytest.mark.parametrize("minor", SUPPORTED_MINORS)
def test_every_module_compiles_under_every_supported_python(minor: str) -> None:
    # A docstring holding a lone surrogate ("\\ud800" unescaped) compiles up to 3.12, and 3.13 refuses
    # the whole module: the failure shows only under the Python that has it.
    python = python_of(minor)
    if python is None:
        pytest.skip(f"no CPython {minor} on PATH or under pyenv")
    done = subprocess.run(
        [python, "-c", COMPILE_ALL, str(ROOT / "python" / "lora_pin")],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    assert done.stdout == "", f"CPython {minor} cannot compile:\n{done.stdout}"


def test_the_wheel_runs_parse_and_simulate_under_another_python(wheel: Path, tmp_path: Path) -> None:
    python = other_python()
    if python is None:
        pytest.skip(f"no CPython {'/'.join(OTHER_MINORS)} on PATH or under pyenv")
    venv = tmp_path / "venv"
    subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    # parse and simulate never import torch (nor numpy or safetensors), so the clean environment gets the
    # wheel and the light dependencies alone: torch's wheel is gigabytes, and that it installs is torch's
    # business.
    subprocess.run([*pip, "--no-deps", str(wheel)], check=True, timeout=300)
    subprocess.run([*pip, "orjson>=3.9", "tqdm>=4.66"], check=True, timeout=600)
    lora_pin = str(venv / "bin" / "lora-pin")
    version = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sys; print(sys.version_info[:2])"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert version.stdout.strip() != str(tuple(sys.version_info[:2]))
    parsed = subprocess.run(
        [
            lora_pin,
            "parse",
            "--lora-paths",
            "a=/adapters/a",
            '{"lora_name": "b", "lora_path": "/b", "pinned": true}',
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    rows = json.loads(parsed.stdout)
    assert [(r["lora_name"], r["pinned"]) for r in rows] == [("a", False), ("b", True)]
    simulated = subprocess.run(
        [lora_pin, "simulate", "--requests", "5000", "--slots", "4", "--policy", "lru", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    (row,) = json.loads(simulated.stdout)["results"]
    assert row["requests"] == 5000 and 0 < row["device"]["hit_rate"] <= row["device"]["belady_hit_rate"]

"""The wheel and the sdist as a pip user gets them: a portable manylinux tag, the licence inside, the
metadata, the sdist built by pip into a wheel with the extension (the whole cargo workspace ships), the
wheel installed into a clean virtual environment of another Python minor version (where ``lora-pin parse``
and ``lora-pin simulate`` run, and a manager serves a mixed batch equal to PEFT), and every module of the
package compiled by every supported CPython present.

The wheel is built here with maturin's zig linker (``ziglang`` from requirements/dev.txt), once for the
module; it takes a minute or two on a cold cargo cache.
"""

from __future__ import annotations

import email
import email.message
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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


def test_pip_builds_the_sdist_into_a_wheel_with_the_extension(sdist: Path, tmp_path: Path) -> None:
    # The sdist holds a cargo workspace: its root manifest and all three crates (rust/core, rust/kernels,
    # rust/py) must be in it for the bindings to build. Built as pip builds it (PEP 517, maturin) with this
    # environment's maturin (no build isolation: no download) and the repository's cargo target directory,
    # so the compiled dependencies are reused while lora_pin's own crates compile from the sdist's sources.
    bin_dir = Path(sys.executable).parent
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "CARGO_TARGET_DIR": str(ROOT / "target"),
    }
    pip = [sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check"]
    built = tmp_path / "built"
    subprocess.run(
        [*pip, "--no-build-isolation", "--no-deps", str(sdist), "-w", str(built)],
        env=env,
        check=True,
        timeout=1200,
    )
    (wheel,) = built.glob("lora_pin-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    assert {"lora_pin/_core.abi3.so", "lora_pin/_core.pyi", "lora_pin/__init__.py"} <= names


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


# One model for both interpreters: this test's Python builds it, saves PEFT adapters over it and PEFT's
# mixed-batch output; the other Python builds it again from the same source and serves the batch.
TINY_NET = """
import torch


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList()
        for _ in range(2):
            block = torch.nn.Module()
            block.proj, block.up = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
            self.model.layers.append(block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.model.layers:
            x = x + block.up(torch.relu(block.proj(x)))
        return x
"""

SERVE = """
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from lora_pin import LoRAManager

root = Path(sys.argv[1])
namespace = {}
exec((root / "net.py").read_text(), namespace)
model = namespace["Net"]()
model.load_state_dict(load_file(root / "net.safetensors"))
io = load_file(root / "io.safetensors")
mgr = LoRAManager(model, [f"a={root / 'a'}", f"b={root / 'b'}"], max_loras_per_batch=2)
with torch.no_grad(), mgr.batch(["a", None, "b"]):
    got = model(io["x"])
torch.testing.assert_close(got, io["want"], rtol=1e-5, atol=1e-6)
assert torch.equal(got[1], io["plain"][1]), "the base row differs from the base model's"
print(f"served a mixed batch equal to PEFT under {sys.version_info[:2]}")
"""


def _runtime_requirements(wheel: Path) -> list[str]:
    """The names of the wheel's own runtime dependencies (``Requires-Dist`` without an extra), so the
    environment gets what a pip user's would, whatever the package comes to depend on."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        message = email.message_from_bytes(z.read(meta))
    names = []
    for requirement in message.get_all("Requires-Dist") or []:
        if "extra ==" not in requirement:
            names.append(re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0])
    return names


def _pinned(name: str) -> str:
    """``name==VERSION`` as requirements/dev.txt pins it."""
    text = (ROOT / "requirements" / "dev.txt").read_text()
    match = re.search(rf"^{re.escape(name)}==(\S+)$", text, re.MULTILINE)
    assert match, f"requirements/dev.txt pins no {name}"
    return f"{name}=={match.group(1)}"


def _install_torch(venv_python: Path, pip: list[str]) -> None:
    """torch as requirements/dev.txt pins it, from PyPI, into the venv of ``venv_python``.

    torch's Linux wheel depends on the CUDA libraries' wheels (nvidia-*, some 3 GB): those are the same
    files for every Python (tagged py3-none), so where this interpreter's torch has them installed, the venv
    links to that folder instead of downloading them again, and takes torch's other dependencies alone.
    """
    host_nvidia = [Path(p) / "nvidia" for p in sys.path if (Path(p) / "nvidia").is_dir()]
    if not host_nvidia:
        subprocess.run([*pip, _pinned("torch")], check=True, timeout=1800)
        return
    subprocess.run([*pip, "--no-deps", _pinned("torch")], check=True, timeout=1800)
    gpu_only = ("nvidia-", "cuda-", "triton")
    rest = [r for r in importlib.metadata.requires("torch") or [] if not r.startswith(gpu_only)]
    subprocess.run([*pip, *rest], check=True, timeout=600)
    site = subprocess.run(
        [str(venv_python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(site) / "nvidia").symlink_to(host_nvidia[0], target_is_directory=True)


def test_the_wheel_serves_a_mixed_batch_under_another_python(wheel: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from safetensors.torch import save_file

    from lora_pin.fixtures import save_peft_adapter

    python = other_python()
    if python is None:
        pytest.skip(f"no CPython {'/'.join(OTHER_MINORS)} on PATH or under pyenv")
    import torch

    namespace: dict[str, object] = {}
    exec(TINY_NET, namespace)
    torch.manual_seed(0)
    net = namespace["Net"]().eval()  # type: ignore[operator]
    (tmp_path / "net.py").write_text(TINY_NET)
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, tmp_path / "net.safetensors")
    save_peft_adapter(net, tmp_path / "a", 1, r=4, lora_alpha=8, target_modules=["proj", "up"])
    save_peft_adapter(net, tmp_path / "b", 2, r=2, lora_alpha=2, target_modules=["up"])
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(3))
    oracle = PeftModel.from_pretrained(net, tmp_path / "a", adapter_name="a")
    oracle.load_adapter(tmp_path / "b", adapter_name="b")
    with torch.no_grad():
        want = oracle(x, adapter_names=["a", "__base__", "b"])
        with oracle.disable_adapter():
            plain = oracle(x)
    save_file({"x": x, "want": want, "plain": plain}, tmp_path / "io.safetensors")

    started = time.monotonic()
    venv = tmp_path / "venv"
    subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=300)
    venv_python = venv / "bin" / "python"
    # --no-compile: byte-compiling torch's thousands of modules would add a minute for nothing here.
    pip = [str(venv_python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-compile"]
    subprocess.run([*pip, "--no-deps", str(wheel)], check=True, timeout=300)
    runtime = [n for n in _runtime_requirements(wheel) if n != "torch"]
    subprocess.run([*pip, *(_pinned(n) for n in runtime)], check=True, timeout=600)
    _install_torch(venv_python, pip)
    installed = time.monotonic() - started
    served = subprocess.run(
        [str(venv_python), "-c", SERVE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert served.returncode == 0, served.stderr
    assert "served a mixed batch equal to PEFT" in served.stdout
    assert str(tuple(sys.version_info[:2])) not in served.stdout
    print(f"the other Python's environment took {installed:.0f} s to install")

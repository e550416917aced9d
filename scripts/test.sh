#!/usr/bin/env bash
# The whole test suite: format and lint gates for Rust and Python, the Rust tests, the stub check, the docs
# site (mkdocs, warnings as errors: a broken link or API reference fails), and pytest (Triton interpreter
# tests included). Exits non-zero on the first failure.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
export PATH="$root/.venv/bin:$PATH"
step() { echo; echo "==> $*"; }
step "cargo fmt --check";                      cargo fmt --all --check
step "cargo clippy (core, all targets)";       cargo clippy --all-targets --quiet -- -D warnings
step "cargo clippy (with Python bindings)";    cargo clippy --all-targets --features python --quiet -- -D warnings
step "cargo test";                              cargo test --quiet
step "ruff check";                              ruff check python tests benches
step "ruff format --check";                     ruff format --check python tests benches
step "mypy.stubtest lora_pin._core";           python -m mypy.stubtest lora_pin._core
step "mkdocs build --strict (the docs site)";  NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet
step "vLLM venv (tests/vllm)";                 bash scripts/vllm_venv.sh >/dev/null
step "pytest"
set +e
python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: that is a failure here" >&2
    exit 1
fi
exit "$rc"

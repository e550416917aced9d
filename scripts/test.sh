#!/usr/bin/env bash
# The whole test suite: format and lint gates for Rust and Python, a check that the core and kernel crates
# stay free of PyO3, the Rust tests (every crate), the stub check, the docs site (mkdocs, warnings as
# errors: a broken link or API reference fails), and pytest (Triton interpreter tests included). Exits
# non-zero on the first failure.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
export PATH="$root/.venv/bin:$PATH"
step() { echo; echo "==> $*"; }
# The core and the kernels are plain Rust: PyO3 is only the bindings' (rust/py). A dependency that
# brings it into either crate's tree fails here, before it can blur the line.
no_pyo3() {
    local crate tree
    for crate in lora_pin_core lora_pin_kernels; do
        tree="$(cargo tree -p "$crate" --prefix none --quiet)"
        if grep -q '^pyo3' <<<"$tree"; then
            echo "$crate depends on PyO3 (cargo tree -p $crate -i pyo3 shows how)" >&2
            return 1
        fi
    done
}
step "cargo fmt --check";                           cargo fmt --all --check
step "cargo clippy (core and kernels, no Python)";  cargo clippy -p lora_pin_core -p lora_pin_kernels --all-targets --quiet -- -D warnings
step "cargo clippy (workspace, with bindings)";     cargo clippy --workspace --all-targets --quiet -- -D warnings
step "the core and kernels build without PyO3";     no_pyo3
step "cargo test";                                  cargo test --workspace --quiet
step "ruff check";                                  ruff check python tests benches
step "ruff format --check";                         ruff format --check python tests benches
step "mypy.stubtest lora_pin._core";                python -m mypy.stubtest lora_pin._core
step "mkdocs build --strict (the docs site)";       NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet
step "vLLM venv (tests/vllm)";                      bash scripts/vllm_venv.sh >/dev/null
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

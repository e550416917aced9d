#!/usr/bin/env bash
# The main job on its embedded default (set-up included): `lora-pin demo`, which generates a tiny
# Llama-style model and a dozen PEFT adapters on first run (no network) and serves a mixed workload.
# Extra arguments go to `lora-pin demo` (see `.venv/bin/lora-pin demo --help`).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
exec .venv/bin/lora-pin demo "$@"

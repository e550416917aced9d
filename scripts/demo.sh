#!/usr/bin/env bash
# The main job on its embedded default (set-up included). Extra arguments go to the subcommand.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
exec .venv/bin/lora-pin parse --max-loras-per-batch 4 --max-loaded-loras 8 --lora-paths \
    /srv/adapters/sql \
    math=/srv/adapters/math \
    '{"lora_name": "chat", "lora_path": "/srv/adapters/chat", "pinned": true}' \
    '{"name": "law", "path": "/srv/adapters/law", "base_model_name": "tiny-llama"}' \
    "$@"

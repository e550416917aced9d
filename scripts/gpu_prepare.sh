#!/usr/bin/env bash
# Prepares what a GPU session carries to the lent device machine, which has its own python3 (3.12) with
# torch, triton, transformers and peft but no network: the native extension built here (abi3, so it
# loads on 3.12) and an orjson wheel for 3.12 (not in that image). Writes .gpu_carry/ (git-ignored).
#
#   bash scripts/gpu_prepare.sh
#   then, with the device tool:  run(command="bash scripts/gpu_session.sh",
#                                    carry=[".gpu_carry", "python/lora_pin/_core.abi3.so"], timeout_s=480)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
rm -rf .gpu_carry
mkdir -p .gpu_carry
.venv/bin/python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 -d .gpu_carry "orjson>=3.9"
ls -la .gpu_carry python/lora_pin/_core.abi3.so

#!/usr/bin/env bash
# Runs on the lent GPU machine (see scripts/gpu_prepare.sh): the CUDA-only tests, then the GPU benchmark
# of the ops (benches/gpu_ops.py), each bounded so that the whole fits one device call with room for a
# rerun. Everything it prints also lands in $OUT (logs and the benchmark's JSON rows).
#
#   GPU_OPS_BUDGET_S  seconds after which gpu_ops.py starts no new case (default 200; it lists what it
#                     skipped; all 72 cases need up to 540). At most 120 + budget + 120 s in all: give
#                     the device call a timeout_s of about 450, which leaves a rerun in a 15-minute lease.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
out="${OUT:-/tmp/gpu_out}"
mkdir -p "$out"
deps=/tmp/lora_pin_deps
python3 -m pip install --quiet --no-index --no-deps --target "$deps" .gpu_carry/orjson-*.whl
export PYTHONPATH="$deps:$root/python" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton, lora_pin._core; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$out/gpu.txt"

# The CUDA-only tests (skipped on CPU machines), with the image's own package versions: warnings are
# not promoted to errors here, as the project's pinned versions are not those.
timeout 120 python3 -m pytest -q -p no:cacheprovider -o filterwarnings= -k cuda \
    tests/test_ops_triton.py tests/test_manager.py tests/test_pool.py tests/test_weights.py 2>&1 \
    | tee "$out/cuda_tests.log"
tests=${PIPESTATUS[0]}

timeout $(( ${GPU_OPS_BUDGET_S:-200} + 120 )) python3 benches/gpu_ops.py \
    --budget-s "${GPU_OPS_BUDGET_S:-200}" --json "$out/gpu_ops.json" 2>&1 | tee "$out/gpu_ops.log"
bench=${PIPESTATUS[0]}
echo "cuda tests exit $tests; gpu_ops exit $bench"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]

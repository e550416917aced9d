#!/usr/bin/env bash
# Runs on the lent GPU machine (see scripts/gpu_prepare.sh): the CUDA-only tests, then the GPU benchmark
# of the ops (benches/gpu_ops.py), each bounded so that the whole fits one device call with room for a
# rerun. Everything it prints also lands in $OUT (logs and the benchmark's JSON rows).
#
#   GPU_OPS_BUDGET_S  seconds after which gpu_ops.py starts no new case (default 180; it lists what it
#                     skipped; all 72 cases need up to 540). At most about 30 + 120 + (budget + 120) s
#                     in all: give the device call a timeout_s of about 480, which leaves a rerun in a
#                     15-minute lease. gpu_ops.py writes each row as it is measured, so a cut-off run
#                     keeps its rows.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
out="${OUT:-/tmp/gpu_out}"
mkdir -p "$out"
deps=/tmp/lora_pin_deps
python3 -m pip install --quiet --no-index --no-deps --target "$deps" .gpu_carry/orjson-*.whl
export PYTHONPATH="$deps:$root/python" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
# Stop at once if the carried extension does not load here (built against this image's glibc?).
python3 -c "import torch, triton, lora_pin._core; print('torch', torch.__version__, 'triton', triton.__version__)" \
    2>&1 | tee -a "$out/gpu.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "lora_pin does not import on this machine; see $out/gpu.txt"; exit 3; }

# The CUDA-only tests (skipped on CPU machines), with the image's own package versions: warnings are
# not promoted to errors here, as the project's pinned versions are not those.
timeout 120 python3 -m pytest -q -p no:cacheprovider -o filterwarnings= -k cuda \
    tests/ops/test_triton_sgmv.py tests/model/test_manager.py tests/weights/test_pool.py tests/weights/test_weights.py \
    tests/serve/test_engine.py 2>&1 \
    | tee "$out/cuda_tests.log"
tests=${PIPESTATUS[0]}

timeout $(( ${GPU_OPS_BUDGET_S:-180} + 120 )) python3 benches/gpu_ops.py \
    --budget-s "${GPU_OPS_BUDGET_S:-180}" --json "$out/gpu_ops.json" 2>&1 | tee "$out/gpu_ops.log"
bench=${PIPESTATUS[0]}
echo "cuda tests exit $tests; gpu_ops exit $bench"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]

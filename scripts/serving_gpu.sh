#!/usr/bin/env bash
# scenarios/v41-flash-serving.yaml on one H200 (issue 28's four serving shapes, bf16 and fp8):
# both paths' ms, TFLOP/s, MFU, the FLOP and roofline ideals and the efficiency against each.
# Usage there (carry .whl): bash scripts/serving_gpu.sh; logs and the run folder under $OUT.
set -uo pipefail
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 560 python3 -m swa_bench run scenarios/v41-flash-serving.yaml --out "$OUT/v41-flash-serving" \
  > "$OUT/v41-flash-serving.log" 2>&1
echo "serving run: rc=$?"
tail -60 "$OUT/v41-flash-serving.log"

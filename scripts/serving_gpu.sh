#!/usr/bin/env bash
# scenarios/v41-flash-serving.yaml on one H200 (issue 28's four serving shapes, bf16 and fp8):
# both paths' ms, TFLOP/s, MFU, the FLOP and roofline ideals and the efficiency against each.
# Usage there (carry .whl): bash scripts/serving_gpu.sh; logs and the run folder under $OUT.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
timeout 560 python3 -m swa_bench run scenarios/v41-flash-serving.yaml --out "$OUT/v41-flash-serving" \
  > "$OUT/v41-flash-serving.log" 2>&1
echo "serving run: rc=$?"
tail -60 "$OUT/v41-flash-serving.log"

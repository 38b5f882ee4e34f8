#!/usr/bin/env bash
# The hot path's non-attention overheads on one H200 (issue 12), in one call of the device tool
# (carry [".whl"] as for v41_flash_gpu.sh):
#   1. graph-modes' small mixed batch, eager: ms per step and kernel launches (target < 15 ms);
#   2. the same case through `swa-bench run` (its latency table, MFU under each time);
#   3. v41-flash 16K, eager bf16: reference and replay wall ms, kernels, TFLOP/s, kernel time by
#      kind (scripts/profile_gpu.py).
# Usage: bash scripts/hotpath_gpu.sh [tokens]    (default 16384; about 4-6 minutes)
# Logs and the profile tables go under $OUT; the summary is $OUT/hotpath.txt.
set -uo pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site \
    .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD:$PWD/scripts PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
{
  echo "## 1. small eager step (scripts/hotpath_gpu.py)"
  timeout 180 python3 scripts/hotpath_gpu.py small 2> "$OUT/hotpath-small.err" \
    || tail -5 "$OUT/hotpath-small.err"
  echo "## 2. swa-bench run graph-modes, small mixed batch, eager"
  timeout 180 python3 -m swa_bench run scenarios/graph-modes.yaml \
    --select "eager/bounded/T=104/preset=small" --out "$OUT/runs/graph-modes-small-eager" \
    > "$OUT/graph-modes-small-eager.log" 2>&1
  grep -A8 "latency" "$OUT/graph-modes-small-eager.log" || tail -5 "$OUT/graph-modes-small-eager.log"
  echo "## 3. v41-flash ${1:-16384} tokens, eager bf16 (scripts/profile_gpu.py)"
  timeout 360 python3 scripts/profile_gpu.py "${1:-16384}" > "$OUT/profile.log" 2>&1
  grep -E "^## |^  [a-z]" "$OUT/profile.log" || tail -5 "$OUT/profile.log"
} | tee "$OUT/hotpath.txt"

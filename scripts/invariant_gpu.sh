#!/usr/bin/env bash
# The batch-invariant mode on the H200 (issue 29): op probe, E1/E2 bitwise in the mode, its cost.
# Usage there (carry .whl): bash scripts/invariant_gpu.sh [probe] [checks-16k] [checks-64k] [cost]
set -uo pipefail
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 scripts/invariant_gpu.py "$@" 2>&1 | tee "$OUT/invariant_gpu.log"
exit "${PIPESTATUS[0]}"

#!/usr/bin/env bash
# E1/E2/E5 on the H200 at 16K (bf16, fp32) and 64K (bf16), plus an off-by-one kept-start fault
# that must FAIL. One device call, about 6 minutes; the table goes to stdout and $OUT/checks_gpu.log.
# Usage there (carry .whl): bash scripts/checks_gpu.sh [bf16-16k fault-16k fp32-16k bf16-64k flash-bf16-16k]
set -uo pipefail
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 scripts/checks_gpu.py "$@" 2>&1 | tee "$OUT/checks_gpu.log"
exit "${PIPESTATUS[0]}"

#!/usr/bin/env bash
# E1/E2/E5 on the H200 at 16K (bf16, fp32) and 64K (bf16), plus an off-by-one kept-start fault
# that must FAIL. One device call, about 6 minutes; the table goes to stdout and $OUT/checks_gpu.log.
# Usage there (carry .whl): bash scripts/checks_gpu.sh [bf16-16k fault-16k fp32-16k bf16-64k flash-bf16-16k]
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
python3 scripts/checks_gpu.py "$@" 2>&1 | tee "$OUT/checks_gpu.log"
exit "${PIPESTATUS[0]}"

#!/usr/bin/env bash
# The batch-invariant mode on the H200 (issue 29): op probe, E1/E2 bitwise in the mode, its cost.
# Usage there (carry .whl): bash scripts/invariant_gpu.sh [probe] [checks-16k] [checks-64k] [cost]
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
python3 scripts/invariant_gpu.py "$@" 2>&1 | tee "$OUT/invariant_gpu.log"
exit "${PIPESTATUS[0]}"

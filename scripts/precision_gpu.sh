#!/usr/bin/env bash
# Precision fp8 on one H200 with the real V4.1-Flash stack at 16K tokens (issue 28): the CUDA
# tests of the quantised model, E1/E2/E5 in fp8 with a kept-start fault that must FAIL
# (scripts/checks_gpu.py, PRECISION=fp8), then the timing and approximation run of
# scenarios/v41-flash-fp8.yaml (bf16, fp8 w4a8, fp8 w4a16). One device call, about 9 minutes.
# Usage there (carry .whl): bash scripts/precision_gpu.sh [checks|timing|all]
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
what=${1:-all}
if [ "$what" != timing ]; then
  timeout 120 python3 -m pytest -q -m cuda tests/model/test_precision.py \
    > "$OUT/pytest.log" 2>&1; echo "cuda tests: rc=$? $(tail -1 "$OUT/pytest.log")"
  PRECISION=fp8 timeout 300 python3 scripts/checks_gpu.py flash-bf16-16k flash-fault-16k \
    > "$OUT/checks-fp8-16k.log" 2>&1
  echo "checks: rc=$?"
fi
if [ "$what" != checks ]; then
  timeout 330 python3 -m swa_bench run scenarios/v41-flash-fp8.yaml --out "$OUT/v41-flash-fp8" \
    > "$OUT/v41-flash-fp8.log" 2>&1
  echo "timing run: rc=$?"
  tail -40 "$OUT/v41-flash-fp8.log"
fi
[ -f "$OUT/checks-fp8-16k.log" ] && grep -E "^\| flash|ALL AS|SOMETHING" "$OUT/checks-fp8-16k.log" | cut -c1-330
true

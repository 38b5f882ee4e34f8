#!/usr/bin/env bash
# The fused quantisation kernel on the H200 (issue 28): its CUDA tests and the quantised model's,
# then scenarios/v41-flash-fp8.yaml's timing (bf16, fp8 w4a8, fp8 w4a16 at 16K, eager; the
# approximation off here: the kernel computes the same bits as the PyTorch functions, so the
# committed run's figures stand) and E1 in fp8 against the oracle (PRECISION=fp8 checks_gpu.py).
# Usage there (carry .whl): bash scripts/group_quant_gpu.sh; logs and the run under $OUT.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
timeout 120 python3 -m pytest -q -m cuda -p no:cacheprovider tests/kernels/test_group_quant.py \
  tests/model/test_precision.py > "$OUT/cuda-tests.log" 2>&1
echo "cuda tests: rc=$? ($(tail -1 "$OUT/cuda-tests.log"))"
sed 's/approximation: {enabled: true, continuation_steps: 128}/approximation: {enabled: false}/' \
  scenarios/v41-flash-fp8.yaml > /tmp/v41-flash-fp8-timing.yaml
timeout 230 python3 -m swa_bench run /tmp/v41-flash-fp8-timing.yaml --out "$OUT/run" \
  > "$OUT/v41-flash-fp8.log" 2>&1
echo "timing run: rc=$?"; grep -E "^\[[0-9]/3\]" "$OUT/v41-flash-fp8.log"
tar -C "$OUT" -czf "$OUT/run.tgz" run && rm -rf "$OUT/run"
CHECKS=e1 PRECISION=fp8 timeout 160 python3 scripts/checks_gpu.py flash-bf16-16k \
  > "$OUT/checks-fp8-16k.log" 2>&1
echo "checks: rc=$?"; grep -E "^\| flash" "$OUT/checks-fp8-16k.log" | cut -c1-300

#!/usr/bin/env bash
# PIECEWISE against eager on v41-flash (issue 34): the CUDA tests of the graph code and the
# attention kernel, then scripts/graph_probe_gpu.py's items (default: ab-16k profile-16k mem-64k).
# Usage there (carry .whl): bash scripts/graph_probe_gpu.sh [items...]; logs under $OUT.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
timeout 150 python3 -m pytest -q -m cuda -p no:cacheprovider tests/graphs tests/kernels/test_mqa.py \
  > "$OUT/cuda-tests.log" 2>&1
echo "cuda tests: rc=$? ($(tail -1 "$OUT/cuda-tests.log"))" | tee "$OUT/steps.txt"
python3 scripts/graph_probe_gpu.py "$@" 2>&1 | tee "$OUT/graph_probe_gpu.log"
exit "${PIPESTATUS[0]}"

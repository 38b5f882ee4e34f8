#!/usr/bin/env bash
# The small-model targets of issue 12 in one device call (about 8 minutes at most):
#   1. pytest -m cuda: every GPU test
#   2. scripts/hotpath_gpu.py small: the small preset's mixed eager step, wall and host ms, its
#      launches, and a cProfile of the host time (target: under 15 ms)
#   3. graph-modes.yaml and 4. threshold-sweep.yaml on the GPU: reference / replay per case and
#      the trim-threshold advice
# Usage (carry [".whl"]): bash scripts/hostpath_gpu.sh. Logs come back in $OUT/hostpath.tgz;
# the summary is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD:$PWD/scripts PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; W=/tmp/hostpath; RUNS=$W/runs; mkdir -p "$OUT" "$RUNS"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$W/gpu.txt"
step() {  # name, time limit (s), command...
  local name=$1 limit=$2 start=$SECONDS rc; shift 2
  timeout "$limit" "$@" > "$W/$name.log" 2>&1
  rc=$?
  echo "$name: rc=$rc in $((SECONDS - start)) s" >> "$W/steps.txt"
}
step hotpath 90 env OUT="$W" python3 scripts/hotpath_gpu.py small
step cuda-tests 200 python3 -m pytest -q -m cuda -p no:cacheprovider
step graph-modes 120 python3 -m swa_bench run scenarios/graph-modes.yaml --out "$RUNS/graph-modes"
step threshold-sweep 150 python3 -m swa_bench run scenarios/threshold-sweep.yaml \
  --out "$RUNS/threshold-sweep"
{
  cat "$W/gpu.txt" "$W/steps.txt"
  echo "== pytest -m cuda"; grep -E "^(FAILED|ERROR)" "$W/cuda-tests.log" | head; tail -2 "$W/cuda-tests.log"
  echo "== hotpath"; tail -4 "$W/hotpath.log"
  head -30 "$W/hotpath-small-reference-cprofile.txt" 2>/dev/null | tail -22
  python3 scripts/run_summary.py "$RUNS/graph-modes" "$RUNS/threshold-sweep"
} > "$W/summary.txt" 2>&1
tar czf "$OUT/hostpath.tgz" -C "$W" .
cat "$W/summary.txt"

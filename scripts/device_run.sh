#!/usr/bin/env bash
# Everything that needs the H200, in one call of the device tool (see README "On a GPU").
# Usage there: bash scripts/device_run.sh [quick|full]; logs and run folders go under $OUT.
set -uo pipefail
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/out}; RUNS=/tmp/runs; mkdir -p "$OUT" "$RUNS"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
sb() { python3 -m swa_bench "$@"; }
case "${1:-quick}" in
  quick)
    python3 -m pytest -m cuda -q tests/graphs tests/bench 2>&1 | tee "$OUT/pytest_cuda.log" | tail -3
    sb run scenarios/graph-modes.yaml --out "$RUNS/graph-modes" > "$OUT/graph-modes.log" 2>&1
    tail -25 "$OUT/graph-modes.log"
    sb run scenarios/v41-flash-shape-16k.yaml --out "$RUNS/v41-16k-a" > "$OUT/v41-16k-a.log" 2>&1
    sb run scenarios/v41-flash-shape-16k.yaml --out "$RUNS/v41-16k-b" > "$OUT/v41-16k-b.log" 2>&1
    sb compare "$RUNS/v41-16k-a" "$RUNS/v41-16k-b" --out "$OUT/v41-16k-compare.md" 2>&1 | tail -12
    tail -12 "$OUT/v41-16k-a.log"; tail -12 "$OUT/v41-16k-b.log"
    cp "$RUNS/graph-modes/results.json" "$OUT/graph-modes.json"
    cp "$RUNS/v41-16k-a/results.json" "$OUT/v41-16k-a.json"
    ;;
  eager|piecewise)
    # v41-flash-shape at 16K and 64K tokens, one graph mode per call (a call runs 10 minutes at most)
    # an optional second argument narrows the cases further (a label substring)
    sb run scenarios/v41-flash-shape.yaml --select "${2:-$1/}" --out "$OUT/v41-$1" 2>&1 \
      | tee "$OUT/v41-$1.log" | tail -20
    ;;
esac

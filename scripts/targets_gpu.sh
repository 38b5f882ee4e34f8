#!/usr/bin/env bash
# Every target of the GPU-speed issue from one H200 call, in this order (correctness first; each
# timing step alone on the GPU):
#   1. pytest -m cuda: every GPU test (kernels vs the PyTorch path, graphs, the captured training
#      step)
#   2. scripts/v41_flash_gpu.sh all: v41-flash at 16K and 64K, eager and PIECEWISE, the README's
#      H200 table (both paths' ms, TFLOP/s and MFU, the FLOP ideal) and its run folders
#   3. the 16K eager case again, and `swa-bench compare` against step 2's run: two runs within 2%
#   4. swa-bench kernels: dense causal and sparse attention at 16K tokens, bf16 (targets: 300
#      TFLOP/s, 50% of roofline); SWEEP=1 also sweeps the dense kernel's tiles
#   5. scripts/hotpath_gpu.py small: the small preset's mixed eager step, wall, host and device
#      busy ms, its launches by kind, the host cost of one launch (target: under 15 ms)
#   6. graph-modes.yaml on the GPU: each case's reference / replay ms and the E3 checks
#   7. threshold-sweep.yaml on the GPU: the trim-threshold advice, replay vs reference per length
# Usage (carry [".whl"]): [BUDGET=s] [CUDA_TESTS=0|"test paths"] bash scripts/targets_gpu.sh
# [all|small] ("small" leaves out steps 2 and 3: about 4 minutes; "all" about 9; step 1 takes
# 2-4 minutes with the host's speed: CUDA_TESTS=0 leaves it out, test paths run only those).
# Everything comes back in $OUT/targets.tgz; the summary is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-all}
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD:$PWD/scripts PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/out}; W=/tmp/targets; RUNS=$W/runs; mkdir -p "$OUT" "$RUNS"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$W/gpu.txt"

BUDGET=${BUDGET:-570}  # seconds for all steps: the summary and the tarball still come back
step() {  # name, time limit (s), command...
  local name=$1 limit=$2 start=$SECONDS rc; shift 2
  local left=$((BUDGET - SECONDS))
  if [ "$left" -lt 20 ]; then echo "$name: skipped (budget spent)" >> "$W/steps.txt"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  timeout "$limit" "$@" > "$W/$name.log" 2>&1
  rc=$?
  echo "$name: rc=$rc in $((SECONDS - start)) s" >> "$W/steps.txt"
}
case "${CUDA_TESTS:-all}" in
  all) step cuda-tests 240 python3 -m pytest -q -m cuda -p no:cacheprovider --durations=10 ;;
  0) ;;
  *) step cuda-tests 150 python3 -m pytest -q -m cuda -p no:cacheprovider $CUDA_TESTS ;;
esac
if grep -q "^FAILED tests/kernels/test_launch.py" "$W/cuda-tests.log" 2>/dev/null; then
  export SWA_BENCH_TRITON_LAUNCH=triton  # the direct launch failed its test: Triton's path
  echo "direct Triton launch failed its test: every later step on Triton's path" >> "$W/steps.txt"
fi
if [ "$MODE" = all ]; then
  step flash 320 env OUT="$W/flash" bash scripts/v41_flash_gpu.sh all
  step flash-16k-again 90 python3 -m swa_bench run scenarios/v41-flash-gpu.yaml \
    --select "eager/bounded/T=16384/" --out "$RUNS/eager-16k-again"
  step compare-16k 30 python3 -m swa_bench compare "$W/flash/runs/eager-16k/results.json" \
    "$RUNS/eager-16k-again/results.json" --max-slowdown 0.02
fi
step kernels 60 python3 -m swa_bench kernels -t 16384 -p dense -p sparse
[ -n "${SWEEP:-}" ] && step kernel-sweep 150 python3 -m swa_bench kernels -t 16384 -p dense --sweep
step hotpath 90 env OUT="$W" python3 scripts/hotpath_gpu.py small
step graph-modes 120 python3 -m swa_bench run scenarios/graph-modes.yaml --out "$RUNS/graph-modes"
step threshold-sweep 150 python3 -m swa_bench run scenarios/threshold-sweep.yaml \
  --out "$RUNS/threshold-sweep"

{
  cat "$W/gpu.txt" "$W/steps.txt"
  if [ -f "$W/cuda-tests.log" ]; then
    echo "== 1. pytest -m cuda"; grep -E "^(FAILED|ERROR)" "$W/cuda-tests.log" | head
    tail -1 "$W/cuda-tests.log"
  fi
  if [ "$MODE" = all ]; then
    echo "== 2. v41-flash (scripts/v41_flash_gpu.sh all)"; cat "$W/flash/cases.txt" "$W/flash/table.md"
    echo "== 3. the 16K eager case again, compared with step 2's run"
    python3 scripts/run_summary.py "$RUNS/eager-16k-again"; tail -6 "$W/compare-16k.log"
  fi
  echo "== 4. kernels (16K, bf16)"; grep -E "GEMM|^  (dense|sparse)" "$W/kernels.log"
  [ -f "$W/kernel-sweep.log" ] && grep -E "^  dense .*triton" "$W/kernel-sweep.log" \
    | awk '{print $(NF-1), $0}' | sort -g | cut -d' ' -f2- | tail -6
  echo "== 5. hotpath (small: mixed eager step)"; tail -5 "$W/hotpath.log"
  echo "== 6/7. graph-modes and threshold-sweep: reference / replay median ms"
  python3 scripts/run_summary.py "$RUNS/graph-modes" "$RUNS/threshold-sweep"
  grep -h "recommended trim_threshold" "$W/graph-modes.log" "$W/threshold-sweep.log"
} > "$W/targets.txt" 2>&1
tar czf "$OUT/targets.tgz" -C "$W" .
cat "$W/targets.txt"

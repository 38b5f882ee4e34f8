#!/usr/bin/env bash
# Trains the shipped v41-mini checkpoint twice from the same seed on one GPU, both runs at once
# (each step is one CUDA-graph replay; two processes share the GPU), and shows that the held-out
# figures agree (reproducibility). Writes under $OUT (default ./train-out):
#   run1/v41-mini.safetensors + .md   the checkpoint and card to ship (swa_bench/checkpoints/)
#   run{1,2}.log                      each run's loss curve and figures
# Usage there (carry the safetensors wheel in .whl/):
#   bash scripts/train_small.sh [--steps N] [other args of python -m swa_bench.train]
# Without --steps, a 100-step probe times one step and the step count is the most that fits
# BUDGET seconds (default 330) for the two runs side by side; both runs use that same count,
# and the card records it.
set -uo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
OUT="${OUT:-train-out}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt" || true
args=("$@")
if [[ " $* " != *" --steps "* ]]; then
  python3 -m swa_bench.train --device cuda --seed 0 --steps 100 --eval-prompts 8 "${args[@]}" \
    > "$OUT/probe.log" 2>&1
  seconds=$(sed -n 's/^trained 100 steps in \([0-9.]*\)s.*/\1/p' "$OUT/probe.log")
  [ -n "$seconds" ] || { tail -20 "$OUT/probe.log"; exit 1; }
  steps=$(python3 -c "print(int(${BUDGET:-330} / (2 * $seconds / 100)) // 100 * 100)")
  echo "probe: 100 steps in ${seconds}s alone; two runs of $steps steps side by side" | tee "$OUT/steps.txt"
  args+=(--steps "$steps")
fi
for run in run1 run2; do
  python3 -m swa_bench.train --device cuda --seed 0 \
    --out "$OUT/$run/v41-mini.safetensors" "${args[@]}" > "$OUT/$run.log" 2>&1 &
done
wait
echo
echo "run   figures (full prefill, held-out)"
for run in run1 run2; do
  printf '%s  %s\n' "$run" "$(grep -E '^(trained|full prefill)' "$OUT/$run.log" | tr '\n' ' ')"
  grep -q '^full prefill' "$OUT/$run.log" || tail -5 "$OUT/$run.log"
done

#!/usr/bin/env bash
# Trains the shipped v41-mini checkpoint twice from the same seed on one GPU, both runs at once
# (each step is one CUDA-graph replay: two processes share the GPU), and shows that the held-out
# figures agree (reproducibility). Writes under $OUT (default ./train-out):
#   run1/v41-mini.safetensors + .md   the checkpoint and card to ship (swa_bench/checkpoints/)
#   run{1,2}.log                      each run's loss curve and figures
# Usage there (carry the safetensors wheel in .whl/): bash scripts/train_small.sh [extra args of
# python -m swa_bench.train]. Each run prints its loss every 50 steps and its figures at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT="${OUT:-train-out}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt" || true
for run in run1 run2; do
  python3 -m swa_bench.train --device cuda --seed 0 \
    --out "$OUT/$run/v41-mini.safetensors" "$@" > "$OUT/$run.log" 2>&1 &
done
wait
echo
echo "run   figures (full prefill, held-out)"
for run in run1 run2; do
  printf '%s  %s\n' "$run" "$(grep -E '^(trained|full prefill)' "$OUT/$run.log" | tr '\n' ' ')"
  grep -q '^full prefill' "$OUT/$run.log" || tail -5 "$OUT/$run.log"
done

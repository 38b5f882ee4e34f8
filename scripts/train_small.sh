#!/usr/bin/env bash
# Trains the shipped v41-mini checkpoint twice from the same seed on one GPU, both runs at once
# (each step is one CUDA-graph replay; two processes share the GPU), and shows that the held-out
# figures agree (reproducibility). Writes under $OUT (default ./train-out):
#   run1/v41-mini.safetensors + .md   the checkpoint and card to ship (swa_bench/checkpoints/)
#   run{1,2}.log                      each run's loss curve and figures
# Usage there (carry the safetensors wheel in .whl/):
#   bash scripts/train_small.sh [--steps N] [other args of python -m swa_bench.train]
# Without --steps, a 200-step probe times one step and the step count is the most that fits
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
  python3 -m swa_bench.train --device cuda --seed 0 --steps 200 --eval-prompts 8 "${args[@]}" \
    > "$OUT/probe.log" 2>&1
  # seconds per step between the step-50 and the last log line (start-up and capture excluded)
  steps=$(python3 - "$OUT/probe.log" "${BUDGET:-330}" <<'PY'
import re, sys
marks = [(int(a), float(b)) for a, b in
         re.findall(r"^step +(\d+) .* ([0-9.]+)s$", open(sys.argv[1]).read(), re.M)]
(s0, t0), (s1, t1) = marks[1], marks[-1]
per_step = (t1 - t0) / (s1 - s0)
print(int(float(sys.argv[2]) / (2 * per_step)) // 100 * 100, f"{per_step * 1e3:.1f}")
PY
)
  [ -n "$steps" ] || { tail -20 "$OUT/probe.log"; exit 1; }
  read -r steps ms <<< "$steps"
  echo "probe: ${ms} ms a step alone; two runs of $steps steps side by side" | tee "$OUT/steps.txt"
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

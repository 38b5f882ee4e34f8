#!/usr/bin/env bash
# Trains the shipped v41-mini checkpoint twice from the same seed on one GPU, both runs at once
# (each step is one CUDA-graph replay; two processes share the GPU), and shows that the held-out
# figures agree (reproducibility). Writes under $OUT (default ./train-out):
#   run1/v41-mini.safetensors + .md   the checkpoint and card to ship (swa_bench/checkpoints/)
#   run{1,2}.log                      each run's loss curve and figures
# Usage there (carry the safetensors wheel in .whl/):
#   bash scripts/train_small.sh [--steps N] [other args of python -m swa_bench.train]
# Without --steps, a probe times a step at each prompt length of the length warm-up and at
# --seq-len, and the step count is the most that fits BUDGET seconds (default 420) for the two
# runs side by side (the warm-up phases as configured, the rest at --seq-len); both runs use
# that same count, and the card records it.
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
  # 150 steps at each warm-up length and 150 at --seq-len, timed from the log's marks
  probe=$(python3 -c "from swa_bench.train.loop import TrainConfig as C
print(','.join(f'{n}:150' for n, _ in C().length_warmup) or 'none', 150 * (1 + len(C().length_warmup)))")
  read -r probe_warmup probe_steps <<< "$probe"
  python3 -m swa_bench.train --device cuda --seed 0 --steps "$probe_steps" \
    --length-warmup "$probe_warmup" --eval-prompts 8 "${args[@]}" > "$OUT/probe.log" 2>&1
  steps=$(python3 - "$OUT/probe.log" "${BUDGET:-420}" <<'PY'
import re, sys
from collections import defaultdict
from swa_bench.train.loop import TrainConfig
marks = defaultdict(list)  # prompt length -> (step, seconds) marks, 50 steps apart
for step, length, sec in re.findall(r"^step +(\d+) +T +(\d+) .* ([0-9.]+)s$",
                                    open(sys.argv[1]).read(), re.M):
    marks[int(length)].append((int(step), float(sec)))
# seconds a step per length, from the phase's second mark on (capture and start-up excluded)
cost = {n: (m[-1][1] - m[1][1]) / (m[-1][0] - m[1][0]) for n, m in marks.items() if len(m) > 2}
final = max(cost)
budget = float(sys.argv[2]) / 2  # two runs share the GPU: each gets about half
warm = TrainConfig().length_warmup
left = budget - sum(k * cost[n] for n, k in warm)
steps = (sum(k for _, k in warm) + int(left / cost[final])) // 100 * 100
print(steps, " ".join(f"{n}:{c * 1e3:.1f}" for n, c in sorted(cost.items())))
PY
)
  [ -n "$steps" ] || { tail -20 "$OUT/probe.log"; exit 1; }
  read -r steps ms <<< "$steps"
  echo "probe: ms a step alone by prompt length ${ms}; two runs of $steps steps side by side" \
    | tee "$OUT/steps.txt"
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

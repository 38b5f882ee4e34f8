#!/usr/bin/env bash
# A/A: every shipped CPU scenario run four times on one machine, each run compared with the one
# before it (`swa-bench compare`, default gate). Nothing changed between runs, so each of the three
# comparisons must pass: a failure here is the gate failing on noise.
#   bash scripts/aa_cpu.sh [out-dir] [scenario ...]
set -uo pipefail
out=${1:-/tmp/aa}; shift || true
scenarios=${*:-smoke coverage sparse-policies approximation graph-modes threshold-sweep batch-sweep}
mkdir -p "$out"
for s in $scenarios; do
  start=$SECONDS
  python -m swa_bench run "$s" --out "$out/$s-0" > "$out/$s-0.log" 2>&1 || echo "$s run 0: rc=$?"
  verdicts=()
  for i in 1 2 3; do
    python -m swa_bench run "$s" --out "$out/$s-$i" > "$out/$s-$i.log" 2>&1 || echo "$s run $i: rc=$?"
    if python -m swa_bench compare "$out/$s-$((i - 1))" "$out/$s-$i" > "$out/$s-cmp$i.log" 2>&1
    then verdicts+=(pass); else verdicts+=(FAIL); fi
  done
  echo "$s: A/A ${verdicts[*]} ($((SECONDS - start)) s for 4 runs)" | tee -a "$out/summary.txt"
done

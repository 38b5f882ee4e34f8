#!/usr/bin/env bash
# A/A for the checks: every shipped CPU scenario checked three times in a row on unmodified code
# (`swa-bench check`). Nothing is wrong with the code, so every run must pass: the control group
# of the seeded-fault harness in tests/faults (a check that fails here fails on rounding or
# flakiness, not on a bug).
#   bash scripts/aa_cpu.sh [out-dir] [scenario ...]
set -uo pipefail
out=${1:-/tmp/aa}; shift || true
scenarios=${*:-smoke coverage sparse-policies approximation graph-modes threshold-sweep batch-sweep}
mkdir -p "$out"
for s in $scenarios; do
  start=$SECONDS
  verdicts=()
  for i in 1 2 3; do
    if python -m swa_bench check "$s" > "$out/$s-$i.log" 2>&1; then verdicts+=(pass)
    else verdicts+=("FAIL(rc=$?)"); fi
  done
  echo "$s: ${verdicts[*]} ($((SECONDS - start)) s for 3 checks; $(tail -1 "$out/$s-3.log"))" \
    | tee -a "$out/summary.txt"
done

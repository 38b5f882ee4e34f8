#!/usr/bin/env bash
# Replay graphs on the H200 (issue 34), one call: the CUDA tests of the graph code (replay graphs ==
# the padded eager replay batch bitwise, model graphs == eager), then graph-modes.yaml and
# threshold-sweep.yaml on the small and tiny presets with replay graphs on (the default in
# PIECEWISE) and, for threshold-sweep, off (`replay_graphs: false`, today's eager replay batch
# inside the break), each case's reference / replay ms and the advice. About 6 minutes.
# Usage (carry [".whl"]): bash scripts/replay_graphs_gpu.sh; run folders and logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
source "$(dirname "$0")/gpu_env.sh"
RUNS=$OUT/runs; mkdir -p "$RUNS"
step() {  # name, time limit (s), command...
  local name=$1 limit=$2 start=$SECONDS rc; shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "$name: rc=$rc in $((SECONDS - start)) s" | tee -a "$OUT/steps.txt"
}
step cuda-tests 150 python3 -m pytest -q -m cuda -p no:cacheprovider \
  tests/graphs/test_replay_graphs.py tests/graphs/test_graph_modes.py
step graph-modes 150 python3 -m swa_bench run scenarios/graph-modes.yaml --out "$RUNS/graph-modes"
step threshold-sweep 170 python3 -m swa_bench run scenarios/threshold-sweep.yaml \
  --select piecewise --out "$RUNS/threshold-sweep"
cp scenarios/threshold-sweep.yaml /tmp/ts-off.yaml
printf 'replay_graphs: false\n' >> /tmp/ts-off.yaml
sed -i 's/^name: threshold-sweep$/name: threshold-sweep-eager-replay/' /tmp/ts-off.yaml
step threshold-sweep-off 120 python3 -m swa_bench run /tmp/ts-off.yaml --select piecewise \
  --out "$RUNS/threshold-sweep-off"
python3 - "$RUNS" <<'PY' | tee "$OUT/table.md"
import json, sys
from pathlib import Path
runs = Path(sys.argv[1])
print("| run | case | reference ms | replay ms | speedup | ideal | replay route |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for run in ("graph-modes", "threshold-sweep", "threshold-sweep-off"):
    path = runs / run / "results.json"
    if not path.exists():
        print(f"| {run} | no results |")
        continue
    for c in json.loads(path.read_text())["cases"]:
        t = c.get("timing") or {}
        ref, rep = (t.get("reference") or {}).get("median_ms"), (t.get("replay") or {}).get("median_ms")
        f = lambda x: "-" if x is None else f"{x:.2f}"
        print(f"| {run} | {c['label'][:60]} | {f(ref)} | {f(rep)} | {f(c.get('speedup'))} "
              f"| {f(c.get('ideal_speedup'))} | {(c.get('replay_route') or '')[:90]} |")
PY
grep -h "recommended\|not enough" "$OUT"/threshold-sweep*.log "$OUT"/graph-modes.log | head -20

#!/usr/bin/env bash
# The attention kernels on the H200: their tests against the PyTorch path (pytest -m cuda), then
# `swa-bench kernels` at 16K (every problem, both paths, the tile sweep) and the sparse and dense
# problems at 64K with the default tile. Logs and JSON go under $OUT; a short table is printed.
#
# Usage with the device tool (carry [".whl"]; ../shared/device/prep.sh fills .whl once):
#   bash scripts/kernels_gpu.sh
# SWA_BENCH_MQA_TILE=block_n,block_dv,num_warps,num_stages picks another tile for every run.
set -uo pipefail
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$OUT/gpu.txt"

timeout 300 python3 -m pytest -q -p no:cacheprovider -m cuda tests/kernels > "$OUT/pytest.log" 2>&1
echo "pytest -m cuda tests/kernels: rc=$? ($(tail -1 "$OUT/pytest.log"))" | tee "$OUT/summary.txt"
grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20

timeout 240 python3 -m swa_bench kernels --tokens 16384 --sweep --json > "$OUT/kernels-16k.json" \
  2> "$OUT/kernels-16k.log"
echo "swa-bench kernels 16K sweep: rc=$?" | tee -a "$OUT/summary.txt"
timeout 200 python3 -m swa_bench kernels --tokens 65536 -p sparse -p dense -p compressed --json \
  > "$OUT/kernels-64k.json" 2> "$OUT/kernels-64k.log"
echo "swa-bench kernels 64K: rc=$?" | tee -a "$OUT/summary.txt"

python3 - "$OUT" <<'PY' | tee "$OUT/table.md"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print("| problem | T | path | tile | ms | TFLOP/s | GB/s | % roofline | bound | vs torch |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for name in ("kernels-16k.json", "kernels-64k.json"):
    path = out / name
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        print(f"| {name}: no results (see {name[:-5]}.log) |")
        continue
    rows = report["results"]
    torch_ms = {(r["problem"], r["tokens"]): r["median_ms"] for r in rows if r["backend"] == "torch"}
    for r in rows:
        base = torch_ms.get((r["problem"], r["tokens"]))
        gain = f"{base / r['median_ms']:.1f}x" if base and r["backend"] == "triton" else "-"
        print(f"| {r['problem']} | {r['tokens']} | {r['backend']} | {r['tile']} "
              f"| {r['median_ms']:.2f} | {r['tflops']:.0f} | {r['gbytes_per_s']:.0f} "
              f"| {r['roofline_pct']:.0f} | {r['bound']} | {gain} |")
    print(f"| peaks: GEMM {report['peak_tflops']:.0f} TFLOP/s, copy "
          f"{report['peak_gbytes_per_s']:.0f} GB/s |")
PY

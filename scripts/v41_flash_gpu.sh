#!/usr/bin/env bash
# The real V4.1-Flash layer stack (40 layers, top-512 sparse attention, 384 routed experts top-6) on
# one H200, bf16: 16K and 64K tokens, bounded replay, eager and PIECEWISE, E1 and E5 (eager cases),
# then a table: reference ms, replay ms, speedup, FLOP-ideal (torch's counter and the analytic
# model), peak memory. One case per process (a 64K PIECEWISE case holds two graph sets: nothing
# else may be resident), each under its own time limit so a slow case cannot eat the others'.
#
# Usage with the device tool (carry [".whl"]; ../shared/device/prep.sh fills .whl once):
#   bash scripts/v41_flash_gpu.sh          # all four cases, about 3-4 minutes (191 s on 2026-12-04)
#   bash scripts/v41_flash_gpu.sh 16k      # the 16K cases only (if 'all' runs past the limit)
#   bash scripts/v41_flash_gpu.sh 64k
#   bash scripts/v41_flash_gpu.sh eager    # 16K and 64K, eager only
#   bash scripts/v41_flash_gpu.sh piecewise  # 16K and 64K, PIECEWISE only (replay graphs on)
#   PRECISION=fp8 bash scripts/v41_flash_gpu.sh ...  # the same cases in the release's numerics
# The table, cases.txt and gpu.txt go under $OUT; the run folders, logs and memory traces into
# $OUT/runs.tgz (the device returns at most 8 files).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
RUNS=$OUT/runs; mkdir -p "$RUNS"
SCENARIO=scenarios/v41-flash-gpu.yaml
if [ "${PRECISION:-bf16}" = fp8 ]; then  # the release's numerics (w4a8 experts), same cases
  sed 's/^name: v41-flash-gpu$/name: v41-flash-gpu-fp8/; s/^dtype: bfloat16$/dtype: bfloat16\nprecision: fp8\nexpert_precision: w4a8/' \
    "$SCENARIO" > /tmp/v41-flash-gpu-fp8.yaml
  SCENARIO=/tmp/v41-flash-gpu-fp8.yaml
fi

run_case() {  # label substring, run folder name, time limit (s)
  local select=$1 name=$2 limit=$3 start=$SECONDS rc
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 250 > "$OUT/$name.mem" &
  local smi=$!
  timeout "$limit" python3 -m swa_bench run "$SCENARIO" --select "$select" --out "$RUNS/$name" \
    > "$OUT/$name.log" 2>&1
  rc=$?
  kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null
  echo "$name: rc=$rc in $((SECONDS - start)) s, device memory used at most" \
       "$(sort -n "$OUT/$name.mem" | tail -1) MiB" | tee -a "$OUT/cases.txt"
  [ "$rc" -eq 0 ] || tail -5 "$OUT/$name.log"
}

case "${1:-all}" in
  16k) run_case "eager/bounded/T=16384/" eager-16k 150
       run_case "piecewise/bounded/T=16384/" piecewise-16k 150 ;;
  64k) run_case "eager/bounded/T=65536/" eager-64k "${LIMIT_EAGER:-240}"
       run_case "piecewise/bounded/T=65536/" piecewise-64k "${LIMIT_PIECEWISE:-240}" ;;
  eager) run_case "eager/bounded/T=16384/" eager-16k 200
         run_case "eager/bounded/T=65536/" eager-64k 300 ;;
  piecewise) run_case "piecewise/bounded/T=16384/" piecewise-16k 200
             run_case "piecewise/bounded/T=65536/" piecewise-64k 300 ;;
  all) run_case "eager/bounded/T=16384/" eager-16k 100
       run_case "piecewise/bounded/T=16384/" piecewise-16k 100
       run_case "eager/bounded/T=65536/" eager-64k 170
       run_case "piecewise/bounded/T=65536/" piecewise-64k 200 ;;
esac

python3 - "$RUNS" "$OUT" <<'PY' | tee "$OUT/table.md"
import json, sys
from pathlib import Path
from swa_bench.bench.flop_model import step_flops
from swa_bench.kernels import Kernels
from swa_bench.model.args import PRESETS
from swa_bench.model.requests import RequestSpec

runs, out = Path(sys.argv[1]), Path(sys.argv[2])
args = PRESETS["v41-flash"]
rates = {}
print("| tokens | mode | reference ms | replay ms | speedup | FLOP-ideal (counter / model) "
      "| efficiency | reference TFLOP/s (MFU) | replay TFLOP/s (MFU) | device max GiB | E5 |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for name in ("eager-16k", "piecewise-16k", "eager-64k", "piecewise-64k"):
    path = runs / name / "results.json"
    if not path.exists():
        print(f"| {name} | no results (see {name}.log) |")
        continue
    data = json.loads(path.read_text())
    gemm = (data.get("environment") or {}).get("gemm_tflops")
    if gemm:
        rates[name] = gemm
    for case in data["cases"]:
        t = case.get("timing") or {}
        ref, rep = (t.get("reference") or {}), (t.get("replay") or {})
        kept = case.get("deterministic", {}).get("kept_rows", args.window)
        req = [RequestSpec(prompt_len=case["tokens"])]
        ran = case.get("kernels") or {"backend": "triton"}  # the kernels the case recorded
        kernels = Kernels(ran["backend"])  # the FLOP model depends on the backend alone
        model = step_flops(args, req, [case["tokens"]], "cuda", kernels)["total"] / \
            step_flops(args, req, [kept], "cuda", kernels)["total"]
        peak = case.get("peak_memory_bytes", {})
        mem = [int(x) for x in (out / f"{name}.mem").read_text().split() if x.strip().isdigit()]
        checks = {c["id"]: ("pass" if c["passed"] else "FAIL: " + c["message"][:60])
                  for c in case.get("checks", [])}
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        tf, mfu = case.get("achieved_tflops") or {}, case.get("mfu") or {}
        rate = lambda p: (f"{tf[p]:.0f} ({100 * mfu[p]:.0f}%)" if p in tf and p in mfu  # noqa: E731
                          else "-")
        print(f"| {case['tokens']} | {case['graph_mode']} | {fmt(ref.get('median_ms'), '.1f')} "
              f"| {fmt(rep.get('median_ms'), '.1f')} | {fmt(case.get('speedup'), '.2f')}x "
              f"| {fmt(case.get('ideal_speedup'), '.2f')}x / {model:.2f}x "
              f"| {fmt(case.get('efficiency'), '.0%')} | {rate('reference')} | {rate('replay')} "
              f"| {max(mem, default=0) / 1024:.1f} | {checks.get('E5', '-')} |")
        if case.get("status") == "error":
            print(f"|   | error: {case['error'].splitlines()[0][:150]} |")
        breakdown = t.get("breakdown_ms") or {}
        if breakdown:
            print(f"|   | replay breakdown ms: "
                  f"{', '.join(f'{k} {v:.2f}' for k, v in breakdown.items())} |")
print("\nMFU against the GEMM rate each run measured on this device: "
      + ", ".join(f"{k} {v}" for k, v in rates.items()))
PY
# The device returns at most 8 files: the run folders, logs and memory traces in one archive.
tar -C "$OUT" -czf "$OUT/runs.tgz" runs $(cd "$OUT" && ls *.log *.mem 2>/dev/null) \
  && rm -rf "$RUNS" "$OUT"/*.log "$OUT"/*.mem

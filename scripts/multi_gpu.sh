#!/usr/bin/env bash
# Multi-GPU acceptance on a 2-GPU H200 host (issue 14), about 8 minutes in all:
#   tp16k / tp64k  V4.1-Flash with TP=2 + EP=2 (torchrun, NCCL): eager and PIECEWISE, reference and
#                  replay ms, speedup, MFU per GPU; E5 and TP.one_rank (vs the one-rank model) at 16K
#   dp             V4.1-Flash with DP=2, a mixed batch per rank (rank 0 trims, rank 1 does not):
#                  each rank's route under the agreement, DP.route / DP.alone / DP.graph
#   sweep          graph-modes.yaml as a sharded sweep on 2 GPUs (--gpus 2) vs on one (wall times)
# Usage with the device tool (kind nvidia-h200-x2, carry [".whl"]; ../shared/device/prep.sh fills
# .whl once):  bash scripts/multi_gpu.sh [all|tp16k|tp64k|dp|sweep]
# Logs, run folders and the table (printed last) go under $OUT.
set -uo pipefail
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1 OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; RUNS=$OUT/runs; mkdir -p "$RUNS"
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

torchrun2() {  # name, time limit (s), scenario, extra args...
  local name=$1 limit=$2 start=$SECONDS rc; shift 2
  timeout "$limit" python3 -m torch.distributed.run --nproc-per-node 2 \
    -m swa_bench.run.parallel "$@" --out "$RUNS/$name" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "$name: rc=$rc in $((SECONDS - start)) s" | tee -a "$OUT/cases.txt"
  [ "$rc" -eq 0 ] || tail -8 "$OUT/$name.log"
}

sweep() {  # gpus, time limit (s)
  local gpus=$1 limit=$2 start=$SECONDS rc
  timeout "$limit" python3 -m swa_bench run graph-modes --gpus "$gpus" --out "$RUNS/sweep-$gpus" \
    > "$OUT/sweep-$gpus.log" 2>&1
  rc=$?
  echo "sweep graph-modes on $gpus GPU(s): rc=$rc wall $((SECONDS - start)) s" \
    | tee -a "$OUT/cases.txt" "$OUT/sweep.txt"
  [ "$rc" -eq 0 ] || tail -8 "$OUT/sweep-$gpus.log"
}

what=${1:-all}
case "$what" in all|tp16k) torchrun2 tp-16k 170 scenarios/v41-flash-tp2.yaml --select T=16384 ;; esac
case "$what" in all|tp64k) torchrun2 tp-64k 170 scenarios/v41-flash-tp2.yaml --select T=65536 ;; esac
case "$what" in all|dp) torchrun2 dp 150 scenarios/v41-flash-dp2.yaml ;; esac
case "$what" in all|sweep) sweep 2 90; sweep 1 120 ;; esac

echo; echo "== per-rank table (from each torchrun log) =="
for name in tp-16k tp-64k dp; do
  [ -f "$OUT/$name.log" ] || continue
  echo "-- $name"; sed -n '/^case /,/^results:/p' "$OUT/$name.log" | grep -v '^results:'
done
[ -f "$OUT/sweep.txt" ] && { echo "-- sharded sweep"; cat "$OUT/sweep.txt"; }

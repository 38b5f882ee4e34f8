#!/usr/bin/env bash
# scenarios/v41-flash-prompt.yaml on one H200 (issue 30): whole prompts in chunks on V4.1-Flash,
# TTFT per policy and the approximation after the last chunk. The whole scenario takes ~13
# minutes and a device call at most 10, so one call runs one prompt length, into its own run
# folder: `bash scripts/prompt_gpu.sh 65536` (5.5 min), `bash scripts/prompt_gpu.sh 131072` (7.5).
set -uo pipefail
length=${1:?usage: prompt_gpu.sh PROMPT_LENGTH}
source "$(dirname "$0")/gpu_env.sh"
timeout 570 python3 -m swa_bench run scenarios/v41-flash-prompt.yaml --out "$OUT/v41-flash-prompt" \
  --select "T=$length/" > "$OUT/prompt-$length.log" 2>&1
echo "prompt run T=$length: rc=$?"
tail -40 "$OUT/prompt-$length.log"

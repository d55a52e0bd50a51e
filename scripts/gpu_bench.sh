#!/usr/bin/env bash
# Device call(s) for scripts/bench_step.py at Qwen3-8B shape: METHODS=none,dflash then METHODS=ddtree (one
# engine each; a call holds at most 10 minutes). Results accumulate in $OUT/step.json via /tmp/step.json.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
timeout "${BENCH_S:-570}" python scripts/bench_step.py --methods "${METHODS:-none,dflash,ddtree}" \
  --out /tmp/step.json > "$OUT/step_${METHODS//,/_}.log" 2>&1
echo "bench rc=$?"; cp /tmp/step.json /tmp/step.profile*.json "$OUT/" 2>/dev/null
grep -a "engine init\|ms/step\|Error\|error" "$OUT/step_${METHODS//,/_}.log" | tail -12
tail -12 "$OUT/step_${METHODS//,/_}.log"

#!/usr/bin/env bash
# Device call after the bundle and .gpu/data, .gpu/g1..gM are staged: per-step cost of DDTree on the default pair
# (SmolLM2-135M-Instruct bf16 + the shipped drafter) against no speculation, vLLM's chain on its default runner
# (`dflash`, Model Runner V2) and the chain on DDTree's V1 runner (`dflash-v1`); host and GPU ms per DDTree phase
# (VLLM_DDTREE_PROFILE), torch-profiler and cProfile tables for batch 1 and 16. Results in $OUT/step*. METHODS, BATCHES, BUDGET
# (DDTree's B, default 15; the chain drafts 15), DRAFTER and PROFILE_S (the time bound) narrow a call.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
export PYTHONPATH="/tmp/pkgs:$PYTHONPATH"
[ -d /tmp/smollm2 ] || python scripts/convert_smollm2.py --out /tmp/smollm2 > "$OUT/convert.log" 2>&1
timeout "${PROFILE_S:-560}" python scripts/bench_step.py --target /tmp/smollm2 \
  --drafter "${DRAFTER:-$SHIPPED_DRAFTER}" --methods "${METHODS:-ddtree,dflash-v1,dflash,none}" \
  --batches "${BATCHES:-1,16}" --budget "${BUDGET:-15}" --chain-tokens 15 --prompt-len 256 --steps 32 --repeats 2 --torch-profile --python-profile --sync-report \
  --out /tmp/step/step.json > "$OUT/step.log" 2>&1
echo "bench_step rc=$?"
tar -C /tmp/step -czf "$OUT/step.tgz" .  # at most 8 files come back: one archive
grep -a "engine init\|ms/step\|per phase\|Python own\|Error" "$OUT/step.log" | tail -24

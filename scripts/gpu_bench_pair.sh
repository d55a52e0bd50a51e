#!/usr/bin/env bash
# Device call(s) after scripts/gpu_train.sh on the same warm machine: scripts/benchmark.py on the default pair
# (SmolLM2-135M-Instruct bf16 + the drafter just trained), held-out prompts, answers end at EOS (at most 256 tokens),
# CUDA graphs on. METHODS limits one call to some methods; results accumulate in /tmp/pair-bench (--resume).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
export PYTHONPATH="/tmp/pkgs:$PYTHONPATH"
drafter=${DRAFTER:-/tmp/smollm2-dflash/drafter}
timeout "${BENCH_S:-540}" python scripts/benchmark.py --target /tmp/smollm2 --drafter "$drafter" \
  --budgets 8 16 32 64 128 --batch-sizes 1 4 16 64 --temperatures 0 1 --max-tokens 256 --stop-at-eos \
  --min-prompts 16 --out /tmp/pair-bench --resume ${METHODS:+--methods $METHODS} > "$OUT/bench_pair.log" 2>&1
echo "bench rc=$?"
cp /tmp/pair-bench/* "$OUT/" 2>/dev/null
grep -a "Error\|error" "$OUT/bench_pair.log" | grep -v "Warning" | tail -5
cat /tmp/pair-bench/table.md 2>/dev/null

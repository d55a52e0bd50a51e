#!/usr/bin/env bash
# Device call(s) once the bundle and .gpu/data, .gpu/g1..gM are staged: scripts/benchmark.py on the default pair
# (SmolLM2-135M-Instruct bf16 + the shipped drafter, or DRAFTER), held-out prompts, answers end at EOS (at most 256 tokens),
# CUDA graphs on. METHODS limits one call to some methods (SCHEDULES="1-2:64,3-64:16 ..." adds DDTree budgets per
# batch size, run as methods ddtree-<schedule>); results accumulate in PAIR_DIR (--resume; default
# /tmp/pair-bench: a run under other settings, e.g. VLLM_DDTREE_BACKEND_ROWS=1, takes a folder of its own).
# benchmark.py writes its results after every method straight into $OUT/pair (a call cut by its time limit still
# brings back what it measured: session 13 lost a whole call's rows to a copy that came after the limit).
# EAGER=1: no CUDA graphs or torch.compile (engines start in seconds): for acceptance lengths, not for speed.
# ROW_S (default 3): a row's prompts run again until this many seconds have passed (benchmark.py --min-row-seconds).
# TEMPS (default "0 1"): the sampling temperatures.
# BUDGETS (default "8 16 32 64 128"): the ddtree-B<n> methods METHODS picks from (ddtree-B15-chaintree: BUDGETS=15).
# ROUNDS=N: every method's engine starts first, then each row runs for all methods in turn, N times (benchmark.py
# --interleave; GPU memory split between the engines): ratios taken within a round (table.md) do not depend on how
# fast the host ran while one engine lived (session 22: 2x between two engines of one call). CPUS="0-7" runs the
# benchmark and its engines on those cores only (benchmark.py --cpus). PROMPTS_PER_BATCH=4: a row runs 4 x batch
# prompts, so batches 16 and 64 stay full instead of draining from the start (default 1, as sessions <= 30 ran).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
export PYTHONPATH="/tmp/pkgs:$PYTHONPATH"
started=$SECONDS  # BENCH_S bounds the whole call: the conversion below (~20 s on a fresh machine) counts too
[ -d /tmp/smollm2 ] || python scripts/convert_smollm2.py --out /tmp/smollm2 > "$OUT/convert.log" 2>&1
drafter=${DRAFTER:-$SHIPPED_DRAFTER}
pair=${PAIR_DIR:-/tmp/pair-bench}
mkdir -p "$pair" "$OUT/pair" && cp "$pair"/* "$OUT/pair/" 2>/dev/null
timeout "$(( ${BENCH_S:-540} - (SECONDS - started) ))" python scripts/benchmark.py --target /tmp/smollm2 --drafter "$drafter" \
  --budgets ${BUDGETS:-8 16 32 64 128} --batch-sizes ${BATCHES:-1 4 16 64} --temperatures ${TEMPS:-0 1} --max-tokens 256 --stop-at-eos \
  --min-prompts 16 --prompts-per-batch "${PROMPTS_PER_BATCH:-1}" --min-row-seconds "${ROW_S:-3}" --out "$OUT/pair" --resume ${SCHEDULES:+--schedules $SCHEDULES} ${METHODS:+--methods $METHODS} \
  ${EAGER:+--eager} ${ROUNDS:+--interleave $ROUNDS --gpu-memory-utilization 0.8} ${CPUS:+--cpus $CPUS} \
  > "$OUT/bench_pair.log" 2>&1
echo "bench rc=$?"
cp "$OUT"/pair/* "$pair"/ 2>/dev/null
grep -a "Error\|error" "$OUT/bench_pair.log" | grep -v "Warning" | tail -5
cat "$OUT/pair/table.md" 2>/dev/null

#!/usr/bin/env bash
# Device call once the bundle is staged (no data needed): scripts/benchmark.py at Qwen3-8B shape with dummy weights
# (configs/qwen3-8b-shape + its DFlash drafter shape), CUDA graphs on, methods interleaved round by round. Random
# weights accept ~0 drafts, so every step is one draft + one verification: tok/s compares what a step costs at 8B
# scale, not a speedup. METHODS (default "none dflash ddtree-B15 ddtree-B32"), BATCHES (default "1 4 16 64"),
# ROUNDS (default 2), MAX_TOKENS (default 64), BENCH_S (the time bound, default 570). CAPTURE: the CUDA-graph sizes,
# by default the measured batches' uniform steps (r x 1, r x 16, r x 33 tokens) and powers of two: ~80 sizes an engine
# (benchmark.py's default) would not start four 8B engines inside one call.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
export PYTHONPATH="/tmp/pkgs:$PYTHONPATH"  # the prompt packages staged by gpu_stage_data.sh
mkdir -p "$OUT/bench8b"
timeout "${BENCH_S:-570}" python scripts/benchmark.py --target configs/qwen3-8b-shape --drafter configs/qwen3-8b-shape-dflash \
  --load-format dummy --budgets 15 32 --methods ${METHODS:-none dflash ddtree-B15 ddtree-B32} \
  --batch-sizes ${BATCHES:-1 4 16 64} --temperatures 0 1 --max-tokens "${MAX_TOKENS:-64}" --max-model-len 512 \
  --min-prompts 4 --cudagraph-capture-sizes ${CAPTURE:-1 2 4 8 16 32 33 64 128 132 256 512 528 1024 2048 2112} \
  --interleave "${ROUNDS:-2}" --gpu-memory-utilization 0.85 --out "$OUT/bench8b" \
  > "$OUT/bench8b.log" 2>&1
echo "bench rc=$?"
grep -a "Error\|error" "$OUT/bench8b.log" | grep -v "Warning" | tail -5
cat "$OUT/bench8b/table.md" 2>/dev/null

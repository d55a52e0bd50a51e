#!/usr/bin/env bash
# One device call (H200, bundle staged under /tmp/site): install the plugin, an end-to-end smoke test, the kernel
# tests against the reference, and the kernel benchmarks. Logs and JSON go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,memory.used --format=csv | tee "$OUT/gpu.txt"
timeout "${SMOKE_S:-210}" python scripts/gpu_smoke.py --out "$OUT/smoke.json" > "$OUT/smoke.log" 2>&1
echo "smoke rc=$?"; grep -a "SMOKE\|Error\|error" "$OUT/smoke.log" | head -20
timeout "${KERNELS_S:-190}" python -m pytest tests/gpu -q -p no:cacheprovider -x > "$OUT/kernels.log" 2>&1
echo "kernel tests rc=$?"; tail -4 "$OUT/kernels.log"
timeout "${BENCH_S:-150}" python scripts/bench_attention.py --out "$OUT/attn.json" > "$OUT/attn.log" 2>&1
echo "bench rc=$?"; tail -14 "$OUT/attn.log"

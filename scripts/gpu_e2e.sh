#!/usr/bin/env bash
# One device call after scripts/gpu_check.sh: the greedy-identity sweep (float32, tiny models) in eager mode, a
# subset with CUDA graphs, and the bf16 divergence check. Logs and JSON go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
T=tests/e2e/test_greedy_identity.py::test_greedy_identical_to_no_speculation
DDTREE_E2E_EAGER=1 timeout "${EAGER_S:-330}" python -m pytest tests/e2e/test_greedy_identity.py -v -p no:cacheprovider \
  > "$OUT/e2e_eager.log" 2>&1
echo "eager sweep rc=$?"; grep -a "passed\|failed\|PASSED\|FAILED\|Error" "$OUT/e2e_eager.log" | tail -12
timeout "${GRAPHS_S:-160}" python -m pytest "$T[15-16]" "$T[64-4]" -v -p no:cacheprovider > "$OUT/e2e_graphs.log" 2>&1
echo "graphs rc=$?"; grep -a "passed\|failed\|FAILED\|Error" "$OUT/e2e_graphs.log" | tail -6
grep -a "cudagraph_mode\|V1 model runner" "$OUT/e2e_graphs.log" | head -3
timeout "${BF16_S:-90}" python scripts/bf16_divergence.py --out "$OUT/bf16.json" > "$OUT/bf16.log" 2>&1
echo "bf16 rc=$?"; grep -a "BF16" "$OUT/bf16.log"

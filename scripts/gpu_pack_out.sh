#!/usr/bin/env bash
# Device call helper: a call brings back at most 8 files from $OUT (session 31 lost bench_step.py's JSON and log that
# way), so pack everything under $OUT into one $OUT/out.tar.gz. End a call's command with `; bash scripts/gpu_pack_out.sh`,
# then here: `tar -xzf <files_at>/out.tar.gz -C docs/results/session-N/<call>/`.
set -euo pipefail
: "${OUT:?set OUT to the device call output folder}"
packed=$(mktemp /tmp/out.XXXXXX.tar.gz)
tar -C "$OUT" -czf "$packed" .
find "$OUT" -mindepth 1 -delete
mv "$packed" "$OUT/out.tar.gz"
count=$(tar -tzf "$OUT/out.tar.gz" | grep -vc "/\$" || true)
echo "packed $count files into OUT/out.tar.gz ($(du -h "$OUT/out.tar.gz" | cut -f1))"

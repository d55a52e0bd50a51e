#!/usr/bin/env bash
# Device call, at the end of a session's calls: the JIT caches the machine filled (FlashInfer and Triton kernels,
# vLLM's, CUDA's compute cache) as $OUT/jitcache.tar.xz.part*. A fresh machine's first vLLM engine spent ~100 s
# filling them (sessions 46 and 47: init 119 s and 102 s, 3 s for every later engine). Here,
# `bash scripts/gpu_bank.sh FILES_AT` keeps the archive in .gpu/jitcache/ and docs/results/bank/ (commit it); a later
# session carries .gpu/jitcache with a staging call, where scripts/gpu_stage_data.sh unpacks it into $HOME before
# the first engine starts.
# A call brings back at most 8 files: run this in a call of its own (a few seconds) or one with files to spare.
set -uo pipefail
dirs=()
for d in .cache/flashinfer .triton .cache/vllm .nv/ComputeCache; do
  [ -d "$HOME/$d" ] && dirs+=("$d")
done
[ ${#dirs[@]} -gt 0 ] || { echo "no JIT caches in $HOME"; exit 0; }
(cd "$HOME" && du -sh "${dirs[@]}") | sed 's/^/cache: /'
tar -C "$HOME" -cf - "${dirs[@]}" | xz -T0 -6 -c | split -b 15M -d - "$OUT/jitcache.tar.xz.part"
ls -la "$OUT"/jitcache.tar.xz.part*

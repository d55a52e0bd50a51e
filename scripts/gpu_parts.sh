#!/usr/bin/env bash
# Here, before a GPU session: the vLLM bundle in four parts and the data in four folders, each small enough to
# travel in one device call together with the working tree (a call carries at most 64 MiB; the tree is ~19 MiB
# since the drafter ships in it, so ../shared/gpu/build_bundle.sh's 59 MiB parts no longer fit).
#   .gpu/p1-p4  vLLM 0.26.0 bundle, 43 MiB each (stage with `bash .gpu/pN/stage.sh`, the fourth unpacks)
#   .gpu/data   prompt packages and the gguf reader; .gpu/g1-g3 the SmolLM2 GGUF in thirds (scripts/gpu_data.py)
set -euo pipefail
cd "$(dirname "$0")/.."
../shared/gpu/build_bundle.sh > /dev/null
cache=${GPU_BUNDLE_CACHE:-$HOME/.cache/gpu-bundle}
rm -rf .gpu/p* .gpu/split && mkdir -p .gpu/split
split -b 43M -d "$cache/site.tar.xz" .gpu/split/part
n=0
for f in .gpu/split/part*; do
  n=$((n + 1)); mkdir -p ".gpu/p$n"; mv "$f" ".gpu/p$n/"; cp ../shared/gpu/stage.sh ".gpu/p$n/stage.sh"
done
rmdir .gpu/split
for i in $(seq 1 "$n"); do echo "$n" > ".gpu/p$i/COUNT"; done
python scripts/gpu_data.py
du -sh .gpu/*

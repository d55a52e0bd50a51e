#!/usr/bin/env bash
# Here, before a GPU session: a working tree without the shipped drafter's weights (31.6 of its ~45 MB) makes the
# staging parts ~3x larger, so the vLLM bundle and the data go in ~8 device calls instead of ~17 (each call carries
# at most 64 MiB with the tree; a machine left idle for 30 s between calls is lost, and with it all the staging).
#   bash scripts/gpu_lean_tree.sh hide     # weights and bank to $GPU_HOLD, scripts/gpu_parts.sh, .gpu/drafter
#   bash scripts/gpu_lean_tree.sh restore  # weights back (before any commit: until then git sees them deleted)
# On the device, `bash scripts/gpu_stage_data.sh` with .gpu/drafter carried puts the drafter in /tmp/shipped-drafter;
# scripts/gpu_env.sh's SHIPPED_DRAFTER names whichever copy is there (the device scripts default to it).
set -euo pipefail
cd "$(dirname "$0")/.."
drafter=vllm_ddtree/drafters/smollm2-135m-instruct-dflash
bank=docs/results/bank  # committed archives of earlier device calls (scripts/gpu_bank.sh): answers, jitcache
hold=${GPU_HOLD:-$(cd .. && pwd)/gpu-hold}
case "${1:-}" in
  hide)
    if [ -f "$drafter/model.safetensors" ]; then
      mkdir -p "$hold" && mv "$drafter/model.safetensors" "$hold/"
    fi
    [ -f "$hold/model.safetensors" ] || { echo "no drafter weights in $drafter or $hold"; exit 1; }
    # The banked archives travel only when a call carries .gpu/<name> (gpu_parts.sh sizes the parts without them)
    for name in answers jitcache; do
      [ -f "$bank/$name.tar.xz" ] && mv "$bank/$name.tar.xz" "$hold/"
    done
    bash scripts/gpu_parts.sh
    for name in answers jitcache; do
      if [ -f "$hold/$name.tar.xz" ] && [ ! -f ".gpu/$name/$name.tar.xz" ]; then
        mkdir -p ".gpu/$name" && cp "$hold/$name.tar.xz" ".gpu/$name/" && echo "banked $name in .gpu/$name"
      fi
    done
    mkdir -p .gpu/drafter
    tar -C "$drafter" -cf .gpu/drafter/drafter.tar --exclude=model.safetensors .
    tar -C "$hold" -rf .gpu/drafter/drafter.tar ./model.safetensors
    du -sh .gpu/drafter
    echo "weights held in $hold: 'bash scripts/gpu_lean_tree.sh restore' puts them back"
    ;;
  restore)
    [ -f "$hold/model.safetensors" ] && mv "$hold/model.safetensors" "$drafter/"
    for name in answers jitcache; do
      [ -f "$hold/$name.tar.xz" ] && mv "$hold/$name.tar.xz" "$bank/"
    done
    git diff --quiet -- "$drafter" || { echo "$drafter differs from git: check before committing"; exit 1; }
    git status --short -- "$bank"  # archives banked during the session: commit them
    echo "drafter weights back in $drafter"
    ;;
  *)
    echo "usage: $0 hide|restore"; exit 2
    ;;
esac

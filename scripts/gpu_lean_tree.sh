#!/usr/bin/env bash
# Here, before a GPU session: a working tree without the shipped drafter's weights (31.6 of its ~45 MB) makes the
# staging parts ~3x larger, so the vLLM bundle and the data go in ~8 device calls instead of ~17 (each call carries
# at most 64 MiB with the tree; a machine left idle for 30 s between calls is lost, and with it all the staging).
#   bash scripts/gpu_lean_tree.sh hide     # weights and answers to $GPU_HOLD, scripts/gpu_parts.sh, .gpu/drafter
#   bash scripts/gpu_lean_tree.sh restore  # weights back (before any commit: until then git sees them deleted)
# On the device, `bash scripts/gpu_stage_data.sh` with .gpu/drafter carried puts the drafter in /tmp/shipped-drafter;
# scripts/gpu_env.sh's SHIPPED_DRAFTER names whichever copy is there (the device scripts default to it).
set -euo pipefail
cd "$(dirname "$0")/.."
drafter=vllm_ddtree/drafters/smollm2-135m-instruct-dflash
answers=docs/results/answers/answers.tar.xz  # the target's banked answers (scripts/gpu_bank.sh), when committed
hold=${GPU_HOLD:-$(cd .. && pwd)/gpu-hold}
case "${1:-}" in
  hide)
    if [ -f "$drafter/model.safetensors" ]; then
      mkdir -p "$hold" && mv "$drafter/model.safetensors" "$hold/"
    fi
    [ -f "$hold/model.safetensors" ] || { echo "no drafter weights in $drafter or $hold"; exit 1; }
    # The committed answers (scripts/gpu_bank.sh) travel only when a call carries .gpu/answers
    [ -f "$answers" ] && mv "$answers" "$hold/"
    bash scripts/gpu_parts.sh
    if [ -f "$hold/answers.tar.xz" ] && [ ! -f .gpu/answers/answers.tar.xz ]; then
      mkdir -p .gpu/answers && cp "$hold/answers.tar.xz" .gpu/answers/ && echo "committed answers in .gpu/answers"
    fi
    bank=${GPU_BANK:-$(cd .. && pwd)/gpu-bank}  # JIT caches banked earlier in this session
    if [ -f "$bank/jitcache.tar.xz" ] && [ ! -f .gpu/jitcache/jitcache.tar.xz ]; then
      mkdir -p .gpu/jitcache && cp "$bank/jitcache.tar.xz" .gpu/jitcache/ && echo "banked jitcache from $bank in .gpu/jitcache"
    fi
    mkdir -p .gpu/drafter
    tar -C "$drafter" -cf .gpu/drafter/drafter.tar --exclude=model.safetensors .
    tar -C "$hold" -rf .gpu/drafter/drafter.tar ./model.safetensors
    du -sh .gpu/drafter
    echo "weights held in $hold: 'bash scripts/gpu_lean_tree.sh restore' puts them back"
    ;;
  restore)
    [ -f "$hold/model.safetensors" ] && mv "$hold/model.safetensors" "$drafter/"
    [ -f "$hold/answers.tar.xz" ] && mkdir -p "$(dirname "$answers")" && mv "$hold/answers.tar.xz" "$answers"
    git diff --quiet -- "$drafter" || { echo "$drafter differs from git: check before committing"; exit 1; }
    git status --short -- "$answers"  # new answers banked during the session: commit them
    echo "drafter weights back in $drafter"
    ;;
  *)
    echo "usage: $0 hide|restore"; exit 2
    ;;
esac

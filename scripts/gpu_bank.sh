#!/usr/bin/env bash
# Here, after a device call that brought back archives in parts: answers.tar.xz.part* (scripts/gpu_train.sh with
# SAVE_RESPONSES=1: the target's answers and the prompts it wrote) or jitcache.tar.xz.part* (scripts/gpu_pack_caches.sh).
# Each goes to .gpu/<name>/<name>.tar.xz, which a later call carries (answers: the training call, to skip answering
# them again; jitcache: a staging call), and to $GPU_BANK (default ../gpu-bank, outside the checkout), from which
# `scripts/gpu_lean_tree.sh hide` puts them back in a later session's .gpu/.
#   bash scripts/gpu_bank.sh /work/.device/N      # the call's files_at
set -euo pipefail
cd "$(dirname "$0")/.."
files_at=${1:?usage: $0 FILES_AT (the device call folder holding answers.tar.xz.part* or jitcache.tar.xz.part*)}
bank=${GPU_BANK:-$(cd .. && pwd)/gpu-bank}
banked=0
for name in answers jitcache; do
  ls "$files_at/$name".tar.xz.part* > /dev/null 2>&1 || continue
  mkdir -p ".gpu/$name" "$bank"
  cat "$files_at/$name".tar.xz.part* > ".gpu/$name/$name.tar.xz"
  xz -dc ".gpu/$name/$name.tar.xz" | tar -t | cut -d/ -f1-2 | sort -u | sed "s/^/banked $name: /"
  cp ".gpu/$name/$name.tar.xz" "$bank/"
  echo "$name in .gpu/$name and $bank ($(du -h "$bank/$name.tar.xz" | cut -f1))"
  banked=1
done
[ "$banked" = 1 ] || { echo "no answers.tar.xz.part* or jitcache.tar.xz.part* in $files_at"; exit 1; }

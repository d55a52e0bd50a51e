#!/usr/bin/env bash
# Here, after a device call that brought back archives in parts: answers.tar.xz.part* (scripts/gpu_train.sh with
# SAVE_RESPONSES=1: the target's answers and the prompts it wrote) or jitcache.tar.xz.part* (scripts/gpu_pack_caches.sh:
# the JIT caches a fresh machine's first engine spends ~100 s filling). Each goes to .gpu/<name>/<name>.tar.xz, which
# a later call carries (answers: the training call, to skip answering them again; jitcache: a staging call), and to
# docs/results/bank/ to be committed: only git outlives a session (session 48's fresh checkout had neither .gpu/ nor
# ../gpu-bank, where session 47 had banked 79k answers). While the tree is lean (scripts/gpu_lean_tree.sh hide: every
# call carries the tree, 64 MiB at most with what it carries) they wait in its hold, and `restore` puts them in place.
#   bash scripts/gpu_bank.sh /work/.device/N      # the call's files_at
set -euo pipefail
cd "$(dirname "$0")/.."
files_at=${1:?usage: $0 FILES_AT (the device call folder holding answers.tar.xz.part* or jitcache.tar.xz.part*)}
hold=${GPU_HOLD:-$(cd .. && pwd)/gpu-hold}
bank=docs/results/bank
banked=0
for name in answers jitcache; do
  ls "$files_at/$name".tar.xz.part* > /dev/null 2>&1 || continue
  mkdir -p ".gpu/$name"
  cat "$files_at/$name".tar.xz.part* > ".gpu/$name/$name.tar.xz"
  xz -dc ".gpu/$name/$name.tar.xz" | tar -t | cut -d/ -f1-2 | sort -u | sed "s/^/banked $name: /"
  if [ -f "$hold/model.safetensors" ]; then  # lean tree: the archive must not travel with every call
    cp ".gpu/$name/$name.tar.xz" "$hold/" && where="$hold (gpu_lean_tree.sh restore moves it to $bank: commit it)"
  else
    cp ".gpu/$name/$name.tar.xz" "$bank/" && where="$bank (commit it)"
  fi
  echo "$name ($(du -h ".gpu/$name/$name.tar.xz" | cut -f1)) in .gpu/$name and $where"
  banked=1
done
[ "$banked" = 1 ] || { echo "no answers.tar.xz.part* or jitcache.tar.xz.part* in $files_at"; exit 1; }

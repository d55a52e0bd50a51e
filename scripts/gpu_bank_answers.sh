#!/usr/bin/env bash
# Here, after a device call made with SAVE_RESPONSES=1 (scripts/gpu_train.sh): its answers.tar.xz.part* (the target's
# answers and the prompts it wrote) go to .gpu/answers/answers.tar.xz, which a later call carries to skip answering
# them again, and to $ANSWER_BANK (default ../answer-bank, outside the checkout), from which
# `scripts/gpu_lean_tree.sh hide` puts them back in a later session's .gpu/answers.
#   bash scripts/gpu_bank_answers.sh /work/.device/N      # the call's files_at
set -euo pipefail
cd "$(dirname "$0")/.."
files_at=${1:?usage: $0 FILES_AT (the device call folder holding answers.tar.xz.part*)}
bank=${ANSWER_BANK:-$(cd .. && pwd)/answer-bank}
ls "$files_at"/answers.tar.xz.part* > /dev/null
mkdir -p .gpu/answers "$bank"
cat "$files_at"/answers.tar.xz.part* > .gpu/answers/answers.tar.xz
xz -dc .gpu/answers/answers.tar.xz | tar -t | sed 's/^/banked: /'
cp .gpu/answers/answers.tar.xz "$bank/answers.tar.xz"
echo "answers in .gpu/answers and $bank ($(du -h "$bank/answers.tar.xz" | cut -f1)): carry .gpu/answers in the training call"

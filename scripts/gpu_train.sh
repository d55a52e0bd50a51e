#!/usr/bin/env bash
# Device call: convert SmolLM2-135M-Instruct (bf16) and train its DFlash drafter (block 16, 2 layers) with the
# command of docs/drafter.md; the result comes back as $OUT/drafter.tar.xz.part* (+ report, log).
# Defaults after the first run (3,000 prompts, HF generation: the drafter memorised its data, held-out acceptance
# 1.5): every training prompt (~16k) answered twice by vLLM (once greedy, once at T 0.7), 4 passes over them.
# Needs the bundle staged and scripts/gpu_stage_data.sh run with .gpu/data and .gpu/g1..gM carried.
# A rerun (same warm machine) resumes from the newest checkpoint. INIT_FROM=vllm_ddtree/drafters/smollm2-135m-instruct-dflash
# (or INIT_FROM=shipped, which also finds the copy staged from a lean tree: scripts/gpu_lean_tree.sh)
# starts from the shipped drafter's weights (more steps for the same device time; a new lr schedule); NUM_LAYERS above
# its layer count adds layers that start as the identity (DFlashDrafter.add_layers; the shipped drafter has 4 since
# session 20, set NUM_LAYERS=4 to continue it as it is). RESPONSES=1 keeps the greedy answers only
# (half the ~4.4 min of generation; session 17). TRAIN_S bounds the whole script (the conversion included): training
# stops FINAL_S (default 80; 105 until session 49, whose call used ~50) s before it (--time-limit-s, less 15 s to
# pack) and saves the drafter, a held-out point and the report (its line `after the time limit: N s`) as at its last step,
# so a call cut short still brings a drafter back. Generation past that limit stops between chunks of 4,096 answers
# and the script ends with train rc=3: the answers so far stay in /tmp/smollm2-dflash, and the same command on the
# same warm machine goes on from them (session 31: LATER_TURNS=1 EXTRA_ROUNDS=1 without carried answers needed more
# than one 600 s call for generation alone, and the call limit cut the first attempt with nothing saved). Answers
# complete but the limit already past: no feature store is built (session 45's T1 lost ~100 s to one), one step runs,
# a checkpoint is saved, and the same command again resumes from it.
# GEN_GRAPHS=1: the vLLM generator decodes from FULL CUDA graphs in waves of 1024 prompts (train_drafter.py
# --gen-cuda-graphs). Session 36: 25-34k tok/s against eager's 20-29k, so ~1.2x at most: the generator is bound by
# the host's work per request, not by the GPU (docs/benchmarks.md, "Session 36 on the H200").
# GEN_ENGINES=N: N generator engines answer side by side, each in its own process (train_drafter.py --gen-engines;
# new in session 36; sessions 37 and 45 on an H100): the host work spreads over N of the machine's 16 cores.
# SAVE_RESPONSES=1 brings the generated answers back; carried later as .gpu/answers they skip the generation.
# EXTRA_ROUNDS=N generates N more answers per prompt at T 0.7 after the carried ones (~2 min per round of 13.5k).
# LATER_TURNS=1 adds every later user turn of the training conversations as a prompt, answered once greedily after
# all other answers (~37k distinct turns, most within 256 prompt tokens): more distinct prompts than EXTRA_ROUNDS.
# SELF_PROMPTS=N: the target writes N user turns itself (sampled from its chat template's user opening; session 38),
# the usable ones answered once greedily after all other answers: distinct prompts beyond the packages' (~40 s per 10k
# with 4 engines, estimated; session 45: 122 s for 20,000 with 4 engines, 16,839 usable). SELF_PROMPTS_FROM=K writes
# samples K .. K + N - 1 instead (new prompts for a drafter trained on the first K).
# LR sets the peak learning rate (default 1e-3). From INIT_FROM, 1e-3 set the shipped drafter back: it ended its own
# training at a held-out loss of 3.18, and the run from it was at 3.71 after 250 steps (session 19, call 10; the
# held-out point at step 0 now shows where such a run starts). 2e-4 improved it (session 20: 3.13 -> 2.83 in 7,000 steps).
# The target's features are computed once per answer before training (FeatureStore, ~38 GiB for 27k answers); what
# does not fit the device beside a step (24 GiB headroom) stays in host memory (session 38; 75.8k answers are ~104 GiB);
# NO_FEATURE_STORE=1 runs the target at every step instead. SOFT_LABELS=K adds the target's top-K next tokens as soft
# labels (half the loss; session 26: worse). Session 20: ~21 steps/s with the store (4 layers).
# PROFILE_STEPS (default 10): that many steps after the first 20 run under torch.profiler; the kernels' table goes
# to train.log ("profile:" lines; not a file of its own: a call brings back at most 8): where a step's ~60 ms go.
# COMPILE=1: the step's drafter forward and loss run through torch.compile (train_drafter.py --compile).
set -uo pipefail
started=$SECONDS  # TRAIN_S bounds the whole script: conversion, generation, training and packing
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
export PYTHONPATH="/tmp/pkgs:$PYTHONPATH"
[ "${INIT_FROM:-}" = shipped ] && INIT_FROM=$SHIPPED_DRAFTER  # the repository's drafter or its staged copy (gpu_env.sh)
python scripts/convert_smollm2.py --out /tmp/smollm2 > "$OUT/convert.log" 2>&1 || { tail -20 "$OUT/convert.log"; exit 1; }
# Answers of an earlier session (SAVE_RESPONSES=1 below brought them back; kept here in .gpu/answers, carried): the
# ~4.4 min of generation are skipped. train_drafter.py reads them by position, so PROMPTS and RESPONSES must match.
mkdir -p /tmp/smollm2-dflash
touch /tmp/gpu_train.began  # a drafter newer than this is this call's (a resumed call finds the last one's)
rm -f /tmp/smollm2-dflash/report.json  # the last call's (a resumed call writes its own at the end)
if [ ! -f /tmp/smollm2-dflash/responses.jsonl ]; then
  if [ -f .gpu/answers/answers.tar.xz ]; then  # answers + self-prompts
    xz -dc .gpu/answers/answers.tar.xz | tar -x -C /tmp/smollm2-dflash
  elif [ -f .gpu/answers/responses.jsonl.xz ]; then  # sessions <= 45: answers only
    xz -dc .gpu/answers/responses.jsonl.xz > /tmp/smollm2-dflash/responses.jsonl
  fi
  if [ -f /tmp/smollm2-dflash/responses.jsonl ]; then
    echo "answers: $(wc -l < /tmp/smollm2-dflash/responses.jsonl) from .gpu/answers"
  fi
fi
# The loss's row kernel (vllm_ddtree/drafter/triton_cross_entropy.py, new in session 48) against its torch reference
# on this GPU first (a few seconds): a wrong kernel would train a wrong drafter, so on a failure the run uses the
# torch reference instead (VLLM_DDTREE_LOSS_KERNEL=torch: the same arithmetic, more memory traffic).
if ! timeout 120 python -m pytest tests/gpu/test_cross_entropy_kernel.py -q -p no:cacheprovider > /tmp/loss_kernel.log 2>&1; then
  echo "the training loss kernel failed its test; training with the torch reference:"; tail -30 /tmp/loss_kernel.log
  export VLLM_DDTREE_LOSS_KERNEL=torch
fi
resume=""; [ -d /tmp/smollm2-dflash/checkpoints ] && resume="--resume"
# ANNEAL=1 (default): the learning rate reaches its floor at the time limit (every device run so far stopped at
# 39-63% of its STEPS, at 34-70% of the peak rate). ANNEAL=0 for a call that a resuming call (same machine) follows.
anneal=""; [ "${ANNEAL:-1}" = 1 ] && anneal="--anneal-at-time-limit"
left=$(( ${TRAIN_S:-540} - (SECONDS - started) - 15 ))  # 15 s to pack the drafter
[ "$left" -ge 180 ] || { echo "TRAIN_S=${TRAIN_S:-540} leaves ${left} s after the conversion; give it >= 180 s more"; exit 1; }
timeout "$left" python scripts/train_drafter.py --target /tmp/smollm2 --out /tmp/smollm2-dflash \
  --block-size 16 --num-layers "${NUM_LAYERS:-2}" --num-prompts "${PROMPTS:-16000}" --generator "${GENERATOR:-vllm}" \
  --responses-per-prompt "${RESPONSES:-2}" --extra-answer-rounds "${EXTRA_ROUNDS:-0}" ${LATER_TURNS:+--later-turns} ${SELF_PROMPTS:+--self-prompts $SELF_PROMPTS} ${SELF_PROMPTS_FROM:+--self-prompts-from $SELF_PROMPTS_FROM} --greedy-first --temperature 0.7 \
  --gen-batch-size 256 --steps "${STEPS:-4000}" --lr "${LR:-1e-3}" --weight-decay 0.01 --eval-every 250 \
  --batch-size 32 --loss-decay 7 --save-every 250 --time-limit-s "$(( left - ${FINAL_S:-80} ))" ${GEN_GRAPHS:+--gen-cuda-graphs} ${GEN_ENGINES:+--gen-engines $GEN_ENGINES} $resume $anneal --profile-steps "${PROFILE_STEPS:-10}" ${COMPILE:+--compile} ${NO_FEATURE_STORE:+--no-feature-store} ${SOFT_LABELS:+--soft-labels $SOFT_LABELS} ${INIT_FROM:+--init-from "$INIT_FROM"} 2>&1 | tr '\r' '\n' | grep --line-buffered -v "^\s*$" | awk 'NR % 20 == 1 || /Error|error|warning|report|acceptance|heldout|generated|ready|self_prompts|time limit|stopped|feature store|profile|{/ {print; fflush()}' \
  > "$OUT/train.log"
echo "train rc=${PIPESTATUS[0]}"; tail -5 "$OUT/train.log"
# The drafter comes back if this call saved one, even if the time bound cut the report after it (the simulated
# acceptance runs last).
if [ -n "$(find /tmp/smollm2-dflash/drafter -name model.safetensors -newer /tmp/gpu_train.began 2>/dev/null)" ]; then
  cp /tmp/smollm2-dflash/report.json /tmp/smollm2-dflash/train_config.json "$OUT/" 2>/dev/null
  tar -C /tmp/smollm2-dflash -cJf - drafter | split -b 15M -d - "$OUT/drafter.tar.xz.part"
  ls -la "$OUT"
fi
# SAVE_RESPONSES=1: the answers come back too, with the prompts the target wrote (self_prompts*.jsonl: the answers'
# plan depends on them) and the held-out prompts' answers (eval_responses.jsonl: 35 s of every call in session 49), as answers.tar.xz.part* (~13 MB for 79k answers; a call returns at most 8 files). Here:
# `bash scripts/gpu_bank.sh <files_at>` keeps them in .gpu/answers/ and in docs/results/bank/ to commit (a later
# session's fresh checkout has only what git has). A later T1 carrying .gpu/answers answers only the
# prompts past the banked ones, e.g. SELF_PROMPTS=40000 with the same SELF_PROMPTS_FROM writes and answers 20,000 more.
if [ "${SAVE_RESPONSES:-0}" = 1 ] && [ -f /tmp/smollm2-dflash/responses.jsonl ]; then
  (cd /tmp/smollm2-dflash && ls responses.jsonl self_prompts*.jsonl eval_responses.jsonl 2>/dev/null | tar -cf - -T - | xz -T0 -6 -c) \
    | split -b 15M -d - "$OUT/answers.tar.xz.part"
  ls -la "$OUT"/answers.tar.xz.part*
fi
# The JIT and compile caches a fresh machine fills (its first vLLM engine took ~2 min to start in session 46)
du -sh ~/.cache/vllm ~/.cache/flashinfer ~/.triton ~/.cache/torch ~/.nv/ComputeCache 2>/dev/null | sed 's/^/cache: /'


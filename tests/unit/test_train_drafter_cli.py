"""scripts/train_drafter.py's flags, as scripts/gpu_train.sh passes them (session 49's T1 and T2), reach TrainConfig."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_train_sh_flags_parse_into_the_config():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from train_drafter import parse_args
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    argv = ("--target /tmp/smollm2 --out /tmp/smollm2-dflash --block-size 16 --num-layers 4 --num-prompts 16000 "
            "--generator vllm --responses-per-prompt 2 --extra-answer-rounds 0 --later-turns --self-prompts 20000 "
            "--self-prompts-from 40000 --greedy-first --temperature 0.7 --gen-batch-size 256 --steps 8000 --lr 1e-4 "
            "--weight-decay 0.01 --eval-every 250 --batch-size 32 --loss-decay 7 --save-every 250 --time-limit-s 455 "
            "--gen-engines 4 --resume --anneal-at-time-limit --profile-steps 10 --init-from /tmp/shipped-drafter").split()
    cfg = parse_args(argv)
    assert (cfg.num_layers, cfg.num_prompts, cfg.generator, cfg.gen_engines) == (4, 16000, "vllm", 4)
    assert (cfg.self_prompts, cfg.self_prompts_from, cfg.later_turns, cfg.greedy_first) == (20000, 40000, True, True)
    assert (cfg.steps, cfg.lr, cfg.time_limit_s, cfg.loss_decay) == (8000, 1e-4, 455.0, 7.0)
    assert cfg.anneal_at_time_limit and cfg.resume and cfg.profile_steps == 10 and not cfg.compile
    assert cfg.init_from == "/tmp/shipped-drafter" and cfg.feature_store
    assert not parse_args(argv[:4]).anneal_at_time_limit  # off unless asked for

#!/usr/bin/env python
"""Train a DFlash drafter for a Hugging Face target on the target's own responses (see docs/drafter.md).

    python scripts/train_drafter.py --target DIR --out OUT [--block-size 16] [--num-layers 1] [--steps 2000] ...
    python scripts/train_drafter.py --target DIR --out OUT --resume       # continue from OUT/checkpoints

The drafter lands in OUT/drafter; vLLM loads it with
    speculative_config={"method": "dflash", "model": "OUT/drafter", "num_speculative_tokens": BLOCK_SIZE - 1}
"""

import argparse
import sys
from dataclasses import fields
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_ddtree.drafter.data import SOURCES  # noqa: E402
from vllm_ddtree.drafter.train import TrainConfig, train  # noqa: E402


def parse_args(argv=None) -> TrainConfig:
    defaults = {f.name: f.default for f in fields(TrainConfig)}
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="Hugging Face folder of the target (Llama or Qwen3)")
    p.add_argument("--out", required=True, help="output folder (responses.jsonl, checkpoints/, drafter/)")
    p.add_argument("--block-size", type=int, default=defaults["block_size"])
    p.add_argument("--num-layers", type=int, default=defaults["num_layers"], help="drafter decoder layers")
    p.add_argument("--target-layer-ids", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="comma-separated target layers whose outputs feed the drafter (default: spread)")
    p.add_argument("--mask-token-id", type=int, default=None)
    p.add_argument("--sources", type=lambda s: tuple(s.split(",")), default=defaults["sources"],
                   help=f"comma-separated prompt sources among {','.join(SOURCES)}")
    p.add_argument("--num-prompts", type=int, default=defaults["num_prompts"])
    p.add_argument("--max-prompt-len", type=int, default=defaults["max_prompt_len"])
    p.add_argument("--max-new-tokens", type=int, default=defaults["max_new_tokens"])
    p.add_argument("--temperature", type=float, default=defaults["temperature"], help="of the responses; 0 = greedy")
    p.add_argument("--responses-per-prompt", type=int, default=defaults["responses_per_prompt"],
                   help="answers per prompt (> 1 needs --temperature > 0)")
    p.add_argument("--extra-answer-rounds", type=int, default=defaults["extra_answer_rounds"],
                   help="more answers at --temperature, one per prompt per round, after the first ones (answers "
                        "already in OUT/responses.jsonl keep their places)")
    p.add_argument("--later-turns", action="store_true",
                   help="more prompts: every later user turn of the training conversations (~37k distinct), "
                        "answered once (greedy with --greedy-first) after all other answers")
    p.add_argument("--self-prompts", type=int, default=0, metavar="N",
                   help="more prompts still: N user turns sampled from the target itself (the Magpie recipe), the "
                        "usable ones answered once after all other answers (--generator vllm)")
    p.add_argument("--self-prompts-from", type=int, default=0, metavar="K",
                   help="the first self-written prompt's index: samples K .. K + N - 1 (a later session's new "
                        "prompts: K past the samples an earlier drafter was trained on)")
    p.add_argument("--greedy-first", action="store_true",
                   help="the first answer of each prompt greedy, the others sampled at --temperature (vllm generator)")
    p.add_argument("--gen-batch-size", type=int, default=defaults["gen_batch_size"])
    p.add_argument("--generator", choices=("hf", "vllm"), default=defaults["generator"])
    p.add_argument("--gen-cuda-graphs", action="store_true",
                   help="vllm generator on a GPU: decode steps from FULL CUDA graphs (no torch.compile), prompts in "
                        "waves of 1024; default eager")
    p.add_argument("--gen-engines", type=int, default=defaults["gen_engines"],
                   help="vllm generator: this many engines answer side by side, each in its own process with an "
                        "equal share of 0.4 of the GPU memory (one engine is host-bound: ~30k tok/s for SmolLM2 on "
                        "the H200)")
    p.add_argument("--no-chat-template", dest="chat_template", action="store_false")
    p.add_argument("--steps", type=int, default=defaults["steps"])
    p.add_argument("--batch-size", type=int, default=defaults["batch_size"], help="sequences per step")
    p.add_argument("--anchors-per-seq", type=int, default=defaults["anchors_per_seq"])
    p.add_argument("--lr", type=float, default=defaults["lr"])
    p.add_argument("--warmup-steps", type=int, default=defaults["warmup_steps"])
    p.add_argument("--weight-decay", type=float, default=defaults["weight_decay"])
    p.add_argument("--loss-decay", type=float, default=None, help="gamma: offset k weighs exp(-(k-1)/gamma)")
    p.add_argument("--save-every", type=int, default=defaults["save_every"])
    p.add_argument("--eval-every", type=int, default=defaults["eval_every"],
                   help="held-out loss and first-offset accuracy every N steps (0: never)")
    p.add_argument("--eval-prompts", type=int, default=defaults["eval_prompts"], help="held-out prompts per source")
    p.add_argument("--seed", type=int, default=defaults["seed"])
    p.add_argument("--device", default=defaults["device"], help="auto (cuda if available), cuda or cpu")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default=defaults["dtype"])
    p.add_argument("--save-dtype", choices=("bfloat16", "float32"), default=defaults["save_dtype"],
                   help="dtype of the final drafter's weights")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in OUT")
    p.add_argument("--time-limit-s", type=float, default=None,
                   help="stop training this many seconds after the start (generation included), then save and "
                        "report as at the last step")
    p.add_argument("--anneal-at-time-limit", action="store_true",
                   help="with --time-limit-s: the learning rate's cosine also follows the clock and reaches its floor "
                        "at the time limit (a run the limit ends is annealed, not stopped at a high learning rate)")
    p.add_argument("--init-from", default=None,
                   help="a saved drafter folder to start from (its architecture is kept; a new schedule and optimizer)")
    p.add_argument("--soft-labels", type=int, default=defaults["soft_labels"],
                   help="also train against the target's K most probable next tokens per position (0: hard labels only)")
    p.add_argument("--soft-weight", type=float, default=defaults["soft_weight"],
                   help="weight of the soft-label cross-entropy (the hard label's is 1 - W)")
    p.add_argument("--profile-steps", type=int, default=defaults["profile_steps"],
                   help="profile this many training steps (after a warm-up) with torch.profiler: OUT/profile.txt")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the training step's drafter forward and loss (dynamic shapes; the first step "
                        "compiles: over 2 min on an H100, session 47)")
    p.add_argument("--no-feature-store", dest="feature_store", action="store_false",
                   help="run the target at every step instead of once per answer before training (FeatureStore)")
    args = vars(p.parse_args(argv))
    threads = args.pop("threads")
    if threads:
        import torch

        torch.set_num_threads(threads)
    return TrainConfig(**args)


def main(argv=None) -> None:
    from vllm_ddtree.drafter.train import AnswersIncomplete

    try:
        print(train(parse_args(argv)))
    except AnswersIncomplete as stopped:
        print(f"stopped: {stopped}", flush=True)
        raise SystemExit(3) from None


if __name__ == "__main__":
    main()

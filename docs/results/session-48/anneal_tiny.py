"""Session 48, CPU: does annealing at the time limit help a run its time limit ends? The tiny pair's target
(tests/fixtures/tiny_pair), its drafter trained the way scripts/make_tiny_pair.py trains it but with a time limit
that ends the run long before its `steps`, once by steps alone (the learning rate still high at the stop, as in
every device run) and once with anneal_at_time_limit; then the same from the committed tiny drafter (init_from,
as the device runs continue the shipped drafter). Held-out loss / first-offset accuracy and simulated acceptance
from each run's report.json.

    python docs/results/session-48/anneal_tiny.py --train-s 150 --out /tmp/anneal
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--train-s", type=float, default=150.0, help="time limit of each run (generation excluded)")
    p.add_argument("--steps", type=int, default=20000, help="the schedule's steps (more than the limit allows)")
    p.add_argument("--out", default="/tmp/anneal")
    args = p.parse_args()
    import torch
    from transformers import AutoTokenizer

    from make_tiny_pair import BLOCK_SIZE, MASK, make_prompts
    from vllm_ddtree.drafter.train import TrainConfig, train

    torch.set_num_threads(1)
    pair = ROOT / "tests/fixtures/tiny_pair"
    tokenizer = AutoTokenizer.from_pretrained(pair / "target")
    train_ids = [tokenizer(t)["input_ids"] for t in make_prompts(seed=1, n=2000)]
    eval_ids = [tokenizer(t)["input_ids"] for t in make_prompts(seed=2, n=32)]
    out = Path(args.out)
    answers = out / "answers"
    base = dict(target=str(pair / "target"), block_size=BLOCK_SIZE, num_layers=1, target_layer_ids=[0, 1],
                mask_token_id=MASK, max_new_tokens=96, batch_size=16, anchors_per_seq=24, warmup_steps=50,
                save_every=0, eval_every=100, eval_prompts=32, device="cpu", dtype="float32", gen_batch_size=128)
    if not (answers / "responses.jsonl").exists():  # the target's answers, once
        train(TrainConfig(**base, out=str(answers), steps=0, lr=3e-3), prompt_ids=train_ids, eval_prompt_ids=eval_ids)
    rows = []
    for start, lr in (("random", 3e-3), ("tiny drafter", 3e-4)):
        for anneal in (False, True):
            run = out / f"{start.replace(' ', '-')}-{'anneal' if anneal else 'steps'}"
            run.mkdir(parents=True, exist_ok=True)
            shutil.copy(answers / "responses.jsonl", run / "responses.jsonl")
            cfg = TrainConfig(**base, out=str(run), steps=args.steps, lr=lr, anneal_at_time_limit=anneal,
                              time_limit_s=args.train_s, init_from=None if start == "random" else str(pair / "drafter"))
            train(cfg, prompt_ids=train_ids, eval_prompt_ids=eval_ids)
            report = json.loads((run / "report.json").read_text())
            last = report["heldout_curve"][-1]
            rows.append(dict(start=start, schedule="anneal at the limit" if anneal else "by steps", steps=report["steps"],
                             final_lr=report["final_lr"], heldout_loss=last["heldout_loss"],
                             heldout_acc1=last["heldout_acc1"], simulated_acceptance=report["simulated_acceptance_length"],
                             first_heldout=report["heldout_curve"][0]))
            print(json.dumps(rows[-1]), flush=True)
    (out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    print("| start | schedule | steps | final lr | held-out loss | held-out acc1 | simulated acceptance |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['start']} | {r['schedule']} | {r['steps']} | {r['final_lr']:.1e} | {r['heldout_loss']:.4f} | "
              f"{r['heldout_acc1']:.4f} | {r['simulated_acceptance']:.3f} |")


if __name__ == "__main__":
    main()

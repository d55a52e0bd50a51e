"""Acceptance of several DFlash drafters for one target, greedy, on held-out prompts: vLLM's chain and DDTree.

    python scripts/compare_drafters.py --target ~/.cache/vllm-ddtree/SmolLM2-135M-Instruct \
        new=/tmp/drafter shipped=vllm_ddtree/drafters/smollm2-135m-instruct-dflash

Runs on whatever vLLM is installed (the CPU build here: float32, eager). One engine per drafter and method, so a
CPU run takes ~3-4 minutes per engine. Prints a table and writes JSON. For picking between drafters whose GPU
acceptance is not measured yet; the GPU figures come from scripts/benchmark.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("drafters", nargs="+", help="NAME=FOLDER, one per drafter")
    parser.add_argument("--target", required=True)
    parser.add_argument("--budget", type=int, default=16, help="DDTree's node budget")
    parser.add_argument("--chain-tokens", type=int, default=15, help="the chain's num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-prompt-len", type=int, default=256)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default="compare_drafters.json")
    args = parser.parse_args()
    drafters = {}
    for item in args.drafters:
        name, sep, folder = item.partition("=")
        if not sep or not (Path(folder) / "config.json").exists():
            parser.error(f"{item!r}: give NAME=FOLDER, where FOLDER holds a drafter's config.json")
        drafters[name] = folder

    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from tests.e2e.engine import run
    from vllm_ddtree.drafter.train import CHECK_PROMPTS_PER_SOURCE, check_prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts = check_prompt_ids(tokenizer, CHECK_PROMPTS_PER_SOURCE, args.max_prompt_len)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, detokenize=False)
    engine = dict(skip_tokenizer_init=False, max_model_len=1024, dtype=args.dtype, max_num_seqs=len(prompts))
    methods = {"chain": ("dflash", args.chain_tokens), f"ddtree-B{args.budget}": ("ddtree", args.budget)}
    rows = []
    for name, folder in drafters.items():
        for label, (method, tokens) in methods.items():
            spec = {"method": method, "model": folder, "num_speculative_tokens": tokens}
            result = run(args.target, spec, prompts, greedy, **engine)
            rows.append({"drafter": name, "method": label, "acceptance_length": round(result.acceptance_length, 3)})
            print(f"{name:>12} {label:>12} {rows[-1]['acceptance_length']:.3f}", flush=True)
    setup = {k: v for k, v in vars(args).items() if k != "drafters"}
    Path(args.out).write_text(json.dumps({"setup": {**setup, "drafters": drafters, "prompts": len(prompts)},
                                          "rows": rows}, indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()

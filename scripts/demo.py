"""DDTree on the default model pair: SmolLM2-135M-Instruct and the project's DFlash drafter.

Runs the same greedy chat prompts three ways through vLLM's offline `LLM` API (no speculation, vLLM's in-tree
DFlash chain, DDTree), prints each answer and the acceptance statistics, and checks that both speculative runs
return exactly the tokens of the plain run.

    python scripts/demo.py [--budget 16] [--max-tokens 96] [--drafter DIR] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

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


def run(name, target, spec, prompts, params, dtype):
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
    for prompt, output in zip(PROMPTS, outputs):
        print(f"> {prompt}\n{output.outputs[0].text.strip()}\n")
    print(f"{name} stats: {json.dumps(stats)}")
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
    args = parser.parse_args()

    target = str(convert_smollm2(default_smollm2_dir().with_name(f"SmolLM2-135M-Instruct-{args.dtype}"), args.dtype))
    drafter = args.drafter or default_drafter_dir()
    if drafter is None:
        raise SystemExit("No drafter: this build ships none; pass --drafter DIR (scripts/train_drafter.py makes one).")
    block_size = json.loads(open(os.path.join(drafter, "config.json")).read())["block_size"]
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in PROMPTS
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    plain, _ = run("no speculation", target, None, prompts, params, args.dtype)
    chain_spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": block_size - 1}
    chain, chain_stats = run("DFlash chain (vLLM in-tree)", target, chain_spec, prompts, params, args.dtype)
    tree_spec = {"method": "ddtree", "model": str(drafter), "num_speculative_tokens": args.budget}
    tree, tree_stats = run(f"DDTree (B={args.budget})", target, tree_spec, prompts, params, args.dtype)
    print("\n=== summary ===")
    print(f"acceptance length: chain {chain_stats['acceptance_length']}, tree {tree_stats['acceptance_length']}")
    print(f"tree output identical to no speculation: {tree == plain}; chain: {chain == plain}")


if __name__ == "__main__":
    main()

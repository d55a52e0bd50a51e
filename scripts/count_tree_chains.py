"""How many chains DDTree's trees split into (`VLLM_DDTREE_PER_PATH_ATTENTION=chains` reads each request's context
once per chain; `1` and `decode` once per node), on the default pair in the CPU build, greedy.

    python scripts/count_tree_chains.py --budgets 8 16 64
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "What is the capital of France? Explain its history briefly.",
    "Give three tips for staying focused while studying.",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
]


def count(target: str, drafter: str, budget: int, max_tokens: int) -> dict:
    """Trees of every step with drafts: their nodes and chains (a chain per leaf), means over the trees."""
    import vllm_ddtree.attention.per_path as per_path
    from vllm import SamplingParams
    from vllm_ddtree.compat import shutdown_llm

    trees = []  # (nodes, chains, longest chain)
    node_chains = per_path.node_chains

    def counted(node_mask, num_nodes):
        result = node_chains(node_mask, num_nodes)
        length = result[2]  # [T, C]
        trees.extend((int(n), int((row > 0).sum()), int(row.max())) for n, row in zip(num_nodes, length) if n > 1)
        return result

    per_path.node_chains = counted  # called once per step (the other layers reuse the calls)
    try:
        from vllm import LLM

        spec = {"method": "ddtree", "model": drafter, "num_speculative_tokens": budget}
        llm = LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=1024, seed=0,
                  kv_cache_memory_bytes=256 * 2**20, speculative_config=spec)  # fmt: skip
        try:
            llm.chat([[{"role": "user", "content": p}] for p in PROMPTS],
                     SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)  # fmt: skip
        finally:
            shutdown_llm(llm)
    finally:
        per_path.node_chains = node_chains
    nodes, chains = sum(t[0] for t in trees), sum(t[1] for t in trees)
    return {"budget": budget, "trees": len(trees), "mean_nodes": nodes / len(trees),
            "mean_chains": chains / len(trees), "chains_per_node": chains / nodes,
            "longest_chain": max(t[2] for t in trees)}  # fmt: skip


def main() -> None:
    from vllm_ddtree.drafters import default_drafter_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=os.path.expanduser("~/.cache/vllm-ddtree/SmolLM2-135M-Instruct-float32"))
    parser.add_argument("--drafter", default=str(default_drafter_dir()))
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 64])
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    os.environ["VLLM_DDTREE_PER_PATH_ATTENTION"] = "chains"
    rows = [count(args.target, args.drafter, b, args.max_tokens) for b in args.budgets]
    print("| B | trees | nodes | chains | chains / nodes | longest chain |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['budget']} | {r['trees']} | {r['mean_nodes']:.1f} | {r['mean_chains']:.1f} | "
              f"{r['chains_per_node']:.2f} | {r['longest_chain']} |")  # fmt: skip
    print(json.dumps(rows))


if __name__ == "__main__":
    main()

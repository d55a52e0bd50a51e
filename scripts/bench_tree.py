#!/usr/bin/env python
"""Time the tree operations of one decode step on the GPU: build (top-k + selection), ancestor mask and walk,
Triton kernels vs the tensor-op versions (VLLM_DDTREE_TREE_KERNELS=torch), over batch sizes and budgets.

    python scripts/bench_tree.py [--vocab 151936] [--depth 15] [--out tree_bench.json]

With vLLM importable (the staged bundle), torch.topk + V2's log-prob kernel is timed next to `top_tokens`, once per
batch and budget (`vllm_log_probs_candidate`), and so is the Triton top-K of tree/triton_topk.py
(`triton_top_k_candidate`, any CUDA machine; session 32's two-pass chunked torch.topk lost at every size and is
gone). `top_tokens` (the build's top-K column) follows VLLM_DDTREE_TOP_K: session 34's run had torch.topk's path
there, before `auto` took the Triton top-K by default. Each figure is the median of --iters timed calls (CUDA events around each call, after warm-up), eager
launches as in the decode step. Prints a markdown table and writes JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_ddtree.tree import ancestor_mask, build_draft_tree, walk_tree  # noqa: E402
from vllm_ddtree.tree.build import top_tokens, topk_per_depth  # noqa: E402


def median_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def vllm_log_probs_candidate(logits: torch.Tensor, k: int, iters: int) -> dict:
    """A candidate for `top_tokens` on CUDA, timed next to it: torch.topk for the ids, then Model Runner V2's
    `compute_token_logprobs` kernel (max and sum of exp per row, log-probs at the ids only: no float32 copy of the
    logits, which the log-softmax writes). Empty where vLLM's V2 modules do not import (a bare device)."""
    try:
        from vllm_ddtree.compat import v2_token_logprobs

        token_logprobs = v2_token_logprobs()
    except ImportError:
        return {}
    rows = logits.view(-1, logits.shape[-1])  # [R * D, V]

    def candidate():
        ids = torch.topk(rows, k, dim=-1, sorted=True).indices  # [R * D, K]
        return ids, token_logprobs(rows, ids)

    ids, log_probs = candidate()
    expected = torch.log_softmax(rows, dim=-1, dtype=torch.float32).gather(-1, ids)
    return {"topk_vllm_lp_ms": median_ms(candidate, iters),
            "topk_vllm_lp_max_abs_err": float((log_probs - expected).abs().max())}


def triton_top_k_candidate(logits: torch.Tensor, k: int, iters: int) -> dict:
    """tree/triton_topk.py (`VLLM_DDTREE_TOP_K=triton`) at a few chunk widths, and whether its logits and log-probs
    match `top_tokens`' (ids may differ among equal logits: torch.topk does not take the lower id)."""
    from vllm_ddtree.tree.triton_topk import MAX_K, top_tokens_triton

    if k > MAX_K:
        return {}
    ids, log_probs = top_tokens(logits, k)
    got_ids, got_lp = top_tokens_triton(logits, k)
    by_chunk = {c: median_ms(lambda c=c: top_tokens_triton(logits, k, chunk=c), iters) for c in (1024, 2048, 4096)}
    chunk = min(by_chunk, key=by_chunk.get)
    return {"triton_topk_ms": by_chunk[chunk], "triton_chunk": chunk, "triton_ms_by_chunk": by_chunk,
            "triton_same_logits": bool(torch.equal(logits.gather(-1, got_ids), logits.gather(-1, ids))),
            "triton_lp_max_abs_err": float((got_lp - log_probs).abs().max())}


def measure(batch: int, budget: int, depth: int, vocab: int, iters: int, with_candidate: bool) -> dict:
    logits = torch.randn(batch, depth, vocab, device="cuda", dtype=torch.bfloat16) * 3
    roots = torch.zeros(batch, dtype=torch.int64, device="cuda")
    tree = build_draft_tree(logits, roots, budget)
    target = torch.randint(0, vocab, (batch, budget + 1), device="cuda")
    target.scatter_(1, tree.parents[:, 1:], tree.token_ids[:, 1:])  # targets that follow the tree
    num_nodes = torch.full((batch,), budget + 1, device="cuda")
    k = topk_per_depth(vocab, None, budget)
    return {
        "build_ms": median_ms(lambda: build_draft_tree(logits, roots, budget), iters),
        "topk_ms": median_ms(lambda: top_tokens(logits, k), iters),  # part of build
        **(vllm_log_probs_candidate(logits, k, iters) if with_candidate else {}),
        **(triton_top_k_candidate(logits, k, iters) if with_candidate else {}),
        "mask_ms": median_ms(lambda: ancestor_mask(tree.parents), iters),
        "walk_ms": median_ms(lambda: walk_tree(tree.token_ids, tree.parents, tree.depths, target, num_nodes, depth),
                             iters),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--depth", type=int, default=15)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--budgets", type=int, nargs="+", default=[15, 64, 128])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", default="tree_bench.json")
    args = parser.parse_args()
    rows = []
    for kernels, batch, budget in itertools.product(("triton", "torch"), args.batch_sizes, args.budgets):
        os.environ["VLLM_DDTREE_TREE_KERNELS"] = kernels
        rows.append({"kernels": kernels, "batch": batch, "budget": budget,
                     **measure(batch, budget, args.depth, args.vocab, args.iters, kernels == "triton")})
    print(f"vocab {args.vocab}, depth {args.depth}, bf16 logits, {torch.cuda.get_device_name()}")
    print("| kernels | batch | budget | build ms | of which top_tokens ms | torch.topk + vLLM log-probs ms "
          "| Triton top-K ms (chunk, same logits) | mask ms | walk ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")

    def cell(r, key, extra=""):
        return f"{r[key]:.3f}{extra}" if key in r else "-"

    for r in rows:
        candidate = cell(r, "triton_topk_ms", f" ({r.get('triton_chunk')}, {r.get('triton_same_logits')})")
        print(f"| {r['kernels']} | {r['batch']} | {r['budget']} | {r['build_ms']:.3f} | {r['topk_ms']:.3f} | "
              f"{cell(r, 'topk_vllm_lp_ms')} | {candidate} | {r['mask_ms']:.3f} | "
              f"{r['walk_ms']:.3f} |")
    Path(args.out).write_text(json.dumps({"setup": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

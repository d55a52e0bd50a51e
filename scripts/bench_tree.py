#!/usr/bin/env python
"""Time the tree operations of one decode step on the GPU: build (top-k + selection), ancestor mask and walk,
Triton kernels vs the tensor-op versions (VLLM_DDTREE_TREE_KERNELS=torch), over batch sizes and budgets.

    python scripts/bench_tree.py [--vocab 151936] [--depth 15] [--out tree_bench.json]

With vLLM importable (the staged bundle), a candidate for the top-K's log-probabilities is timed next to it, once
per batch and budget (`vllm_log_probs_candidate`), and so is a two-pass chunked torch.topk for the ids
(`chunked_top_ids_candidate`, any device). Each figure is the median of --iters timed calls (CUDA events
around each call, after warm-up), eager launches as in the decode step. Prints a markdown table and writes JSON.
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


def chunk_widths(vocab: int, k: int, lo: int = 1024, hi: int = 8192) -> list[int]:
    """Divisors of `vocab` in [lo, hi] (and >= k): the chunk widths `chunked_top_ids` can take."""
    return [w for w in range(max(lo, k), min(hi, vocab) + 1) if vocab % w == 0]


def chunked_top_ids(rows: torch.Tensor, k: int, width: int) -> torch.Tensor:
    """[rows, K] the top-k ids of each [rows, V] row, by logit descending, in two torch.topk passes: k per chunk of
    `width` logits (many short rows), then k among the chunks' winners. The same values as one torch.topk over V
    (the top-k of a union of the chunks' top-k); among equal logits either may pick other ids."""
    num_rows, vocab = rows.shape
    chunks = rows.view(num_rows, vocab // width, width)  # [rows, C, width]
    values, ids = torch.topk(chunks, k, dim=-1, sorted=False)  # [rows, C, K]
    ids = ids + torch.arange(0, vocab, width, device=rows.device)[:, None]  # ids in the whole vocabulary
    best = torch.topk(values.flatten(1), k, dim=-1, sorted=True).indices  # [rows, K] among the C * K winners
    return ids.flatten(1).gather(1, best)


def chunked_top_ids_candidate(logits: torch.Tensor, k: int, iters: int) -> dict:
    """torch.topk's ids alone next to `chunked_top_ids` (a candidate for the top-K's 0.64 ms at batch 32, session 31:
    one radix select per 151,936-logit row keeps few blocks busy), and whether they pick the same values."""
    rows = logits.view(-1, logits.shape[-1])  # [R * D, V]
    widths = chunk_widths(rows.shape[1], k)
    if not widths:
        return {}
    expected = torch.topk(rows, k, dim=-1, sorted=True).values
    same = all(torch.equal(rows.gather(1, chunked_top_ids(rows, k, w)), expected) for w in widths)
    by_width = {w: median_ms(lambda w=w: chunked_top_ids(rows, k, w), iters) for w in widths}
    width = min(by_width, key=by_width.get)
    return {"topk_ids_ms": median_ms(lambda: torch.topk(rows, k, dim=-1, sorted=True).indices, iters),
            "chunked_ids_ms": by_width[width], "chunk_width": width, "chunked_ms_by_width": by_width,
            "chunked_same_values": same}


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
        **(chunked_top_ids_candidate(logits, k, iters) if with_candidate else {}),
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
    print("| kernels | batch | budget | build ms | of which top-K ms | top-K + vLLM log-probs ms | torch.topk ids ms "
          "| chunked ids ms (width, same values) | mask ms | walk ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")

    def cell(r, key, extra=""):
        return f"{r[key]:.3f}{extra}" if key in r else "-"

    for r in rows:
        chunked = cell(r, "chunked_ids_ms", f" ({r.get('chunk_width')}, {r.get('chunked_same_values')})")
        print(f"| {r['kernels']} | {r['batch']} | {r['budget']} | {r['build_ms']:.3f} | {r['topk_ms']:.3f} | "
              f"{cell(r, 'topk_vllm_lp_ms')} | {cell(r, 'topk_ids_ms')} | {chunked} | {r['mask_ms']:.3f} | "
              f"{r['walk_ms']:.3f} |")
    Path(args.out).write_text(json.dumps({"setup": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

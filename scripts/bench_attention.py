"""Kernel timings on the GPU: tree attention vs FlashAttention-3, and KV compaction (Triton vs per-layer torch).

Qwen3-8B attention shape (32 query heads, 8 KV heads, head dim 128, bf16, page 16), tree budget B (N = B + 1
query rows per request). For each (batch, context):
  split     what the plugin runs when every request is a tree (FA3 available): FA3 over the context with LSE +
            our tree part merged in one Triton launch (`attention.layers.split_tree_attention_`)
  tree      our one-pass Triton tree attention (context + tree, ancestor mask), the fallback (fp32, mixed batches)
  fa3       FlashAttention-3 causal attention of the same N rows per request over the same paged cache
            (what vLLM's backend runs for a chain verification step of N tokens)
  fa3_ctx   FA3 over the context only, non-causal, returning the LSE: part (a) of a split design
  tree_only our kernel on the tree keys alone (context 0): an upper bound of part (b) of a split design
  per_path_M  VLLM_DDTREE_PER_PATH_ATTENTION=M (--per-path 1,decode,chains): FA3 per node or per chain over its
            context and path (`attention.per_path`), the exactness mode for bf16; eager timings reuse the step's
            calls as every layer after the first does, CUDA-graph ones rebuild them as a captured layer does
  split_MxN[xWxS[xE]]  the split path with the tree part's launch at BLOCK_M x BLOCK_N, num_warps W, num_stages S,
            E = 1: the context part loaded before the key loop (--split-blocks, an A/B of the launch; `split` is the
            shipped choice)
Every variant rotates over enough caches that the working set exceeds the L2. Times are medians of
`triton.testing.do_bench` (eager calls: small cases then time the host's launches), or with --cuda-graphs of
CUDA-graph replays (GPU time, as inside vLLM's FULL graphs). Writes JSON to --out and prints a table.

    python scripts/bench_attention.py --out /tmp/attn.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.gpu.cases import make_case  # noqa: E402
from vllm_ddtree.attention.layers import split_tree_attention_  # noqa: E402
from vllm_ddtree.attention.triton_tree import tree_attention_triton_  # noqa: E402

L2_BYTES = 60 * 2**20


def _rotating(cases, fn):
    state = {"i": 0}

    def call():
        case = cases[state["i"] % len(cases)]
        state["i"] += 1
        fn(case)

    return call


def _tree(case, out):
    t = case.tree
    tree_attention_triton_(
        case.query, case.kv.keys, case.kv.values, t.block_table, t.query_start, t.seq_lens, t.num_nodes,
        t.node_mask, t.max_seq_len, case.scale, out,
    )  # fmt: skip


def _split_tree(case):
    """case.tree with the split design's inputs: FA3's cu_seqlens_q and every request's context length (those of
    FA3's context-only pass)."""
    _, cu_q, context_lens, _ = _fa3_inputs(case, context_only=True)
    return dataclasses.replace(case.tree, cu_seqlens_q=cu_q, context_lens=context_lens, covers_all_tokens=True)


def _split(case, tree, out, launch=None):
    split_tree_attention_(case.query, case.kv.keys, case.kv.values, tree, case.scale, out, launch)


def _per_path(case, tree, out, mode: str):
    import os

    from vllm_ddtree.attention.per_path import PER_PATH_ENV, fa3_attend, per_path_attention_

    os.environ[PER_PATH_ENV] = mode
    per_path_attention_(case.query, case.kv, tree, case.scale, out, fa3_attend)


def _fa3_inputs(case, context_only: bool):
    t = case.tree
    num_trees, width = t.node_mask.shape[0], t.node_mask.shape[1]
    rows = torch.cat([torch.arange(int(s), int(s) + width, device="cuda") for s in t.query_start.tolist()])
    q = case.query[rows].contiguous()  # [T * N, Hq, D]
    cu_q = torch.arange(0, (num_trees + 1) * width, width, device="cuda", dtype=torch.int32)
    seqused = (t.seq_lens - (t.num_nodes if context_only else 0)).to(torch.int32)
    return q, cu_q, seqused, width


def _fa3(flash_attn_varlen_func, case, inputs, causal: bool, lse: bool):
    q, cu_q, seqused, width = inputs
    return flash_attn_varlen_func(
        q, case.kv.keys, case.kv.values, max_seqlen_q=width, cu_seqlens_q=cu_q, max_seqlen_k=case.tree.max_seq_len,
        seqused_k=seqused, causal=causal, block_table=case.tree.block_table, softmax_scale=case.scale,
        return_softmax_lse=lse, fa_version=3,
    )  # fmt: skip


def bench_attention(batches, contexts, budget, rep_ms, graphs: bool, split_blocks=(), per_path=()):
    """graphs: time replays of CUDA graphs of the calls (GPU time only, as inside vLLM's FULL graphs); else
    `do_bench` on eager calls, where small cases measure the host's launch time (Python wrappers, ~40-60 us a
    Triton launch) rather than the GPU's."""
    bench = triton.testing.do_bench_cudagraph if graphs else triton.testing.do_bench
    time_it = functools.partial(bench, rep=rep_ms, return_mode="median")
    from vllm_ddtree.compat import flash_attn_varlen

    fa = flash_attn_varlen()
    rows = []
    for batch in batches:
        for ctx in contexts:
            kv_bytes = batch * (ctx + budget + 1) * 8 * 128 * 2 * 2
            copies = max(2, min(8, -(-3 * L2_BYTES // kv_bytes)))
            cases = [make_case(batch, budget, ctx, 32, 8, 128, torch.bfloat16, "cuda", seed=s, full_trees=True,
                               filler_rows=0) for s in range(copies)]  # fmt: skip
            tree_only = [make_case(batch, budget, 0, 32, 8, 128, torch.bfloat16, "cuda", seed=s, full_trees=True,
                                   filler_rows=0) for s in range(copies)]  # fmt: skip
            out = torch.empty_like(cases[0].query)
            out0 = torch.empty_like(tree_only[0].query)
            fa_in = {id(c): _fa3_inputs(c, False) for c in cases}
            fa_ctx_in = {id(c): _fa3_inputs(c, True) for c in cases}
            split_trees = {id(c): _split_tree(c) for c in cases}
            times = {
                "split": time_it(_rotating(cases, lambda c: _split(c, split_trees[id(c)], out))),
                "tree": time_it(_rotating(cases, lambda c: _tree(c, out))),
                "fa3": time_it(_rotating(cases, lambda c: _fa3(fa, c, fa_in[id(c)], True, False))),
                "fa3_ctx": time_it(_rotating(cases, lambda c: _fa3(fa, c, fa_ctx_in[id(c)], False, True))),
                "tree_only": time_it(_rotating(tree_only, lambda c: _tree(c, out0))),
            }
            for mode in per_path:  # trees of a block-16 drafter: chains of at most 16 nodes
                trees = {id(c): dataclasses.replace(c.tree, depth=min(budget, 15)) for c in cases}
                run = _rotating(cases, lambda c, m=mode: _per_path(c, trees[id(c)], out, m))
                times["per_path_" + mode] = time_it(run)
            for launch in split_blocks:
                times["split_" + "x".join(map(str, launch))] = time_it(
                    _rotating(cases, lambda c, b=launch: _split(c, split_trees[id(c)], out, b)))
            row = {"batch": batch, "context": ctx, "budget": budget, "kv_MB": kv_bytes / 2**20, **times}
            row["tree_vs_fa3"] = times["fa3"] / times["tree"]
            row["split_vs_fa3"] = times["fa3"] / times["split"]  # the throughput ratio (goal >= 0.8)
            row["split_estimate"] = times["fa3_ctx"] + times["tree_only"]
            row["tree_GBps"] = kv_bytes / times["tree"] / 1e6
            rows.append(row)
            print(f"attn b={batch:3d} ctx={ctx:5d}: split {times['split'] * 1e3:8.1f} us  fa3/split "
                  f"{row['split_vs_fa3']:.2f}  tree {times['tree'] * 1e3:8.1f} us  fa3 {times['fa3'] * 1e3:8.1f}"
                  f"  fa3_ctx {times['fa3_ctx'] * 1e3:8.1f}  tree_only {times['tree_only'] * 1e3:7.1f}"
                  f"  ratio fa3/tree {row['tree_vs_fa3']:.2f}"
                  + "".join(f"  {k} {v * 1e3:.1f} us" for k, v in times.items()
                            if k.startswith(("split_", "per_path_"))),
                  flush=True)  # fmt: skip
            del cases, tree_only
    return rows


def chain_check(budget: int = 15) -> dict[str, float]:
    """Both our paths (one-pass, split) on chain trees equal FA3 causal attention (relative errors)."""
    from vllm_ddtree.compat import flash_attn_varlen

    case = make_case(4, budget, 3000, 32, 8, 128, torch.bfloat16, "cuda", seed=5, full_trees=True, filler_rows=0)
    chain = torch.tril(torch.ones(budget + 1, budget + 1, dtype=torch.bool, device="cuda"))
    case.tree.node_mask = chain.expand(4, -1, -1).contiguous()
    ref = _fa3(flash_attn_varlen(), case, _fa3_inputs(case, False), True, False).float()
    errors = {}
    for name, run in (("tree", lambda out: _tree(case, out)), ("split", lambda out: _split(case, _split_tree(case), out))):
        out = torch.full_like(case.query, float("nan"))
        run(out)
        errors[name] = float((out[: ref.shape[0]].float() - ref).norm() / ref.norm())
    return errors


def bench_compaction(batches, moves, rep_ms):
    from vllm_ddtree.kv.paged import PagedKV
    from vllm_ddtree.kv.triton_compact import LayerTable, compact_kv_triton_

    rows = []
    num_layers, page, heads, hd = 36, 16, 8, 128
    for batch in batches:
        num_blocks = batch * 8 + 4
        caches = [torch.randn((num_blocks, page, heads, 2 * hd), device="cuda").to(torch.bfloat16).permute(0, 2, 1, 3)
                  for _ in range(num_layers)]  # fmt: skip
        views = [PagedKV.for_packed(c, hd) for c in caches]
        table = LayerTable([v.keys for v in views], [v.values for v in views])
        identity = torch.arange(batch * 8 * page, device="cuda")  # slot mapping: token i's slot is i
        slots = identity.view(batch, -1)[:, : moves + 1]
        dst = slots[:, 1:].contiguous()
        src = torch.flip(dst, dims=[1]).contiguous()  # far moves (worst case: every move copies)
        src = torch.maximum(src, dst)
        t_triton = triton.testing.do_bench(lambda: compact_kv_triton_(table, src, dst, identity), rep=rep_ms,
                                           return_mode="median")  # fmt: skip

        def torch_loop():
            for v in views:
                v.copy_slots(src.flatten(), dst.flatten())

        t_torch = triton.testing.do_bench(torch_loop, rep=rep_ms, return_mode="median")
        rows.append({"batch": batch, "moves": moves, "layers": num_layers, "triton_ms": t_triton, "torch_ms": t_torch})
        print(f"compact b={batch:3d} M={moves}: triton {t_triton * 1e3:7.1f} us  torch loop {t_torch * 1e3:7.1f} us",
              flush=True)  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench_attention.json")
    parser.add_argument("--budget", type=int, default=15)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--contexts", default="1024,4096,8192")
    parser.add_argument("--rep-ms", type=int, default=60)
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="time CUDA-graph replays (GPU time, as in vLLM's FULL graphs) instead of eager calls")
    parser.add_argument("--split-blocks", default="",
                        help="BLOCK_MxBLOCK_N[xWARPS[xSTAGES[xEARLY]]] list for the split path's tree launch, e.g. "
                             "16x16,32x16x2x1,32x16x4x2x1 (A/B columns)")
    parser.add_argument("--per-path", default="",
                        help="VLLM_DDTREE_PER_PATH_ATTENTION modes to time too, e.g. 1,decode,chains")
    parser.add_argument("--no-compaction", action="store_true", help="skip the KV compaction timings")
    args = parser.parse_args()
    split_blocks = [tuple(int(v) for v in b.split("x")) for b in args.split_blocks.split(",") if b]
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    result = {"device": torch.cuda.get_device_name(), "cuda_graphs": args.cuda_graphs,
              "chain_check_rel_err": chain_check(args.budget)}
    print("chain check (our paths on chain trees vs FA3 causal), relative errors:", result["chain_check_rel_err"])
    per_path = [m for m in args.per_path.split(",") if m]
    result["attention"] = bench_attention(batches, contexts, args.budget, args.rep_ms, args.cuda_graphs, split_blocks,
                                          per_path)  # fmt: skip
    if not args.no_compaction:
        result["compaction"] = bench_compaction(batches, args.budget, args.rep_ms)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("\n| batch | context | split us | FA3 causal us | FA3/split | one-pass us | FA3/one-pass |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in result["attention"]:
        print(f"| {r['batch']} | {r['context']} | {r['split'] * 1e3:.1f} | {r['fa3'] * 1e3:.1f} | {r['split_vs_fa3']:.2f} "
              f"| {r['tree'] * 1e3:.1f} | {r['tree_vs_fa3']:.2f} |")  # fmt: skip
    for r in result["attention"]:  # the per-path modes: FA3 causal / per-path
        modes = {k: r["fa3"] / v for k, v in r.items() if k.startswith("per_path_")}
        if modes:
            ratios = "  ".join(f"{k} {v:.2f}" for k, v in modes.items())
            print(f"b={r['batch']} ctx={r['context']} FA3/per-path: {ratios}")
    for r in result["attention"]:  # the A/B launches: FA3 causal / split at each
        ab = {k: r["fa3"] / v for k, v in r.items() if k.startswith("split_") and k != "split_vs_fa3"
              and k != "split_estimate"}
        if ab:
            print(f"b={r['batch']} ctx={r['context']} FA3/split: " + "  ".join(f"{k} {v:.2f}" for k, v in ab.items()))


if __name__ == "__main__":
    main()

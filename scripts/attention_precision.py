"""bf16 rounding of the tree attention kernel against torch's FlashAttention, both measured against a float64 reference.

Greedy bf16 output of DDTree drifts from plain vLLM's more than the in-tree DFlash chain's does (session 17). This
asks whether the kernel is less precise than FlashAttention or only rounds differently: a chain of W nodes over a
paged context is ordinary causal attention, so both kernels compute the same thing. Needs CUDA, torch and Triton
only (no vLLM). Prints a table, writes JSON to --out.

    python scripts/attention_precision.py --out /tmp/precision.json
    python scripts/attention_precision.py --against-decode --out /tmp/decode.json   # vLLM's FA3 against decoding
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_ddtree.attention.triton_tree import tree_attention_triton_  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: only with TRITON_INTERPRET=1 (trying it out)


def paged(tokens: torch.Tensor, page: int, order: torch.Tensor) -> torch.Tensor:
    """[T, Hkv, D] -> [num_blocks, page, Hkv, D], logical block i stored at block order[i]."""
    num_tokens, num_heads, head_dim = tokens.shape
    padded = torch.zeros((order.numel() * page, num_heads, head_dim), dtype=tokens.dtype, device=tokens.device)
    padded[:num_tokens] = tokens
    cache = torch.zeros_like(padded).view(-1, page, num_heads, head_dim)
    cache[order] = padded.view(-1, page, num_heads, head_dim)
    return cache


def errors(out: torch.Tensor, reference: torch.Tensor) -> dict:
    diff = (out.double() - reference).abs()
    return {"max_abs": diff.max().item(), "mean_abs": diff.mean().item()}


HEADS, KV_HEADS, HEAD_DIM, PAGE = 9, 3, 64, 16  # SmolLM2-135M's attention, vLLM's page
CHAINS = 8  # sequences in the batched-chain variant (about the chains of a B = 16 tree)


def chain_inputs(context: int, width: int, q_scale: float, dtype: torch.dtype, seed: int):
    """Queries of a chain of `width` nodes [W, Hq, D], its keys and values [context + W, Hkv, D], and the same keys
    and values paged in shuffled blocks ([num_blocks, PAGE, Hkv, D], block table [1, num_blocks])."""
    gen = torch.Generator().manual_seed(seed)
    total = context + width
    q = (torch.randn(width, HEADS, HEAD_DIM, generator=gen) * q_scale).to(dtype).to(DEVICE)
    k = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen).to(dtype).to(DEVICE)
    order = torch.randperm(math.ceil(total / PAGE), generator=gen).to(DEVICE)
    return q, k, v, paged(k, PAGE, order), paged(v, PAGE, order), order.to(torch.int32)[None, :]


def case(context: int, width: int, q_scale: float, dtype: torch.dtype, seed: int) -> dict:
    """One request: `context` keys, then a chain of `width` nodes (node i sees the context and nodes <= i)."""
    heads, kv_heads, head_dim = HEADS, KV_HEADS, HEAD_DIM
    total = context + width
    q, k, v, keys, values, block_table = chain_inputs(context, width, q_scale, dtype, seed)
    scale = head_dim**-0.5
    # float64 reference from the same rounded inputs
    group = heads // kv_heads
    k64, v64 = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)  # [T, Hq, D]
    scores = torch.einsum("whd,thd->hwt", q.double(), k64) * scale  # [Hq, W, T]
    visible = torch.arange(total, device=DEVICE)[None, :] <= context + torch.arange(width, device=DEVICE)[:, None]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    reference = torch.einsum("hwt,thd->whd", scores.softmax(-1), v64)  # [W, Hq, D]

    ours = torch.full((width, heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    one = lambda x: torch.tensor([x], dtype=torch.int64, device=DEVICE)  # noqa: E731
    mask = torch.tril(torch.ones(width, width, dtype=torch.uint8, device=DEVICE))[None]
    tree_attention_triton_(q, keys, values, block_table, one(0), one(total), one(width), mask, total, scale, ours)

    result = {"context": context, "width": width, "q_scale": q_scale, "dtype": str(dtype).split(".")[-1],
              "ours": errors(ours, reference)}  # fmt: skip
    if dtype in (torch.float16, torch.bfloat16):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.bias import causal_lower_right

        qh = q.transpose(0, 1)[None]  # [1, Hq, W, D]
        kh = k.repeat_interleave(group, 1).transpose(0, 1)[None]  # [1, Hq, T, D]
        vh = v.repeat_interleave(group, 1).transpose(0, 1)[None]
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            flash = torch.nn.functional.scaled_dot_product_attention(
                qh, kh, vh, attn_mask=causal_lower_right(width, total), scale=scale
            )[0].transpose(0, 1)  # [W, Hq, D]
        result["flash"] = errors(flash, reference)
        result["identical_to_flash"] = (ours == flash).float().mean().item()
        result["ours_over_flash_mean_error"] = result["ours"]["mean_abs"] / max(result["flash"]["mean_abs"], 1e-30)
    return result


def decode_agreement(context: int, width: int, q_scale: float, seed: int) -> dict:
    """bf16, vLLM's FlashAttention 3 (CUDA only): how often each way of verifying a chain of `width` nodes gives
    bitwise the output plain decoding gives (node i decoded alone: one query over context + i + 1 keys, batch 1):
    FA3 over the whole chain at once (vLLM's DFlash chain verification), the one-pass Triton tree kernel (DDTree at
    batch 1) and the split path (FA3 over the context merged with the Triton tree part, DDTree from batch 2).
    If the first is near 1 and the others are not, verifying each root-to-leaf path with FA3 would make DDTree's
    bf16 rows round like the chain's (issue 3's bf16 goal). Session 49 (H100): FA3's 17-node chain was bitwise
    decoding's at every context, the Triton paths were not; `fa3_per_node` (each node a sequence of its own in one
    call) asks whether that survives the per-path design's batch of sequences."""
    from types import SimpleNamespace

    from vllm_ddtree.attention.layers import split_tree_attention_
    from vllm_ddtree.compat import flash_attn_varlen

    fa3 = flash_attn_varlen()
    dtype, total, scale = torch.bfloat16, context + width, HEAD_DIM**-0.5
    q, _, _, keys, values, block_table = chain_inputs(context, width, q_scale, dtype, seed)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
    i64 = lambda *x: torch.tensor(x, dtype=torch.int64, device=DEVICE)  # noqa: E731

    def fa3_causal(rows: torch.Tensor, seq_len: int, max_seqlen_q: int = 0, max_seqlen_k: int = 0,
                   **kwargs) -> torch.Tensor:  # fmt: skip
        """`rows` as one causal sequence over the first `seq_len` keys; the bounds default to its own sizes."""
        return fa3(rows, keys, values, max_seqlen_q=max_seqlen_q or rows.shape[0],
                   cu_seqlens_q=i32(0, rows.shape[0]), max_seqlen_k=max_seqlen_k or seq_len, seqused_k=i32(seq_len),
                   causal=True, block_table=block_table, softmax_scale=scale, fa_version=3, **kwargs)  # fmt: skip

    def per_node(k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, **kwargs) -> torch.Tensor:
        """Every node its own sequence in one call: one query over the context and its path (here the chain's
        prefix), the per-path design of docs/bf16-drift.md and `attention/per_path.py`."""
        return fa3(q, k, v, max_seqlen_q=1, cu_seqlens_q=torch.arange(width + 1, dtype=torch.int32, device=DEVICE),
                   max_seqlen_k=total, seqused_k=(context + 1 + torch.arange(width, device=DEVICE)).to(torch.int32),
                   causal=True, block_table=table, softmax_scale=scale, fa_version=3, **kwargs)  # fmt: skip

    decoded = torch.cat([fa3_causal(q[i: i + 1], context + i + 1) for i in range(width)])  # [W, Hq, D]
    outputs = {"fa3_chain": fa3_causal(q, total)}
    # The chain as one of CHAINS sequences in one call (the tree split into chains, each verified by FA3 with its
    # own queries, docs/bf16-drift.md): does the batch change how FA3 splits the keys, and so the rounding?
    outputs["fa3_chain_batched"] = fa3(
        q.repeat(CHAINS, 1, 1), keys, values, max_seqlen_q=width,
        cu_seqlens_q=torch.arange(0, (CHAINS + 1) * width, width, dtype=torch.int32, device=DEVICE),
        max_seqlen_k=total, seqused_k=torch.full((CHAINS,), total, dtype=torch.int32, device=DEVICE), causal=True,
        block_table=block_table.expand(CHAINS, -1).contiguous(), softmax_scale=scale, fa_version=3)[:width]
    # Does FA3 keep decoding's rounding for a batch of W sequences (it splits a sequence's keys among thread
    # blocks by a heuristic over the whole batch: more sequences, fewer splits)?
    node_table = block_table.expand(width, -1).contiguous()  # [W, blocks] every node's sequence: the chain's blocks
    outputs["fa3_per_node"] = per_node(keys, values, node_table)
    # The same through one-token pages: the cache viewed as [blocks * PAGE, 1, Hkv, D] and a table of key slots per
    # node, which names a tree node's context and ancestors in place (no copies), as `attention/per_path.py` does.
    slots = (block_table[0, :, None] * PAGE + torch.arange(PAGE, device=DEVICE)).flatten()[:total]  # [context + W]
    def attempt(name: str, run) -> None:  # a refused call is an answer too (NaN: no element equal)
        try:
            outputs[name] = run()
        except (RuntimeError, TypeError) as error:
            print(f"{name} (context {context}, {width} nodes): {error}")
            outputs[name] = torch.full_like(q, float("nan"))

    attempt("fa3_per_node_page1", lambda: per_node(keys.view(-1, 1, KV_HEADS, HEAD_DIM),
                                                   values.view(-1, 1, KV_HEADS, HEAD_DIM),
                                                   slots[None, :].expand(width, -1).contiguous()))  # fmt: skip
    # One split each: whether decoding split its keys here at all, and whether the per-node batch then agrees.
    attempt("decode_one_split", lambda: torch.cat([fa3_causal(q[i: i + 1], context + i + 1, num_splits=1)
                                                   for i in range(width)]))  # fmt: skip
    attempt("fa3_per_node_one_split", lambda: per_node(keys, values, node_table, num_splits=1))
    # One call per node (VLLM_DDTREE_PER_PATH_ATTENTION=decode at batch 1): node i alone, as decoding, but with the
    # tree's longest sequence as max_seqlen_k (the step's, which the engine passes) instead of its own length.
    attempt("fa3_node_calls", lambda: torch.cat([fa3_causal(q[i: i + 1], context + i + 1, max_seqlen_k=total)
                                                 for i in range(width)]))  # fmt: skip
    # VLLM_DDTREE_PER_PATH_ATTENTION=chains at batch 1: a chain whose first node is not the root (here the chain's
    # second half) is one causal sequence over the context, its ancestors and itself, with max_seqlen_q the depth
    # bound (the whole chain's length) and the tree's longest sequence as max_seqlen_k.
    half = width // 2
    attempt("fa3_chain_tail", lambda: torch.cat([outputs["fa3_chain"][:half],
                                                 fa3_causal(q[half:], total, max_seqlen_q=width)]))  # fmt: skip
    mask = torch.tril(torch.ones(width, width, dtype=torch.uint8, device=DEVICE))[None]
    one_pass = torch.full_like(q, float("nan"))
    tree_attention_triton_(q, keys, values, block_table, i64(0), i64(total), i64(width), mask, total, scale, one_pass)
    outputs["triton_one_pass"] = one_pass
    tree = SimpleNamespace(node_mask=mask, cu_seqlens_q=i32(0, width), max_seq_len=total, context_lens=i32(context),
                           block_table=block_table, query_start=i64(0), seq_lens=i64(total), num_nodes=i64(width))
    split = torch.full_like(q, float("nan"))
    split_tree_attention_(q, keys, values, tree, scale, split)
    outputs["split"] = split
    result = {"context": context, "width": width, "q_scale": q_scale}
    for name, out in outputs.items():
        result[name] = {"bitwise_equal": (out == decoded).float().mean().item(),
                        "rows_equal": (out == decoded).flatten(1).all(1).float().mean().item(),
                        "mean_abs_diff": (out.float() - decoded.float()).abs().mean().item()}  # fmt: skip
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="attention_precision.json")
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 300, 1000, 4000])
    parser.add_argument("--widths", type=int, nargs="+", default=[17, 65], help="nodes per tree (B + 1)")
    parser.add_argument("--against-decode", action="store_true",
                        help="bf16 only, vLLM's FA3 (CUDA): each verification's bitwise agreement with plain decoding")
    args = parser.parse_args()
    if args.against_decode:
        rows = [decode_agreement(c, w, qs, seed=i) for i, (c, w, qs) in enumerate(
            (c, w, qs) for c in args.contexts for w in args.widths for qs in (1.0, 4.0))]  # fmt: skip
        names = ("fa3_chain", "fa3_chain_batched", "fa3_per_node", "fa3_per_node_page1", "decode_one_split",
                 "fa3_per_node_one_split", "fa3_node_calls", "fa3_chain_tail", "triton_one_pass", "split")
        columns = " | ".join(f"{n}: equal elements / rows, mean diff" for n in names)
        print(f"| context | nodes | q scale | {columns} |")
        print("| --- | --- | --- |" + " --- |" * len(names))
        for r in rows:
            print(f"| {r['context']} | {r['width']} | {r['q_scale']} | " + " | ".join(
                f"{r[n]['bitwise_equal']:.3f} / {r[n]['rows_equal']:.3f}, {r[n]['mean_abs_diff']:.1e}" for n in names)
                + " |")  # fmt: skip
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=2))
        return
    rows = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for context in args.contexts:
            for width in args.widths:
                for q_scale in (1.0, 4.0):  # 4: peaked softmax, as trained models' attention often is
                    rows.append(case(context, width, q_scale, dtype, seed=len(rows)))
    print("| dtype | context | nodes | q scale | ours mean / max abs error | flash mean / max | ours / flash | bitwise = flash |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        flash = r.get("flash")
        print(f"| {r['dtype']} | {r['context']} | {r['width']} | {r['q_scale']} | {r['ours']['mean_abs']:.2e} / "
              f"{r['ours']['max_abs']:.2e} | "
              + (f"{flash['mean_abs']:.2e} / {flash['max_abs']:.2e} | {r['ours_over_flash_mean_error']:.2f} | "
                 f"{r['identical_to_flash']:.3f} |" if flash else "- | - | - |"))  # fmt: skip
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

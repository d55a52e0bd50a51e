"""Tree verification attention in pure torch: the reference every fast path is tested against, and the
implementation the CPU build of vLLM uses.

Node i of a tree request attends to the whole context (positions before the root) and to the nodes on its own
root path (the ancestor mask), reading keys and values from the paged KV cache, where the step's nodes were
written by slot = node index.
"""

from __future__ import annotations

import torch

from vllm_ddtree.attention.metadata import TreeAttentionMetadata
from vllm_ddtree.kv.paged import PagedKV


def masked_attention(
    query: torch.Tensor,  # [n, Hq, D]
    keys: torch.Tensor,  # [L, Hkv, D]
    values: torch.Tensor,  # [L, Hkv, D]
    mask: torch.Tensor,  # [n, L] bool, True = may attend
    scale: float,
) -> torch.Tensor:  # [n, Hq, D] in float32
    group = query.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)  # [L, Hq, D]
    v = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", query.float(), k) * scale  # [Hq, n, L]
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(dim=-1), v)


def tree_attention_mask(node_mask: torch.Tensor, context_len: int) -> torch.Tensor:
    """[n, context_len + n]: every node sees the context, and its ancestors among the nodes."""
    n = node_mask.shape[0]
    context = torch.ones((n, context_len), dtype=torch.bool, device=node_mask.device)
    return torch.cat([context, node_mask], dim=1)


def tree_attention_reference_(
    query: torch.Tensor,  # [num_tokens, Hq, D]
    kv: PagedKV,
    tree: TreeAttentionMetadata,
    scale: float,
    output: torch.Tensor,  # [num_tokens, Hq, D], rows of tree nodes are overwritten
) -> None:
    query_start = tree.query_start.tolist()
    seq_lens = tree.seq_lens.tolist()
    for t, num_nodes in enumerate(tree.num_nodes_cpu):
        if num_nodes == 0:  # a padding request (FULL CUDA graph batches)
            continue
        start, seq_len = query_start[t], seq_lens[t]
        positions = torch.arange(seq_len, device=query.device)
        slots = tree.block_table[t].to(torch.int64)[positions // kv.block_size] * kv.block_size + (
            positions % kv.block_size
        )
        keys, values = kv.read(slots)
        mask = tree_attention_mask(tree.node_mask[t, :num_nodes, :num_nodes].bool(), seq_len - num_nodes)
        out = masked_attention(query[start : start + num_nodes], keys, values, mask, scale)
        output[start : start + num_nodes] = out.to(output.dtype)

"""Random tree-verification attention problems over a paged KV cache in vLLM 0.26's GPU layout.

Shared by the GPU tests and `scripts/bench_attention.py`. The batch interleaves tree requests with non-tree rows
(a short prefill chunk before every tree), block tables are random permutations, and node counts, context lengths
and parents are random, so kernels are checked on layouts they were not tuned for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_ddtree.attention.metadata import TreeAttentionMetadata
from vllm_ddtree.kv.paged import PagedKV
from vllm_ddtree.tree import ancestor_mask


@dataclass
class TreeCase:
    query: torch.Tensor  # [num_tokens, Hq, D]
    kv_cache: torch.Tensor  # logical [num_blocks, Hkv, page, 2 * D], physical [num_blocks, page, Hkv, 2 * D]
    kv: PagedKV
    tree: TreeAttentionMetadata
    tree_rows: torch.Tensor  # [num_tokens] bool, rows the kernel must write
    scale: float


def random_parents(num_nodes: int, width: int, gen: torch.Generator) -> torch.Tensor:
    """[width] parents of a random tree with `num_nodes` valid nodes in topological order; padding -> root."""
    parents = torch.full((width,), 0, dtype=torch.int64)
    parents[0] = -1
    for i in range(1, num_nodes):
        # Mix deep chains and wide fans: half the nodes hang off the previous node.
        parents[i] = i - 1 if torch.rand((), generator=gen) < 0.5 else torch.randint(0, i, (), generator=gen)
    return parents


def make_case(
    num_trees: int,
    budget: int,
    max_context: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    page: int = 16,
    seed: int = 0,
    full_trees: bool = False,
    filler_rows: int = 3,
) -> TreeCase:
    gen = torch.Generator().manual_seed(seed)
    width = budget + 1
    if full_trees:
        num_nodes = torch.full((num_trees,), width, dtype=torch.int64)
        context = torch.full((num_trees,), max_context, dtype=torch.int64)
    else:
        num_nodes = torch.randint(1, width + 1, (num_trees,), generator=gen)
        num_nodes[0] = width
        context = torch.randint(0, max_context + 1, (num_trees,), generator=gen)
        context[-1] = max_context
    seq_lens = context + num_nodes
    filler = filler_rows if filler_rows else 0
    query_start = torch.cumsum(num_nodes + filler, 0) - num_nodes  # each tree after `filler` other rows
    num_tokens = int(query_start[-1] + num_nodes[-1]) + 2
    tree_rows = torch.zeros(num_tokens, dtype=torch.bool)
    for t in range(num_trees):
        tree_rows[int(query_start[t]) : int(query_start[t] + num_nodes[t])] = True

    blocks_per_tree = (seq_lens + page - 1) // page
    max_blocks = int(blocks_per_tree.max())
    num_blocks = int(blocks_per_tree.sum()) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    block_table = torch.zeros((num_trees, max_blocks), dtype=torch.int32)
    used = 0
    for t in range(num_trees):
        n = int(blocks_per_tree[t])
        block_table[t, :n] = perm[used : used + n].to(torch.int32)
        used += n

    device_gen = torch.Generator(device=device).manual_seed(seed)
    physical = torch.randn((num_blocks, page, num_kv_heads, 2 * head_dim), generator=device_gen, device=device)
    kv_cache = physical.to(dtype).permute(0, 2, 1, 3)  # logical [num_blocks, H, page, 2D]
    query = torch.randn((num_tokens, num_q_heads, head_dim), generator=device_gen, device=device).to(dtype)
    parents = torch.stack([random_parents(int(n), width, gen) for n in num_nodes])
    tree = TreeAttentionMetadata(
        tree_reqs=torch.arange(num_trees, device=device),
        num_nodes_cpu=num_nodes.tolist(),
        query_start=query_start.to(device),
        seq_lens=seq_lens.to(device),
        block_table=block_table.to(device),
        node_mask=ancestor_mask(parents).to(device),
        num_nodes=num_nodes.to(device),
        max_seq_len=int(seq_lens.max()),
    )
    return TreeCase(
        query=query,
        kv_cache=kv_cache,
        kv=PagedKV.for_packed(kv_cache, head_dim),
        tree=tree,
        tree_rows=tree_rows.to(device),
        scale=head_dim**-0.5,
    )


def context_attention_with_lse(case: TreeCase) -> tuple[torch.Tensor, torch.Tensor]:
    """Every tree node's attention over its request's context alone (no tree keys), in FlashAttention's output
    layout: (out [num_tokens, Hq, D] by token row, LSE [Hq, num_tokens] natural log, -inf without context).
    Pure torch: stands in for FA3's non-causal context pass of the split design where there is no GPU."""
    t, kv = case.tree, case.kv
    num_tokens, num_q_heads, head_dim = case.query.shape
    out = torch.zeros_like(case.query)
    lse = torch.full((num_q_heads, num_tokens), float("-inf"), dtype=torch.float32, device=case.query.device)
    for r, num_nodes in enumerate(t.num_nodes_cpu):
        start, context = int(t.query_start[r]), int(t.seq_lens[r]) - num_nodes
        if context == 0:
            continue
        positions = torch.arange(context, device=case.query.device)
        slots = t.block_table[r].to(torch.int64)[positions // kv.block_size] * kv.block_size + positions % kv.block_size
        keys, values = kv.read(slots)  # [context, Hkv, D]
        group = num_q_heads // keys.shape[1]
        q = case.query[start : start + num_nodes].float()  # [n, Hq, D]
        scores = torch.einsum("nhd,lhd->hnl", q, keys.float().repeat_interleave(group, 1)) * case.scale
        out[start : start + num_nodes] = torch.einsum(
            "hnl,lhd->nhd", scores.softmax(-1), values.float().repeat_interleave(group, 1)
        ).to(out.dtype)
        lse[:, start : start + num_nodes] = scores.logsumexp(-1)
    return out, lse


def tree_depth(tree: TreeAttentionMetadata) -> int:
    """The deepest node's depth among the trees' valid nodes (what `TreeAttentionMetadata.depth` bounds)."""
    mask = tree.node_mask.bool().cpu()
    return max(int(mask[t, i].sum()) - 1 for t, n in enumerate(tree.num_nodes_cpu) for i in range(n))


def as_persistent_layout(tree: TreeAttentionMetadata, padding: int) -> TreeAttentionMetadata:
    """`tree` as the FULL-CUDA-graph path lays it out (`PersistentTreeBuffers`): int32 query starts, sequence
    lengths and node counts, a uint8 mask, and `padding` extra requests with 0 nodes and no context."""
    import dataclasses

    def pad(values: torch.Tensor, fill: int) -> torch.Tensor:
        return torch.cat([values, values.new_full((padding, *values.shape[1:]), fill)]).to(torch.int32)

    num_tokens_end = int(tree.query_start[-1]) + int(tree.num_nodes[-1])
    return dataclasses.replace(
        tree,
        num_nodes_cpu=list(tree.num_nodes_cpu) + [0] * padding,
        query_start=pad(tree.query_start, num_tokens_end),
        seq_lens=pad(tree.seq_lens, 0),
        num_nodes=pad(tree.num_nodes, 0),
        block_table=pad(tree.block_table, 0),
        node_mask=torch.cat([tree.node_mask, tree.node_mask.new_zeros((padding, *tree.node_mask.shape[1:]))]).to(
            torch.uint8
        ),
    )

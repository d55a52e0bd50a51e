"""Per-path tree verification: every node attends as a sequence of its own, through FlashAttention-3.

A node's tree attention is causal attention over its request's context and its own root-to-node path. FA3
verifying a chain of up to 17 nodes is bitwise one-token decoding (session 49, docs/benchmarks.md), while DDTree's
Triton kernels round differently, which is all it takes for bf16 greedy answers to leave plain decoding's (issue 3).
So here each node is one query over the keys of its context and its path, named in place by a table of key slots
over the KV cache viewed as one-token pages: no KV is copied. Opt-in (`VLLM_DDTREE_PER_PATH_ATTENTION=1` or
`decode`, FA3 and 16-bit dtypes only): every node reads its whole context, so attention work grows with the number
of nodes. FA3 splits a sequence's keys among thread blocks by a heuristic over the whole call's batch, and the split
sets the rounding: `decode` makes one call per node index with one query per request, the batch a plain decoding
step of the same requests has.

Shapes are fixed by the tree buffers and the block table (CUDA graphs), and nothing here waits for the device.
"""

from __future__ import annotations

import os

import torch

from vllm_ddtree.attention.metadata import node_aliases
from vllm_ddtree.env import env_choice
from vllm_ddtree.kv.paged import PagedKV

PER_PATH_ENV = "VLLM_DDTREE_PER_PATH_ATTENTION"
SPLITS_ENV = "VLLM_DDTREE_PER_PATH_SPLITS"


def per_path_mode() -> str:
    """`VLLM_DDTREE_PER_PATH_ATTENTION`: "0" (off, the default), "1" (every node of the step one sequence of a single
    FA3 call) or "decode" (one FA3 call per node index, each a batch of one query per request: the shape of a plain
    decoding step, so that FA3 splits the keys as decoding does)."""
    return env_choice(PER_PATH_ENV, ("0", "1", "decode"),
                      "is not 0, 1 or decode (1: per-path FA3 tree verification in one call; decode: one call per "
                      "node index, shaped like a decoding step)")  # fmt: skip


def per_path_requested() -> bool:
    """Whether `per_path_mode` is on (CUDA, FA3, 16-bit dtypes; the CPU build runs the torch stand-in)."""
    return per_path_mode() != "0"


def node_key_slots(
    block_table: torch.Tensor,  # [T, max_blocks] int32
    seq_lens: torch.Tensor,  # [T] context + nodes
    num_nodes: torch.Tensor,  # [T] (0: a padding request)
    node_mask: torch.Tensor,  # [T, N, N] node i may attend node j
    page: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots [T * N, max_blocks * page] int32, lengths [T * N] int32): for every entry of the node grid (aliased as
    in `node_aliases`), the KV slots of its keys in order, context positions 0..C-1 and then the positions C + j of
    its path's nodes j (ancestors and itself, root first), and how many there are. Columns past the length repeat
    valid slots (never read)."""
    num_trees, width = node_mask.shape[0], node_mask.shape[1]
    max_keys = block_table.shape[1] * page
    device = node_mask.device
    req, node = node_aliases(num_nodes, width)  # [T, N]
    context = (seq_lens - num_nodes).to(torch.int64)[req]  # [T, N]
    on_path = node_mask[req, node].bool() & (torch.arange(width, device=device) < num_nodes[req][..., None])
    # on_path [T, N, N]: node j is on entry (t, i)'s path
    rank = on_path.cumsum(-1) - 1  # [T, N, N] j's place along the path
    # int32 from here: [T, N, K] is the big one (under CUDA graphs K is the block table's width, max_model_len)
    positions = torch.arange(max_keys + 1, dtype=torch.int32, device=device).expand(num_trees, width, -1).clone()
    column = torch.where(on_path, context[..., None] + rank, max_keys)  # off-path j: the spare column K
    path_positions = (context[..., None] + torch.arange(width, device=device)).to(torch.int32)  # [T, N, N]
    positions.scatter_(2, column, path_positions)  # [T, N, K + 1]
    positions = positions[..., :max_keys].clamp_(max=max_keys - 1)  # [T, N, K]
    lengths = (context + on_path.sum(-1)).clamp(min=1)  # [T, N]; >= 1: padding entries read one valid key
    slots = block_table[req[..., None], positions // page] * page + positions % page  # [T, N, K]
    return slots.view(num_trees * width, max_keys).to(torch.int32), lengths.view(-1).to(torch.int32)


def one_token_pages(cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, page, H, D] -> [num_blocks * page, 1, H, D], the same memory (slot s is page s)."""
    try:
        return cache.view(cache.shape[0] * cache.shape[1], 1, *cache.shape[2:])
    except RuntimeError as error:
        raise NotImplementedError(
            f"{PER_PATH_ENV} needs a KV cache whose blocks are contiguous runs of slots (got strides "
            f"{tuple(cache.stride())} for shape {tuple(cache.shape)}); unset it for this attention backend"
        ) from error


def per_path_attention_(query, kv: PagedKV, tree, scale: float, out: torch.Tensor, attend) -> None:
    """Overwrite the tree rows of `out` [num_tokens, Hq, D]: each node one query over its context and path.
    `attend(q [R, Hq, D], kv, slots [R, K], lengths [R], scale, max_len)` -> [R, Hq, D] is FA3 on CUDA (`fa3_attend`)
    or `reference_attend` (the CPU build, and the tests); `max_len` is the step's longest sequence (host)."""
    width, page = tree.node_mask.shape[1], kv.block_size
    # Eager steps build the rows and slots at their first layer and the others reuse them. Under CUDA-graph capture every
    # layer builds its own: a graph must contain the build (a cached tensor from an eager warm-up run, or from
    # another graph, would never be rewritten when this graph replays).
    capturing = query.is_cuda and torch.cuda.is_current_stream_capturing()
    mode = per_path_mode()
    cached = None if capturing else getattr(tree, "per_path_slots", None)
    if cached is None or cached[:2] != (page, mode):
        num_trees = tree.num_nodes.shape[0]
        req, node = node_aliases(tree.num_nodes, width)  # [T, N]
        rows = tree.query_start.to(torch.int64)[req] + node  # [T, N] scheduled-token row of each entry
        slots, lengths = node_key_slots(tree.block_table, tree.seq_lens, tree.num_nodes, tree.node_mask, page)
        if mode == "decode":  # node-major: call k's sequences are contiguous
            slots = slots.view(num_trees, width, -1).transpose(0, 1).contiguous()  # [N, T, K]
            lengths = lengths.view(num_trees, width).t().contiguous()  # [N, T]
            # An aliased entry's call may split differently from its alias's, so every entry writes its alias's
            # result: duplicate rows always carry equal values.
            owner = (node * num_trees + req).view(-1)  # [T * N] the alias's place in the node-major results
            cached = (page, mode, rows.t().contiguous(), slots, lengths, owner, rows.view(-1))
        else:
            cached = (page, mode, rows.view(-1), slots, lengths)
        if not capturing:
            tree.per_path_slots = cached
    if mode != "decode":
        _, _, rows, slots, lengths = cached
        out[rows] = attend(query[rows], kv, slots, lengths, scale, tree.max_seq_len).to(out.dtype)
        return
    # One call per node index k, the batch of a decoding step: sequence t is request t's node k (or its alias).
    _, _, node_rows, slots, lengths, owner, rows = cached  # node_rows [N, T]
    width, num_trees = node_rows.shape
    results = query.new_empty((width * num_trees, *query.shape[1:]))  # [N * T, Hq, D] node-major
    for k in range(width):
        results[k * num_trees : (k + 1) * num_trees] = attend(
            query[node_rows[k]], kv, slots[k], lengths[k], scale, tree.max_seq_len
        )
    out[rows] = results[owner].to(out.dtype)


def fa3_attend(query, kv: PagedKV, slots, lengths, scale: float, max_len: int) -> torch.Tensor:
    """vLLM's FA3 with one query per sequence, one-token pages and `slots` as the block table. FA3 splits each
    sequence's keys among thread blocks by a heuristic over the whole batch and `max_len` (the backend's own calls
    pass the step's longest sequence too), and the split changes the rounding: `VLLM_DDTREE_PER_PATH_SPLITS=n`
    fixes it (0, the default: FA3's choice), to match what decoding uses."""
    from vllm_ddtree.compat import flash_attn_varlen

    num_seqs = query.shape[0]
    cu_seqlens_q = torch.arange(num_seqs + 1, dtype=torch.int32, device=query.device)
    return flash_attn_varlen()(
        query, one_token_pages(kv.keys), one_token_pages(kv.values), max_seqlen_q=1, cu_seqlens_q=cu_seqlens_q,
        max_seqlen_k=max_len, seqused_k=lengths, causal=True, block_table=slots, softmax_scale=scale,
        fa_version=3, num_splits=per_path_splits(),
    )  # fmt: skip


def per_path_splits() -> int:
    value = os.environ.get(SPLITS_ENV, "0").strip() or "0"
    if not value.isdigit():
        raise ValueError(f"{SPLITS_ENV}={value!r} is not a whole number >= 0 (0: FlashAttention-3 chooses)")
    return int(value)


def reference_attend(query, kv: PagedKV, slots, lengths, scale: float, max_len: int = 0) -> torch.Tensor:
    """`fa3_attend` in pure torch (float32), any KV layout: query r attends to keys slots[r, :lengths[r]]."""
    from vllm_ddtree.attention.reference import masked_attention

    out = []
    for r in range(query.shape[0]):
        keys, values = kv.read(slots[r, : int(lengths[r])].to(torch.int64))  # [n, Hkv, D]
        mask = torch.ones((1, keys.shape[0]), dtype=torch.bool, device=query.device)
        out.append(masked_attention(query[r : r + 1], keys, values, mask, scale))
    return torch.cat(out)

"""Tree verification attention on the GPU: one Triton pass over the paged KV cache (context + tree nodes).

For every tree request t and KV head h, the query rows are the (node, query head of h's group) pairs, flattened
as row = node * GROUP + g, so a GQA group shares each key/value tile. Keys are read through the block table; a
key at position p < context_len is visible to every node, a key at p >= context_len is tree node j = p -
context_len and is visible to node i iff `node_mask[t, i, j]` (j is i or an ancestor of i).

Long contexts are split over `num_splits` programs per (request, head, row tile) (flash-decoding): each writes
a normalized partial output and its log-sum-exp, and `_merge_splits_kernel` combines them. With one split the
main kernel writes the output directly.

Split design (`tree_attention_split_`, used when every scheduled request is a tree and the backend is
FlashAttention-3): FA3 attends the nodes to the context alone (non-causal, returning its LSE); this kernel runs
with TREE_ONLY over the tree nodes' keys only and merges its result with FA3's by log-sum-exp before storing.

Launch safety: no host-device synchronization; all sizes come from host values the step already knows
(`TreeAttentionMetadata.plan`), so the launches can be captured in a CUDA graph for a fixed batch shape.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from vllm_ddtree.triton_jit import jit_unspecialized


@jit_unspecialized("stride_clh", "split_len", "num_splits")  # they change with the step
def _tree_attention_kernel(
    Q,  # [num_tokens, Hq, D]
    K,  # [num_blocks, page, Hkv, D] (last dim contiguous)
    V,  # [num_blocks, page, Hkv, D]
    BlockTable,  # [T, max_blocks] int32
    QueryStart,  # [T] int64, first scheduled token (the root) of each tree request
    SeqLens,  # [T] int64, context + nodes
    NumNodes,  # [T] int64, valid nodes, root included
    NodeMask,  # [T, WIDTH, WIDTH] uint8, 1 = may attend
    Out,  # [num_tokens, Hq, D]
    PartO,  # [T, Hq, WIDTH, num_splits, D] float32 (only with num_splits > 1)
    PartLse,  # [T, Hq, WIDTH, num_splits] float32, log2-sum-exp2 of each split
    CtxO,  # [num_tokens, Hq, D] attention over the context alone (TREE_ONLY), by token row
    CtxLse,  # [Hq, num_tokens] float32, its natural-log LSE (FlashAttention's layout; TREE_ONLY)
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_cot,
    stride_coh,
    stride_clh,
    qk_scale,  # softmax scale * log2(e)
    split_len,  # keys per split, a multiple of BLOCK_N
    num_splits,  # runtime, so a growing context does not recompile
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WIDTH: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    M_TILES: tl.constexpr,
    PRECISION: tl.constexpr,
    TREE_ONLY: tl.constexpr = False,  # keys of the tree nodes only, merged with (CtxO, CtxLse) (split design)
    EARLY_CONTEXT: tl.constexpr = False,  # TREE_ONLY: load (CtxO, CtxLse) before the key loop, overlapping it
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    t = pid // M_TILES
    rows = (pid % M_TILES) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    node = rows // GROUP
    head = kv_head * GROUP + rows % GROUP  # query head of each row

    num_nodes = tl.load(NumNodes + t).to(tl.int32)
    seq_len = tl.load(SeqLens + t).to(tl.int32)
    q_start = tl.load(QueryStart + t)
    ctx_len = seq_len - num_nodes
    row_ok = node < num_nodes
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    token = (q_start + node).to(tl.int64)  # [BLOCK_M]
    q = tl.load(
        Q + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]

    if TREE_ONLY and EARLY_CONTEXT:
        ctx_lse, ctx_o = _load_context_part(CtxO, CtxLse, token, head, d, row_ok, d_ok, stride_cot, stride_coh,
                                            stride_clh)  # fmt: skip

    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = BlockTable + t.to(tl.int64) * stride_bt
    mask_base = NodeMask + t.to(tl.int64) * (WIDTH * WIDTH) + node[:, None] * WIDTH  # [BLOCK_M, 1]

    # Two passes over [lo, hi): context keys (no mask), then tree keys (ancestor mask).
    for part in tl.static_range(2):
        if part == 0:
            start, end = lo, tl.minimum(hi, ctx_len)
            if TREE_ONLY:  # the context is attended elsewhere (FlashAttention), merged by LSE
                end = start
        else:
            start, end = tl.maximum(lo, ctx_len), hi
        for block_start in range(start, end, BLOCK_N):
            pos = block_start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
            key_ok = pos < end
            block = tl.load(bt_row + pos // PAGE, mask=key_ok, other=0).to(tl.int64)
            offset = (pos % PAGE).to(tl.int64)
            k = tl.load(
                K + block[:, None] * stride_kb + offset[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
                mask=key_ok[:, None] & d_ok[None, :],
                other=0.0,
            )  # [BLOCK_N, BLOCK_D]
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
            if part == 0:
                visible = key_ok[None, :] & row_ok[:, None]
            else:
                bits = tl.load(
                    mask_base + (pos - ctx_len)[None, :], mask=key_ok[None, :] & row_ok[:, None], other=0
                )
                visible = bits != 0
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(
                V + block[:, None] * stride_vb + offset[:, None] * stride_vs + kv_head * stride_vh + d[None, :],
                mask=key_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if TREE_ONLY:
        # Merge with the context part by log-sum-exp (log2 units). A valid row always sees its own key; a request
        # without context has an infinite or NaN context LSE and a context output that may be NaN: weight 0.
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))  # [BLOCK_M]
        if not EARLY_CONTEXT:
            ctx_lse, ctx_o = _load_context_part(CtxO, CtxLse, token, head, d, row_ok, d_ok, stride_cot, stride_coh,
                                                stride_clh)  # fmt: skip
        m = tl.maximum(lse, ctx_lse)
        m = tl.where(m == float("-inf"), 0.0, m)
        w_tree = tl.exp2(lse - m)
        w_ctx = tl.exp2(ctx_lse - m)
        ctx_o = tl.where(w_ctx[:, None] > 0.0, ctx_o, 0.0)
        out = (out * w_tree[:, None] + ctx_o * w_ctx[:, None]) / tl.where(row_ok, w_tree + w_ctx, 1.0)[:, None]
        tl.store(
            Out + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(Out.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    elif num_splits == 1:
        tl.store(
            Out + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(Out.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))  # [BLOCK_M]
        part_row = ((t.to(tl.int64) * NUM_Q_HEADS + head) * WIDTH + node) * num_splits + split  # [BLOCK_M]
        tl.store(PartLse + part_row, lse, mask=row_ok)
        tl.store(PartO + part_row[:, None] * HEAD_DIM + d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _load_context_part(CtxO, CtxLse, token, head, d, row_ok, d_ok, stride_cot, stride_coh, stride_clh):
    """The split design's context part of each row: (log2-unit LSE, -inf where FlashAttention saw no key [BLOCK_M];
    float32 output [BLOCK_M, BLOCK_D])."""
    ctx_lse = tl.load(CtxLse + head * stride_clh + token, mask=row_ok, other=float("-inf")) * 1.4426950408889634
    ctx_lse = tl.where(ctx_lse < float("inf"), ctx_lse, float("-inf"))
    ctx_o = tl.load(
        CtxO + token[:, None] * stride_cot + head[:, None] * stride_coh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    return ctx_lse, ctx_o


@jit_unspecialized("num_splits")
def _merge_splits_kernel(
    PartO,  # [T, Hq, WIDTH, num_splits, D] float32
    PartLse,  # [T, Hq, WIDTH, num_splits] float32
    QueryStart,  # [T] int64
    NumNodes,  # [T] int64
    Out,  # [num_tokens, Hq, D]
    stride_ot,
    stride_oh,
    num_splits,  # runtime, so a new split count does not recompile
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK_S: tl.constexpr,  # power of two >= MAX_SPLITS
):
    pid = tl.program_id(0)  # t * WIDTH + node
    head = tl.program_id(1)
    t = pid // WIDTH
    node = pid % WIDTH
    if node < tl.load(NumNodes + t):
        part_row = ((t.to(tl.int64) * NUM_Q_HEADS + head) * WIDTH + node) * num_splits
        s = tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        lse = tl.load(PartLse + part_row + s, mask=s < num_splits, other=float("-inf"))  # [BLOCK_S]
        w = tl.exp2(lse - tl.max(lse, axis=0))  # empty splits weigh 0; at least one split holds the node's own key
        o = tl.load(
            PartO + (part_row + s)[:, None] * HEAD_DIM + d[None, :],
            mask=(s < num_splits)[:, None] & (d < HEAD_DIM)[None, :],
            other=0.0,
        )  # [BLOCK_S, BLOCK_D]
        out = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
        token = tl.load(QueryStart + t) + node
        tl.store(Out + token * stride_ot + head * stride_oh + d, out.to(Out.dtype.element_ty), mask=d < HEAD_DIM)


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


MAX_SPLITS = 64


def _unused_float32(device: torch.device) -> torch.Tensor:
    """A float32 stand-in for a pointer argument a launch does not read (allocated per launch, as the split
    buffers are, so a captured graph owns it). Triton compiles one kernel per argument dtype: a stand-in of the
    output's dtype made the first step with context splits compile the kernel again while serving."""
    return torch.empty(1, dtype=torch.float32, device=device)


def plan_splits(
    num_programs: int, max_seq_len: int, block_n: int, num_sms: int, min_split: int = 256
) -> tuple[int, int]:
    """(num_splits, split_len): about two waves of programs over the SMs, each split >= `min_split` keys.

    Split counts are powers of two (<= MAX_SPLITS), so the merge kernel compiles for a handful of sizes.
    """
    max_seq_len = max(int(max_seq_len), 1)
    want = min(-(-2 * num_sms // max(num_programs, 1)), -(-max_seq_len // min_split), MAX_SPLITS)
    splits = triton.next_power_of_2(max(want, 1))
    split_len = triton.cdiv(triton.cdiv(max_seq_len, splits), block_n) * block_n
    return splits, split_len


def _launch_config(dtype: torch.dtype, head_dim: int, tree_only: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, EARLY_CONTEXT). The split path's tree-only launch reads a few tree
    keys per node: 32 x 16 blocks there (H200, session 32, Qwen3-8B's attention shape, B = 15, CUDA graphs: 27 / 57
    us at batch 8 / 32 and 1k context against 39 / 72 us with 64 x 64, which spend most of each key block on keys
    past the tree). On an H100 (session 42) no other blocks, warps, stages or EARLY_CONTEXT beat it by more than
    1.4 us (2%)."""
    if dtype == torch.float32:
        return 32, (32 if head_dim > 64 else 64), 4, 2, 0
    return (32, 16, 4, 2, 0) if tree_only else (64, 64, 4, 2, 0)


def tree_attention_triton_(
    query: torch.Tensor,  # [num_tokens, Hq, D]
    keys: torch.Tensor,  # [num_blocks, page, Hkv, D]
    values: torch.Tensor,  # [num_blocks, page, Hkv, D]
    block_table: torch.Tensor,  # [T, max_blocks] int32
    query_start: torch.Tensor,  # [T] int64
    seq_lens: torch.Tensor,  # [T] int64
    num_nodes: torch.Tensor,  # [T] int64
    node_mask: torch.Tensor,  # [T, N, N] bool or uint8
    max_seq_len: int,  # host upper bound of seq_lens (sizes the splits)
    scale: float,
    output: torch.Tensor,  # [num_tokens, Hq, D]; rows of tree nodes are overwritten
    num_splits: int | None = None,
) -> None:
    """Overwrite the tree nodes' rows of `output` with tree attention. Sync-free; see the module docstring."""
    _tree_attention(query, keys, values, block_table, query_start, seq_lens, num_nodes, node_mask, max_seq_len,
                    scale, output, num_splits=num_splits)


def tree_attention_split_(
    query: torch.Tensor,  # [num_tokens, Hq, D]
    keys: torch.Tensor,  # [num_blocks, page, Hkv, D]
    values: torch.Tensor,  # [num_blocks, page, Hkv, D]
    block_table: torch.Tensor,  # [T, max_blocks] int32
    query_start: torch.Tensor,  # [T] int64
    seq_lens: torch.Tensor,  # [T] int64
    num_nodes: torch.Tensor,  # [T] int64
    node_mask: torch.Tensor,  # [T, N, N] bool or uint8
    max_seq_len: int,
    scale: float,
    context_out: torch.Tensor,  # [num_tokens, Hq, D] every node's attention over its request's context alone
    context_lse: torch.Tensor,  # [Hq, num_tokens] float32, natural-log LSE of that (FlashAttention's layout)
    output: torch.Tensor,  # [num_tokens, Hq, D]; rows of tree nodes are overwritten
    launch: tuple[int, ...] | None = None,  # a prefix of `_launch_config`'s tuple for an A/B (bench_attention)
) -> None:
    """Split tree attention: the context part comes from FlashAttention (non-causal over the context, with LSE);
    this adds the tree part (each node over its ancestors' keys, a few keys per node) and merges the two by
    log-sum-exp in the same kernel. One launch; sync-free."""
    assert context_out.stride(2) == 1 and context_lse.stride(1) == 1
    _tree_attention(query, keys, values, block_table, query_start, seq_lens, num_nodes, node_mask, max_seq_len,
                    scale, output, context=(context_out, context_lse), launch=launch)


def _tree_attention(
    query, keys, values, block_table, query_start, seq_lens, num_nodes, node_mask, max_seq_len: int, scale: float,
    output, num_splits: int | None = None, context: tuple[torch.Tensor, torch.Tensor] | None = None,
    launch: tuple[int, ...] | None = None,
) -> None:
    """Both entry points: one pass over context + tree keys (context None), split over the context in
    `num_splits` programs when that pays; or the tree keys only, merged with `context` = (out, natural-log LSE)."""
    num_trees, width = node_mask.shape[0], node_mask.shape[1]
    if num_trees == 0:
        return
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, page = keys.shape[2], keys.shape[1]
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    assert query.stride(2) == 1 and keys.stride(3) == 1 and values.stride(3) == 1 and output.stride(2) == 1
    group = num_q_heads // num_kv_heads
    tree_only = context is not None
    default = _launch_config(query.dtype, head_dim, tree_only)
    block_m, block_n, num_warps, num_stages, early_context = (*(launch or ()), *default[len(launch or ()):])
    m_tiles = triton.cdiv(width * group, block_m)
    if tree_only:  # one split covers every key (only the few tree keys are read)
        num_splits, split_len = 1, triton.cdiv(max(int(max_seq_len), 1), block_n) * block_n
    elif num_splits is None:
        num_sms = _num_sms(query.device.index or 0) if query.is_cuda else 4  # CPU: Triton's interpreter
        num_splits, split_len = plan_splits(num_trees * m_tiles * num_kv_heads, max_seq_len, block_n, num_sms)
    else:
        split_len = triton.cdiv(triton.cdiv(max(max_seq_len, 1), num_splits), block_n) * block_n
    assert 1 <= num_splits <= MAX_SPLITS, num_splits  # the merge kernel reads up to MAX_SPLITS splits
    partial = num_splits > 1 and not tree_only  # the kernel writes (out, lse) per split, a merge writes `output`
    if partial:
        part_o = torch.empty((num_trees, num_q_heads, width, num_splits, head_dim), dtype=torch.float32,
                             device=query.device)
        part_lse = torch.empty((num_trees, num_q_heads, width, num_splits), dtype=torch.float32, device=query.device)
    else:  # unused; float32 like the used ones, so every split count launches the same compiled kernel
        part_o = part_lse = _unused_float32(query.device)
    mask = node_mask.view(torch.uint8) if node_mask.dtype == torch.bool else node_mask
    block_d = triton.next_power_of_2(head_dim)
    context_out, context_lse = context if tree_only else (output, _unused_float32(query.device))  # both unused
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    _tree_attention_kernel[(num_trees * m_tiles, num_kv_heads, num_splits)](
        query, keys, values, block_table, query_start, seq_lens, num_nodes, mask.contiguous(), output, part_o,
        part_lse, context_out, context_lse,
        query.stride(0), query.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        block_table.stride(0),
        output.stride(0), output.stride(1),
        context_out.stride(0), context_out.stride(1), context_lse.stride(0),
        scale * 1.4426950408889634, split_len, num_splits,
        NUM_Q_HEADS=num_q_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, WIDTH=width, PAGE=page,
        BLOCK_M=block_m, BLOCK_N=block_n, M_TILES=m_tiles, PRECISION=precision, TREE_ONLY=tree_only,
        EARLY_CONTEXT=bool(early_context), num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if partial:
        _merge_splits_kernel[(num_trees * width, num_q_heads)](
            part_o, part_lse, query_start, num_nodes, output, output.stride(0), output.stride(1), num_splits,
            NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, WIDTH=width,
            BLOCK_S=triton.next_power_of_2(MAX_SPLITS), num_warps=4,
        )  # fmt: skip

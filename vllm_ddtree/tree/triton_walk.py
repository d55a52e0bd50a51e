"""The tree walk in one Triton launch: the GPU path of `walk.walk_tree`.

One program per request follows the sequential rule: from the root, move to the valid child whose token is the
target's choice at the current node, until there is none; the bonus token is the target's choice at the last
accepted node. Siblings carry distinct tokens, so at most one child matches. Same outputs as the batched torch
walk (pointer doubling, ~2 ms of launches at batch 1 on the H200); checked against it in Triton's interpreter
(tests/unit/test_tree_build_triton.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_ddtree.kv.triton_compact import copy_kv_slot, layer_slot_offsets
from vllm_ddtree.triton_jit import jit_unspecialized


# The KV layout constants of a launch that moves no KV (any values compile; COMPACT=False never reads them).
_NO_COPY = dict(PAGE=1, NUM_HEADS=1, HEAD_DIM=1, BLOCK_H=1, BLOCK_HD=1, COPY_TYPE=tl.int8)


@triton.jit
def _target_choice(target_ptr, node_rows_ptr, entry, ok, GATHER: tl.constexpr):
    """The target's choice at node entry `entry` (= req * N + node) as int64, -1 where not `ok`."""
    if GATHER:
        row = tl.load(node_rows_ptr + entry, mask=ok, other=0)
        return tl.load(target_ptr + row, mask=ok, other=-1).to(tl.int64)
    return tl.load(target_ptr + entry, mask=ok, other=-1).to(tl.int64)


@jit_unspecialized()
def _walk_kernel(
    token_ptr,  # [R, N] int64 node tokens; GATHER: [num_tokens] the step's input ids, read at node_index
    parent_ptr,  # [R, N] int64, -1 for the root
    target_ptr,  # [R, N] int64 the target's choice at every node; GATHER: [rows] per logits row, read at node_rows
    node_rows_ptr,  # [R, N] int64 (GATHER) each node's logits row
    num_nodes_ptr,  # [R] int64 valid nodes per request (a prefix of the node list)
    path_ptr,  # [R, D+1] int64 out: node at each depth of the path, -1 after its end
    num_accepted_ptr,  # [R] int64 out
    output_ptr,  # [R, D+1] int64 out: accepted tokens, then the bonus token, -1 padded
    node_index_ptr,  # [R, N] int64 (MOVES) each node's index among the step's scheduled tokens
    num_laid_out_ptr,  # [R] int64 (MOVES) nodes laid out in the step (>= num_nodes; padding aliases the last)
    src_ptr,  # [R, M] int64 out (MOVES): scheduled-token index whose row moves ...
    dst_ptr,  # [R, M] int64 out (MOVES): ... to this index (src == dst: nothing moves)
    sampled_ptr,  # [R, W] int32 out (MOVES): `output` cut or -1 padded to W columns (vLLM's sampler format)
    positions_ptr,  # [num_tokens] int64 in/out (MOVES): node i laid out gets root position + i again (chain order)
    layer_base_ptr,  # [L] int64 (COMPACT) address of each target layer's key cache (kv.triton_compact.LayerTable)
    slot_mapping_ptr,  # [num_tokens] integer (COMPACT) the KV slot of each scheduled token
    stride_b,  # (COMPACT) element strides of a layer's [num_blocks, block_size, H, D] key view, values' offset
    stride_s,
    stride_h,
    v_offset,
    N,
    D,
    M,  # min(D, W - 1)
    W,
    BLOCK: tl.constexpr,  # power of two >= N
    MOVES: tl.constexpr,
    GATHER: tl.constexpr,  # tokens and choices read through node_index / node_rows (needs MOVES)
    BLOCK_D: tl.constexpr,  # power of two >= D + 1
    BLOCK_M: tl.constexpr,  # power of two >= M
    COMPACT: tl.constexpr,  # program (req, layer) also moves the accepted path's KV in that layer (needs MOVES)
    PAGE: tl.constexpr,  # (COMPACT) the KV layout: `LayerTable.copy_constants`
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HD: tl.constexpr,
    COPY_TYPE: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    # With COMPACT every layer's program of a request walks its tree; the first one writes the walk's outputs.
    first = tl.program_id(1) == 0
    cols = tl.arange(0, BLOCK)
    valid = cols < tl.load(num_nodes_ptr + req)
    if GATHER:
        token_index = tl.load(node_index_ptr + req * N + cols, mask=valid, other=0)
        tokens = tl.load(token_ptr + token_index, mask=valid, other=-1).to(tl.int64)
    else:
        tokens = tl.load(token_ptr + req * N + cols, mask=valid, other=-1)
    parents = tl.load(parent_ptr + req * N + cols, mask=valid, other=-2).to(tl.int32)
    tl.store(path_ptr + req * (D + 1), 0, mask=first)
    depths = tl.arange(0, BLOCK_D)
    path = tl.where(depths == 0, 0, -1)  # [BLOCK_D] the path so far, kept for the moves
    node = tl.program_id(0) * 0  # current node (the root), -1 once the walk has ended; int32
    accepted = node
    for depth in range(1, D + 1):
        choice = _target_choice(target_ptr, node_rows_ptr, req * N + node, node >= 0, GATHER)
        match = valid & (parents == node) & (tokens == choice) & (node >= 0)
        child = tl.max(tl.where(match, cols, -1), axis=0)  # -1: no child carries the target's choice
        tl.store(path_ptr + req * (D + 1) + depth, child.to(tl.int64), mask=first)
        # An accepted child's token, or the bonus token where the walk stops (the choice at the last node).
        tl.store(output_ptr + req * (D + 1) + depth - 1, choice, mask=first)
        if MOVES:
            path = tl.where(depths == depth, child, path)
            tl.store(sampled_ptr + req * W + depth - 1, choice.to(tl.int32), mask=first & (depth - 1 < W))
        accepted += (child >= 0).to(tl.int32)
        node = child
    # Every depth accepted: the bonus token is the choice at the deepest node.
    last = _target_choice(target_ptr, node_rows_ptr, req * N + node, node >= 0, GATHER)
    tl.store(output_ptr + req * (D + 1) + D, last, mask=first)
    tl.store(num_accepted_ptr + req, accepted.to(tl.int64), mask=first)
    if MOVES:
        tl.store(sampled_ptr + req * W + D, last.to(tl.int32), mask=first & (D < W))
        for pad in range(D + 1, W):
            tl.store(sampled_ptr + req * W + pad, -1, mask=first)
        # Move i (depth i = 1..M): the node laid out at index i (clamped to the last laid-out node) receives the
        # path's depth-i node where the path is that deep (the same rule as verify.scorer.accepted_path_moves).
        moves = tl.arange(0, BLOCK_M)
        in_moves = moves < M
        index = tl.maximum(tl.minimum(moves + 1, tl.load(num_laid_out_ptr + req).to(tl.int32) - 1), 0)
        path_at = tl.sum(tl.where(depths[None, :] == index[:, None], path[None, :], 0), axis=1)  # [BLOCK_M]
        src_node = tl.where((index <= accepted) & (path_at >= 0), path_at, index)
        src = tl.load(node_index_ptr + req * N + src_node, mask=in_moves, other=0)
        dst = tl.load(node_index_ptr + req * N + index, mask=in_moves, other=0)
        first_moves = (tl.program_id(1) + moves * 0) == 0  # `first` as a block (Triton's interpreter needs one)
        tl.store(src_ptr + req * M + moves, src, mask=first_moves & in_moves)
        tl.store(dst_ptr + req * M + moves, dst, mask=first_moves & in_moves)
        # Positions back in chain order for the drafter (verify.step.chain_positions_): root + laid-out index.
        laid_out_index = tl.minimum(cols, tl.load(num_laid_out_ptr + req).to(tl.int32) - 1)
        first_cols = (tl.program_id(1) + cols * 0) == 0
        token = tl.load(node_index_ptr + req * N + cols, mask=first_cols & (cols < N), other=0)
        root_position = tl.load(positions_ptr + tl.load(node_index_ptr + req * N), mask=first, other=0)
        tl.store(positions_ptr + token, root_position + laid_out_index, mask=first_cols & (cols < N))
        if COMPACT:  # the moves in order, in this program's layer (kv.triton_compact: why in order is safe)
            layer = tl.program_id(1)
            base = tl.load(layer_base_ptr + layer).to(tl.pointer_type(COPY_TYPE))
            inner, ok = layer_slot_offsets(NUM_HEADS, HEAD_DIM, BLOCK_H, BLOCK_HD, stride_h)
            for m in range(M):
                src_slot = tl.load(slot_mapping_ptr + tl.sum(tl.where(moves == m, src, 0))).to(tl.int64)
                dst_slot = tl.load(slot_mapping_ptr + tl.sum(tl.where(moves == m, dst, 0))).to(tl.int64)
                copy_kv_slot(base, src_slot, dst_slot, inner, ok, stride_b, stride_s, v_offset, PAGE)


def walk_tree_triton(token_ids, parents, target_token_ids, num_nodes, max_depth: int):
    """(path_nodes [R, D+1], num_accepted [R], output_token_ids [R, D+1]) as in `walk.walk_tree`."""
    return _walk(token_ids, parents, target_token_ids, num_nodes, max_depth)[:3]


def walk_and_moves_triton_(
    input_ids: torch.Tensor,  # [num_tokens] the step's scheduled tokens
    parents: torch.Tensor,  # [R, N]
    node_choices: torch.Tensor,  # [rows] the target's choice at every logits row
    num_nodes: torch.Tensor,  # [R] nodes the walk may accept
    max_depth: int,
    node_index: torch.Tensor,  # [R, N] each node's index among the scheduled tokens
    node_rows: torch.Tensor,  # [R, N] each node's logits row
    num_laid_out: torch.Tensor,  # [R] nodes laid out in the step
    positions: torch.Tensor,  # [num_tokens], put back in chain order
    kv: tuple | None = None,  # (LayerTable, [num_tokens] slot mapping): also move the accepted paths' KV
):
    """`walk_tree_triton`'s outputs, then the accepted path's moves (src, dst) [R, M] and the sampler output
    [R, N] int32, with `positions` put back in chain order, in the same launch: the GPU path of
    `verify.scorer.walk_and_moves_`. Node tokens and choices are read through node_index / node_rows in the kernel
    (two gathers fewer on the host per step). With `kv` the launch also does `kv.compact.compact_accepted_kv_`'s
    work for those layers (one program per request and layer; one launch fewer on the host per step)."""
    return _walk(input_ids, parents, node_choices, num_nodes, max_depth, node_index, num_laid_out, positions,
                 node_rows, kv)  # fmt: skip


def _walk(
    token_ids, parents, target_token_ids, num_nodes, max_depth: int, node_index=None, num_laid_out=None,
    positions=None, node_rows=None, kv=None,
):
    num_req, n = parents.shape
    device = parents.device
    path = torch.empty(num_req, max_depth + 1, dtype=torch.int64, device=device)
    output = torch.empty_like(path)
    num_accepted = torch.empty(num_req, dtype=torch.int64, device=device)
    moves = node_index is not None
    gather = node_rows is not None
    num_moves = min(max_depth, n - 1)
    src = torch.empty(num_req, num_moves if moves else 0, dtype=torch.int64, device=device)
    dst = torch.empty_like(src)
    sampled = torch.empty(num_req, n if moves else 0, dtype=torch.int32, device=device)
    if kv is not None:
        assert moves, "the KV compaction needs the moves"
        table, slot_mapping = kv
        layers, copy_args, copy_constants = len(table.key_ptrs), table.copy_args, table.copy_constants
    else:
        table, slot_mapping, layers, copy_args, copy_constants = None, None, 1, (0, 0, 0, 0), _NO_COPY
    if num_req:
        _walk_kernel[(num_req, layers)](
            token_ids.contiguous(), parents.contiguous(), target_token_ids.contiguous(),
            node_rows.contiguous() if gather else path, num_nodes.contiguous(), path, num_accepted, output,
            node_index.contiguous() if moves else path, num_laid_out.contiguous() if moves else num_accepted,
            src, dst, sampled, positions if moves else path, path if table is None else table.base,
            path if slot_mapping is None else slot_mapping.contiguous(), *copy_args, n, max_depth, num_moves, n,
            BLOCK=triton.next_power_of_2(n), MOVES=moves, GATHER=gather,
            BLOCK_D=triton.next_power_of_2(max_depth + 1), BLOCK_M=triton.next_power_of_2(max(num_moves, 1)),
            COMPACT=kv is not None, **copy_constants,
        )  # fmt: skip
    return path, num_accepted, output, src, dst, sampled

"""Ancestor (tree-attention) masks in one Triton launch: the GPU path of `layout.ancestor_mask`.

The torch version doubles pointers (ceil(log2 N) rounds of gathers: ~2 ms of launches at batch 1 on the H200).
Here one program per (request, node) follows the node's parent chain and writes its mask row;
`padded_tree_inputs_triton_` does the same into the FULL-graph buffers and adds node counts and context lengths;
`uniform_step_inputs_triton_` also lays out a uniform step (parents, depths, positions) from the trees kept by
request slot, reading only fixed-address buffers, so it can run inside the target's FULL CUDA graph.
Checked against the torch versions in Triton's interpreter (tests/unit/test_tree_build_triton.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_ddtree.triton_jit import jit_unspecialized


@triton.jit
def _ancestor_row(parents_ptr, req, node, N, cols):
    """[BLOCK] bool: cols == node or cols is an ancestor of node (request `req` of parents [R, N])."""
    row = cols == node
    ancestor = tl.load(parents_ptr + req * N + node).to(tl.int32)
    while ancestor >= 0:  # depth-many steps (parents[i] < i in DDTree trees, so the chain ends)
        row = row | (cols == ancestor)
        ancestor = tl.load(parents_ptr + req * N + ancestor).to(tl.int32)
    return row


@jit_unspecialized()
def _ancestor_mask_kernel(
    parents_ptr,  # [R, N] int64, -1 for the root
    mask_ptr,  # [R, N, N] bool (as int8)
    N,
    BLOCK: tl.constexpr,  # power of two >= N
):
    req = tl.program_id(0).to(tl.int64)
    node = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    row = _ancestor_row(parents_ptr, req, node, N, cols)
    tl.store(mask_ptr + (req * N + node) * N + cols, row.to(tl.int8), mask=cols < N)


@jit_unspecialized()
def _padded_tree_inputs_kernel(
    parents_ptr,  # [R, N] int64, -1 for the root
    num_nodes_ptr,  # [R] int64
    seq_lens_ptr,  # [P] int32, context + nodes of every (padded) request
    mask_ptr,  # [P, N, N] uint8 out: ancestor masks, zero rows for padding requests
    num_nodes_out_ptr,  # [P] int32 out: num_nodes, 0 for padding requests
    context_lens_ptr,  # [P] int32 out: seq_lens - num_nodes
    num_reqs,
    N,
    BLOCK: tl.constexpr,  # power of two >= N
):
    req = tl.program_id(0).to(tl.int64)
    node = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    real = req < num_reqs
    if real:
        row = _ancestor_row(parents_ptr, req, node, N, cols)
    else:
        row = cols < 0
    tl.store(mask_ptr + (req * N + node) * N + cols, row.to(tl.uint8), mask=cols < N)
    if node == 0:
        num_nodes = tl.load(num_nodes_ptr + req, mask=real, other=0).to(tl.int32)
        tl.store(num_nodes_out_ptr + req, num_nodes)
        tl.store(context_lens_ptr + req, tl.load(seq_lens_ptr + req) - num_nodes)


@jit_unspecialized()
def _uniform_step_inputs_kernel(
    slots_ptr,  # [P] int64: request slot (a kept tree), -2 (a chain: a prefill chunk of n tokens), -1 (padding)
    kept_parents_ptr,  # [S, N] int64 the trees kept by request slot, -1 for the root
    kept_depths_ptr,  # [S, N] int64
    seq_lens_ptr,  # [P] int32, context + nodes of every (padded) request
    positions_ptr,  # [P * n] int64 in/out: chain positions in, root position + depth out (kept trees)
    parents_ptr,  # [P, N] int64 out: the step's parents (real requests)
    depths_ptr,  # [P, N] int64 out: depth of the padded node index (real requests)
    mask_ptr,  # [P, N, N] uint8 out: ancestor masks, zero rows for padding requests
    num_nodes_out_ptr,  # [P] int32 out: n, 0 for padding requests
    context_lens_ptr,  # [P] int32 out: seq_lens - num_nodes
    n,  # nodes per request, root included (<= N)
    N,
    BLOCK: tl.constexpr,  # power of two >= N
):
    req = tl.program_id(0).to(tl.int64)
    node = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    slot = tl.load(slots_ptr + req)
    real = slot != -1
    padded_node = tl.minimum(node, n - 1)  # a padded node aliases node n - 1
    if slot >= 0:  # a kept tree
        row = _ancestor_row(kept_parents_ptr, slot, node, N, cols)
        depth = tl.load(kept_depths_ptr + slot * N + padded_node)
        tl.store(parents_ptr + req * N + node, tl.load(kept_parents_ptr + slot * N + node))
        tl.store(depths_ptr + req * N + node, depth)
        if node > 0 and node < n:  # other programs write node 0's token: the root keeps its position
            root_position = tl.load(positions_ptr + req * n)
            tl.store(positions_ptr + req * n + node, root_position + depth)
    else:  # a chain (its positions stay), or a padding request (nothing but zero masks and counts)
        row = (cols <= node) & real
        if real:
            tl.store(parents_ptr + req * N + node, (node - 1).to(tl.int64))
            tl.store(depths_ptr + req * N + node, padded_node.to(tl.int64))
    tl.store(mask_ptr + (req * N + node) * N + cols, row.to(tl.uint8), mask=cols < N)
    if node == 0:
        num_nodes = tl.where(real, n, 0).to(tl.int32)
        tl.store(num_nodes_out_ptr + req, num_nodes)
        tl.store(context_lens_ptr + req, tl.load(seq_lens_ptr + req) - num_nodes)


def ancestor_mask_triton(parents: torch.Tensor) -> torch.Tensor:
    """mask[r, i, j] is True iff j == i or j is an ancestor of i. parents: [R, N] int64 -> [R, N, N] bool."""
    num_req, n = parents.shape
    mask = torch.empty(num_req, n, n, dtype=torch.bool, device=parents.device)
    if num_req and n:
        _ancestor_mask_kernel[(num_req, n)](
            parents.contiguous(), mask.view(torch.int8), n, BLOCK=triton.next_power_of_2(n)
        )
    return mask


def padded_tree_inputs_triton_(
    parents: torch.Tensor,  # [R, N] int64
    num_nodes: torch.Tensor,  # [R] int64
    seq_lens: torch.Tensor,  # [P] int32, P >= R
    node_mask: torch.Tensor,  # [P, N, N] uint8 out
    num_nodes_out: torch.Tensor,  # [P] int32 out
    context_lens: torch.Tensor,  # [P] int32 out
) -> None:
    """The FULL-graph tree inputs in one launch: ancestor masks, node counts and context lengths of R requests,
    zero masks and counts for the P - R padding requests (the kernels skip 0-node requests)."""
    padded, width = node_mask.shape[0], node_mask.shape[1]
    if padded:
        _padded_tree_inputs_kernel[(padded, width)](
            parents.contiguous(), num_nodes, seq_lens, node_mask, num_nodes_out, context_lens, parents.shape[0],
            width, BLOCK=triton.next_power_of_2(width),
        )  # fmt: skip


def uniform_step_inputs_triton_(
    slots: torch.Tensor,  # [P] int64: request slot, -2 (a chain), -1 (padding)
    kept_parents: torch.Tensor,  # [S, N] int64
    kept_depths: torch.Tensor,  # [S, N] int64
    seq_lens: torch.Tensor,  # [P] int32
    positions: torch.Tensor,  # [P * n] int64, updated in place
    parents: torch.Tensor,  # [P, N] int64 out
    depths: torch.Tensor,  # [P, N] int64 out
    node_mask: torch.Tensor,  # [P, N, N] uint8 out
    num_nodes_out: torch.Tensor,  # [P] int32 out
    context_lens: torch.Tensor,  # [P] int32 out
    num_nodes: int,  # n
) -> None:
    """A uniform verification step's layout and FULL-graph tree inputs in one launch (`verify.step.
    uniform_step_inputs_`)."""
    padded, width = node_mask.shape[0], node_mask.shape[1]
    if padded:
        _uniform_step_inputs_kernel[(padded, width)](
            slots, kept_parents, kept_depths, seq_lens, positions, parents, depths, node_mask, num_nodes_out,
            context_lens, num_nodes, width, BLOCK=triton.next_power_of_2(width),
        )  # fmt: skip

"""Ancestor (tree-attention) masks in one Triton launch: the GPU path of `layout.ancestor_mask`.

The torch version doubles pointers (ceil(log2 N) rounds of gathers: ~2 ms of launches at batch 1 on the H200).
Here one program per (request, node) follows the node's parent chain and writes its mask row. Checked against
the torch version in Triton's interpreter (tests/unit/test_tree_build_triton.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _ancestor_mask_kernel(
    parents_ptr,  # [R, N] int64, -1 for the root
    mask_ptr,  # [R, N, N] bool (as int8)
    N,
    BLOCK: tl.constexpr,  # power of two >= N
):
    req = tl.program_id(0).to(tl.int64)
    node = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    row = cols == node
    ancestor = tl.load(parents_ptr + req * N + node).to(tl.int32)
    while ancestor >= 0:  # depth-many steps (parents[i] < i in DDTree trees, so the chain ends)
        row = row | (cols == ancestor)
        ancestor = tl.load(parents_ptr + req * N + ancestor).to(tl.int32)
    tl.store(mask_ptr + (req * N + node) * N + cols, row.to(tl.int8), mask=cols < N)


def ancestor_mask_triton(parents: torch.Tensor) -> torch.Tensor:
    """mask[r, i, j] is True iff j == i or j is an ancestor of i. parents: [R, N] int64 -> [R, N, N] bool."""
    num_req, n = parents.shape
    mask = torch.empty(num_req, n, n, dtype=torch.bool, device=parents.device)
    if num_req and n:
        _ancestor_mask_kernel[(num_req, n)](
            parents.contiguous(), mask.view(torch.int8), n, BLOCK=triton.next_power_of_2(n)
        )
    return mask

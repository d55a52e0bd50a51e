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


@triton.jit
def _walk_kernel(
    token_ptr,  # [R, N] int64 node tokens
    parent_ptr,  # [R, N] int64, -1 for the root
    target_ptr,  # [R, N] int64 the target's choice at every node
    num_nodes_ptr,  # [R] int64 valid nodes per request (a prefix of the node list)
    path_ptr,  # [R, D+1] int64 out: node at each depth of the path, -1 after its end
    num_accepted_ptr,  # [R] int64 out
    output_ptr,  # [R, D+1] int64 out: accepted tokens, then the bonus token, -1 padded
    N,
    D,
    BLOCK: tl.constexpr,  # power of two >= N
):
    req = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    valid = cols < tl.load(num_nodes_ptr + req)
    tokens = tl.load(token_ptr + req * N + cols, mask=valid, other=-1)
    parents = tl.load(parent_ptr + req * N + cols, mask=valid, other=-2).to(tl.int32)
    tl.store(path_ptr + req * (D + 1), 0)
    node = tl.program_id(0) * 0  # current node (the root), -1 once the walk has ended; int32
    accepted = node
    for depth in range(1, D + 1):
        choice = tl.load(target_ptr + req * N + node, mask=node >= 0, other=-1)
        match = valid & (parents == node) & (tokens == choice) & (node >= 0)
        child = tl.max(tl.where(match, cols, -1), axis=0)  # -1: no child carries the target's choice
        tl.store(path_ptr + req * (D + 1) + depth, child.to(tl.int64))
        # An accepted child's token, or the bonus token where the walk stops (the choice at the last node).
        tl.store(output_ptr + req * (D + 1) + depth - 1, choice)
        accepted += (child >= 0).to(tl.int32)
        node = child
    # Every depth accepted: the bonus token is the choice at the deepest node.
    tl.store(output_ptr + req * (D + 1) + D, tl.load(target_ptr + req * N + node, mask=node >= 0, other=-1))
    tl.store(num_accepted_ptr + req, accepted.to(tl.int64))


def walk_tree_triton(token_ids, parents, target_token_ids, num_nodes, max_depth: int):
    """(path_nodes [R, D+1], num_accepted [R], output_token_ids [R, D+1]) as in `walk.walk_tree`."""
    num_req, n = token_ids.shape
    path = torch.empty(num_req, max_depth + 1, dtype=torch.int64, device=token_ids.device)
    output = torch.empty_like(path)
    num_accepted = torch.empty(num_req, dtype=torch.int64, device=token_ids.device)
    if num_req:
        _walk_kernel[(num_req,)](
            token_ids.contiguous(), parents.contiguous(), target_token_ids.contiguous(), num_nodes.contiguous(),
            path, num_accepted, output, n, max_depth, BLOCK=triton.next_power_of_2(n),
        )
    return path, num_accepted, output

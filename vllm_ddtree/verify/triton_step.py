"""A verification step's device layout in one Triton launch: the GPU path of `step.build_tree_step`'s tensor part
and `step.tree_positions_`.

One program per request writes its [N] row of parents, depths (of the padded node index) and scheduled-token
indices, and gives its nodes the positions root position + depth. The torch version is ~15 small launches (index
gathers, scatters, casts); this is one. Same outputs, checked in Triton's interpreter against the torch version
(tests/unit/test_tree_build_triton.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_ddtree.triton_jit import jit_unspecialized


@jit_unspecialized()
def _tree_step_layout_kernel(
    num_nodes_ptr,  # [R] int64 nodes scheduled per request, root included
    node_rows_ptr,  # [R, N] int64 logits row of each (padded) node
    kept_row_ptr,  # [R] int64 row of the request's kept tree in prev_*, -1: none (a chain if it has drafts)
    prev_parents_ptr,  # [R_prev, N] int64 (not read where kept_row is -1)
    prev_depths_ptr,  # [R_prev, N] int64
    logits_indices_ptr,  # [rows] int32/int64 scheduled-token index of each logits row
    positions_ptr,  # [num_tokens] int64 in/out (SET_POSITIONS): root position + depth for every node
    parents_ptr,  # [R, N] int64 out, -1 for the root
    depths_ptr,  # [R, N] int64 out: depth of the padded node index
    node_token_index_ptr,  # [R, N] int64 out
    N,
    BLOCK: tl.constexpr,  # power of two >= N
    SET_POSITIONS: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    in_row = cols < N
    num_nodes = tl.load(num_nodes_ptr + req)
    node = tl.minimum(cols, num_nodes - 1)  # a padded entry aliases the last valid node
    kept_row = tl.load(kept_row_ptr + req)
    kept = in_row & (cols * 0 + kept_row >= 0)  # [BLOCK] (a vector mask: the interpreter refuses scalar & vector)
    base = tl.maximum(kept_row, 0) * N
    kept_parents = tl.load(prev_parents_ptr + base + cols, mask=kept, other=0)
    kept_depths = tl.load(prev_depths_ptr + base + node, mask=kept, other=0)
    has_drafts = num_nodes > 1  # without a kept tree: a chain (placeholder drafts); no drafts: root only
    parents = tl.where(kept, kept_parents, tl.where(has_drafts, cols - 1, -1).to(tl.int64))
    depths = tl.where(kept, kept_depths, tl.where(has_drafts, node, 0).to(tl.int64))
    rows = tl.load(node_rows_ptr + req * N + cols, mask=in_row, other=0)
    token_index = tl.load(logits_indices_ptr + rows, mask=in_row, other=0).to(tl.int64)
    out = req * N + cols
    tl.store(parents_ptr + out, parents, mask=in_row)
    tl.store(depths_ptr + out, depths, mask=in_row)
    tl.store(node_token_index_ptr + out, token_index, mask=in_row)
    if SET_POSITIONS:
        root_index = tl.load(logits_indices_ptr + tl.load(node_rows_ptr + req * N)).to(tl.int64)
        root_position = tl.load(positions_ptr + root_index)
        # The root's own entry writes back its position (depth 0), so the read above cannot race with it.
        tl.store(positions_ptr + token_index, root_position + depths, mask=in_row)


def tree_step_layout_triton_(
    num_nodes: torch.Tensor,  # [R] int64
    node_rows: torch.Tensor,  # [R, N] int64
    kept_rows: torch.Tensor,  # [R] int64, -1: no kept tree
    prev_parents: torch.Tensor | None,  # [R_prev, N] int64
    prev_depths: torch.Tensor | None,  # [R_prev, N] int64
    logits_indices: torch.Tensor,  # [rows] int32/int64
    positions: torch.Tensor | None,  # [num_tokens] int64, updated in place (None: left alone)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(parents, depths, node_token_index), each [R, N] int64; positions of the nodes set to root + depth."""
    num_reqs, width = node_rows.shape
    parents = torch.empty((num_reqs, width), dtype=torch.int64, device=node_rows.device)
    depths = torch.empty_like(parents)
    node_token_index = torch.empty_like(parents)
    if prev_parents is None or prev_depths is None:  # no request has a kept tree: never read
        prev_parents = prev_depths = parents
    if num_reqs:
        _tree_step_layout_kernel[(num_reqs,)](
            num_nodes, node_rows, kept_rows, prev_parents.contiguous(), prev_depths.contiguous(), logits_indices,
            positions if positions is not None else parents, parents, depths, node_token_index, width,
            BLOCK=triton.next_power_of_2(width), SET_POSITIONS=positions is not None,
        )  # fmt: skip
    return parents, depths, node_token_index

"""DDTree's best-first heap as one Triton program per request: the GPU path of `build_draft_tree`.

The torch builder (build.py) runs a depth-by-depth beam: ~15 small kernels per depth, launch-bound at batch 1
(9.3 ms for D = 15 on the H200). Here the whole selection is one launch: each program keeps its request's heap
frontier in registers and pops `budget` times. A popped prefix pushes its next sibling (same parent, next rank)
and its first child (top token one depth deeper), so every prefix has one predecessor and is pushed once; the
frontier never holds more than budget + 1 entries.

The pop order is build.py's total order: score descending, then depth ascending, then (same depth) the parent's
node index, then the token's rank. Scores are computed as in build.py (parent's score + this depth's log-prob, one
float32 add), so both builders give identical trees (tests/unit/test_tree_build_triton.py runs this kernel in
Triton's interpreter against the torch builder).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_ddtree.triton_jit import jit_unspecialized


@jit_unspecialized()
def _best_first_kernel(
    lp_ptr,  # [R, D, K] float32 per-depth top-K log-probs, non-increasing along K
    tok_ptr,  # [R, D, K] int64 their token ids
    root_ptr,  # [R] root tokens ([S] by request slot with BY_SLOT)
    rows_ptr,  # [R] request slot of each request (BY_SLOT only)
    out_tok_ptr,  # [R, N] int64
    out_parent_ptr,  # [R, N] int64 ([S, N] by request slot with BY_SLOT)
    out_depth_ptr,  # [R, N] int64 ([S, N] by request slot with BY_SLOT)
    out_lp_ptr,  # [R, N] float32
    D,
    K,
    N,
    FRONTIER: tl.constexpr,  # power of two >= N
    BY_SLOT: tl.constexpr,  # parents, depths and the root token by request slot (Model Runner V2's kept trees)
):
    req = tl.program_id(0).to(tl.int64)
    lp_base = lp_ptr + req * D * K
    tok_base = tok_ptr + req * D * K
    out = req * N
    kept_row = req
    if BY_SLOT:
        kept_row = tl.load(rows_ptr + req).to(tl.int64)
    kept = kept_row * N
    slot = tl.arange(0, FRONTIER)

    # Frontier entry: a prefix not yet popped = (depth, rank of its last token, parent node, parent's score).
    first = slot == 0
    f_valid = first
    f_depth = tl.where(first, 1, 0)
    f_rank = tl.zeros([FRONTIER], dtype=tl.int32)
    f_parent = tl.zeros([FRONTIER], dtype=tl.int32)
    f_parent_score = tl.zeros([FRONTIER], dtype=tl.float32)
    f_score = tl.where(first, 0.0 + tl.load(lp_base), 0.0)
    size = tl.program_id(0) * 0 + 1  # int32 like its updates (a loop-carried value keeps one type)

    tl.store(out_tok_ptr + out, tl.load(root_ptr + kept_row).to(tl.int64))
    tl.store(out_parent_ptr + kept, -1)
    tl.store(out_depth_ptr + kept, 0)
    tl.store(out_lp_ptr + out, 0.0)

    for node in range(1, N):
        best = tl.max(tl.where(f_valid, f_score, float("-inf")), axis=0)
        tie = f_valid & (f_score == best)
        order = f_depth * (N * K) + f_parent * K + f_rank  # unique per prefix; the tie-break
        pick = tie & (order == tl.min(tl.where(tie, order, 2147483647), axis=0))
        depth = tl.sum(tl.where(pick, f_depth, 0), axis=0)
        rank = tl.sum(tl.where(pick, f_rank, 0), axis=0)
        parent = tl.sum(tl.where(pick, f_parent, 0), axis=0)
        parent_score = tl.sum(tl.where(pick, f_parent_score, 0.0), axis=0)
        row = (depth - 1) * K

        tl.store(out_tok_ptr + out + node, tl.load(tok_base + row + rank))
        tl.store(out_parent_ptr + kept + node, parent.to(tl.int64))
        tl.store(out_depth_ptr + kept + node, depth.to(tl.int64))
        tl.store(out_lp_ptr + out + node, best)

        # The popped slot takes the next sibling, or empties when the rank was the last.
        has_sibling = rank + 1 < K
        sibling_score = parent_score + tl.load(lp_base + row + rank + 1, mask=has_sibling, other=0.0)
        f_rank = tl.where(pick, rank + 1, f_rank)
        f_score = tl.where(pick, sibling_score, f_score)
        f_valid = f_valid & ~(pick & ~has_sibling)
        # The first child goes to the next free slot.
        has_child = depth < D
        child_score = best + tl.load(lp_base + depth * K, mask=has_child, other=0.0)
        new = (slot == size) & has_child
        f_depth = tl.where(new, depth + 1, f_depth)
        f_rank = tl.where(new, 0, f_rank)
        f_parent = tl.where(new, node, f_parent)
        f_parent_score = tl.where(new, best, f_parent_score)
        f_score = tl.where(new, child_score, f_score)
        f_valid = f_valid | new
        size += has_child.to(tl.int32)


def best_first_tree(
    lp: torch.Tensor,
    tok: torch.Tensor,
    root_token_ids: torch.Tensor,
    num_nodes: int,
    slots: torch.Tensor | None = None,
    parents: torch.Tensor | None = None,
    depths: torch.Tensor | None = None,
):
    """(token_ids, parents, depths, log_probs), each [R, num_nodes], from per-depth top-K `lp`/`tok` [R, D, K].

    With `slots` [R] (integer request slots): request r's root token is root_token_ids[slots[r]] and its parents
    and depths are written to row slots[r] of the given `parents` / `depths` [S, num_nodes] int64, which are
    returned as they are (the trees kept by request slot; no gather or scatter around the launch)."""
    num_req, depth, k = lp.shape
    lp = lp.float().contiguous()
    tok = tok.to(torch.int64).contiguous()
    token_ids = torch.empty(num_req, num_nodes, dtype=torch.int64, device=lp.device)
    by_slot = slots is not None
    if by_slot:
        assert parents is not None and depths is not None and parents.is_contiguous() and depths.is_contiguous()
        assert parents.shape[1] == depths.shape[1] == num_nodes
    else:
        parents = torch.empty_like(token_ids)
        depths = torch.empty_like(token_ids)
    log_probs = torch.empty(num_req, num_nodes, dtype=torch.float32, device=lp.device)
    roots = root_token_ids.contiguous()
    if num_req:
        _best_first_kernel[(num_req,)](
            lp, tok, roots, slots if by_slot else roots, token_ids, parents, depths, log_probs,
            depth, k, num_nodes, FRONTIER=triton.next_power_of_2(num_nodes), BY_SLOT=by_slot,
        )  # fmt: skip
    return token_ids, parents, depths, log_probs

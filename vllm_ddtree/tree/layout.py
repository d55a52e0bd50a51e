"""Tree layout from a parents array: ancestor (attention) masks, depths and root-path reductions.

All functions are batched over requests and use pointer doubling: ceil(log2(N)) steps, each a gather, with
no host-device synchronisation (the step count depends only on the static node count N).

Input convention: `parents` is [R, N] int64 with -1 for the root (node 0) and a valid node index in [0, N)
for every other node; the parent chain of every node must reach the root (no cycles). Values are not checked
(that would need a sync); the DDTree builder guarantees parents[i] < i.
"""

import torch

from vllm_ddtree.tree.dispatch import use_triton

__all__ = ["ancestor_mask", "depths_from_parents", "all_on_root_path"]


def _num_doubling_steps(num_nodes: int) -> int:
    """Smallest s with 2^s >= N: after s doublings a span of 2^s covers the longest chain (N - 1 edges)."""
    return (num_nodes - 1).bit_length()


def _jump(pointer: torch.Tensor, values: torch.Tensor, fill) -> torch.Tensor:
    """values[r, pointer[r, i], ...] (trailing dims kept), `fill` where pointer < 0. pointer: [R, N]."""
    rows = torch.arange(pointer.shape[0], device=pointer.device)[:, None]  # [R, 1]
    gathered = values[rows, pointer.clamp(min=0)]  # [R, N, ...] whole rows, one indexing kernel
    outside = (pointer < 0).view(pointer.shape + (1,) * (values.dim() - 2))
    return gathered.masked_fill(outside, fill)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """mask[r, i, j] is True iff j == i or j is an ancestor of i. parents: [R, N] -> [R, N, N] bool.

    This is the tree-attention mask: node i attends to itself and its ancestors (plus, outside this
    function, the request's committed context).
    """
    if use_triton(parents):
        from vllm_ddtree.tree.triton_layout import ancestor_mask_triton  # one launch

        return ancestor_mask_triton(parents)
    num_req, n = parents.shape
    mask = torch.eye(n, dtype=torch.bool, device=parents.device).expand(num_req, n, n)  # [R, N, N]
    pointer = parents  # [R, N] ancestor at distance 2^k (-1 beyond the root)
    for _ in range(_num_doubling_steps(n)):
        # mask covers distances 0..2^k - 1; the same span from the 2^k-th ancestor adds 2^k..2^(k+1) - 1
        mask = mask | _jump(pointer, mask, False)
        pointer = _jump(pointer, pointer, -1)
    return mask


def depths_from_parents(parents: torch.Tensor) -> torch.Tensor:
    """Depth of every node (0 for the root). parents: [R, N] -> [R, N] int64."""
    dist = (parents >= 0).to(torch.int64)  # [R, N] edges from i to `pointer` (list ranking)
    pointer = parents
    for _ in range(_num_doubling_steps(parents.shape[1])):
        dist = dist + _jump(pointer, dist, 0)
        pointer = _jump(pointer, pointer, -1)
    return dist


def all_on_root_path(flags: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """out[r, i] = AND of flags[r, j] over j == i and all ancestors j of i. flags: [R, N] bool -> [R, N] bool."""
    out = flags
    pointer = parents
    for _ in range(_num_doubling_steps(parents.shape[1])):
        # out covers distances 0..2^k - 1; combine with the same span starting at the 2^k-th ancestor
        out = out & _jump(pointer, out, True)
        pointer = _jump(pointer, pointer, -1)
    return out

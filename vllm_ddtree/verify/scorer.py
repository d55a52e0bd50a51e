"""The scorer: the target's choice at every tree node, the walk, and vLLM's sampler output.

At temperature 0 the target's choice at a node is its argmax; with sampling it is a sample from the target's
processed distribution at that node (see `sampling.py`). The walk follows those choices from the root, so the
accepted tokens are exactly what the target would have produced one token at a time.
"""

from __future__ import annotations

import torch

from vllm_ddtree.tree import WalkResult, walk_tree
from vllm_ddtree.verify.step import TreeStep

PLACEHOLDER_TOKEN_ID = -1


def node_tokens(step: TreeStep, input_ids: torch.Tensor) -> torch.Tensor:
    """[R, N] the token of every node, read from this step's input ids."""
    return input_ids.to(torch.int64)[step.node_token_index]


def walk_step(
    step: TreeStep,
    node_choices: torch.Tensor,  # [rows] the target's choice at every logits row
    tokens: torch.Tensor,  # [R, N] the token of every node
    max_depth: int,
) -> WalkResult:
    target = node_choices.to(torch.int64)[step.node_rows]  # [R, N]
    num_walk_nodes = step.num_nodes if step.num_walk_nodes is None else step.num_walk_nodes
    return walk_tree(tokens, step.parents, step.depths, target, num_walk_nodes, max_depth)


def sampled_token_ids(walk: WalkResult, width: int) -> torch.Tensor:
    """[R, width] accepted tokens then the bonus token, padded with -1 (the rejection sampler's format)."""
    out = walk.output_token_ids  # [R, D + 1]
    if out.shape[1] >= width:
        return out[:, :width].contiguous()
    pad = out.new_full((out.shape[0], width - out.shape[1]), PLACEHOLDER_TOKEN_ID)
    return torch.cat([out, pad], dim=1)


def accepted_path_moves(step: TreeStep, walk: WalkResult) -> tuple[torch.Tensor, torch.Tensor]:
    """Token moves that put each request's accepted path right after its root.

    Returns (src, dst), both [R * M] indices into the step's scheduled tokens: the token at src goes to dst.
    Entries that move nothing have src == dst; entries aliased by padding repeat an identical (src, dst) pair,
    so a gather followed by a scatter is well defined without masks (no host sync).
    """
    num_reqs, width = step.parents.shape
    path = walk.path_nodes  # [R, D + 1], -1 after the path's end
    depth = min(path.shape[1] - 1, width - 1)
    index = torch.arange(1, depth + 1, device=path.device)[None, :]  # [1, M]
    index = torch.minimum(index, step.num_nodes[:, None] - 1)  # [R, M] clamped to the last valid node
    index = torch.clamp(index, min=0)
    path_at = path.gather(1, index)  # [R, M]
    accepted = index <= walk.num_accepted[:, None]
    src_node = torch.where(accepted & (path_at >= 0), path_at, index)
    src = step.node_token_index.gather(1, src_node)
    dst = step.node_token_index.gather(1, index)
    return src.flatten(), dst.flatten()

"""Walking a draft tree against the target's choices (greedy or sampled): the accepted path and bonus token.

Sequential rule (the DDTree reference): start at the root; at node u the target chose c = target[u]; if a
valid child of u carries token c, move to it and repeat, else stop. The bonus token is the target's choice at
the last accepted node. Batched form: node j is *chosen* iff it is valid and token[j] == target[parent[j]];
it is *accepted* iff it and all its ancestors are chosen. Siblings carry distinct tokens, so at most one child
of an accepted node is chosen and the accepted nodes form one root path, with at most one node per depth.
"""

from dataclasses import dataclass

import torch

from vllm_ddtree.tree.dispatch import use_triton
from vllm_ddtree.tree.layout import all_on_root_path

__all__ = ["WalkResult", "walk_tree"]


@dataclass
class WalkResult:
    """The accepted path of every request."""

    path_nodes: torch.Tensor  # [R, D+1] int64 node at each depth of the accepted path ([:, 0] = 0), -1 after its end
    num_accepted: torch.Tensor  # [R] int64, accepted draft nodes (root excluded)
    output_token_ids: torch.Tensor  # [R, D+1] int64: the accepted nodes' tokens then the bonus token, -1 padded


def accepted_nodes(
    token_ids: torch.Tensor, parents: torch.Tensor, target_token_ids: torch.Tensor, num_nodes: torch.Tensor
) -> torch.Tensor:
    """[R, N] bool: nodes on the accepted path, root included. All inputs [R, N] except num_nodes [R]."""
    n = token_ids.shape[1]
    valid = torch.arange(n, device=token_ids.device)[None, :] < num_nodes[:, None]  # [R, N]
    target_at_parent = target_token_ids.gather(1, parents.clamp(min=0))  # [R, N]
    chosen = valid & ((token_ids == target_at_parent) | (parents < 0))  # the root is always "chosen"
    return all_on_root_path(chosen, parents)


def walk_tree(
    token_ids: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    target_token_ids: torch.Tensor,
    num_nodes: torch.Tensor,
    max_depth: int,
) -> WalkResult:
    """Accepted path and output tokens for a batch of trees.

    Args:
        token_ids, parents, depths: [R, N] int64 tree (node 0 = root, parents[:, 0] = -1, siblings distinct).
        target_token_ids: [R, N] int64 target choice (argmax or sample) at every node.
        num_nodes: [R] int64 valid nodes per request (a prefix of the node list, >= 1; 1 = root only).
        max_depth: D, at least the deepest node's depth (the draft block length).

    No host-device synchronisation; safe to capture in a CUDA graph for fixed shapes.
    """
    if use_triton(token_ids):
        from vllm_ddtree.tree.triton_walk import walk_tree_triton  # one launch

        return WalkResult(*walk_tree_triton(token_ids, parents, target_token_ids, num_nodes, max_depth))
    num_req, n = token_ids.shape
    accepted = accepted_nodes(token_ids, parents, target_token_ids, num_nodes)  # [R, N]
    num_accepted = accepted.sum(dim=1) - 1  # [R]

    # At most one accepted node per depth: a one-hot over (depth, node) and a max picks it (or -1).
    levels = torch.arange(max_depth + 1, device=token_ids.device)  # [D+1]
    at_level = accepted[:, None, :] & (depths[:, None, :] == levels[None, :, None])  # [R, D+1, N]
    node_index = torch.arange(n, device=token_ids.device)  # [N]
    path_nodes = torch.where(at_level, node_index, -1).amax(dim=2)  # [R, D+1]

    draft_nodes = path_nodes[:, 1:]  # [R, D]
    output = torch.where(draft_nodes >= 0, token_ids.gather(1, draft_nodes.clamp(min=0)), -1)  # [R, D]
    output = torch.cat([output, output.new_full((num_req, 1), -1)], dim=1)  # [R, D+1]
    last_node = path_nodes.gather(1, num_accepted[:, None])  # [R, 1]
    output.scatter_(1, num_accepted[:, None], target_token_ids.gather(1, last_node))
    return WalkResult(path_nodes=path_nodes, num_accepted=num_accepted, output_token_ids=output)

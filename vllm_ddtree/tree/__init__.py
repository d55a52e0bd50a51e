"""Draft trees for DDTree: build (from drafter marginals), layout (masks, depths), walk (verification).

Pure torch, no vLLM imports; every function is batched over requests and free of host-device syncs.
"""

from vllm_ddtree.tree.build import DraftTree, build_draft_tree, max_tree_nodes
from vllm_ddtree.tree.layout import all_on_root_path, ancestor_mask, depths_from_parents
from vllm_ddtree.tree.walk import WalkResult, accepted_nodes, walk_tree

__all__ = [
    "DraftTree",
    "WalkResult",
    "accepted_nodes",
    "all_on_root_path",
    "ancestor_mask",
    "build_draft_tree",
    "depths_from_parents",
    "max_tree_nodes",
    "walk_tree",
]

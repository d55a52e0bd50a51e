"""The target's choice at each tree node: argmax at temperature 0."""

from __future__ import annotations

import torch

from vllm_ddtree.verify.step import TreeStep


def node_choices(logits: torch.Tensor, step: TreeStep, sampling_metadata) -> torch.Tensor:
    """[rows] the target's token at every logits row (one row per tree node)."""
    if not sampling_metadata.all_greedy:
        raise NotImplementedError("DDTree sampling at temperature > 0 is not implemented yet")
    return logits.argmax(dim=-1)

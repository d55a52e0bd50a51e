"""Repetition, frequency and presence penalties for tree rows on Model Runner V2.

V2's penalties kernel counts, for the logits row at local position j of a request, the request's output tokens
(`output_bin_counts`) plus the tokens at local positions 1..j: right for a chain, wrong for a tree, where node i's
context is the root's plus the tokens on its own path. `install_tree_penalties` puts a wrapper on the sampler's
`PenaltiesState.apply_penalties` that, during a tree verification, counts along each node's path instead
(`sampling.path_token_counts`, the V1 scorer's rule) and applies the same formulas (`sampling.penalize`); in every
other step, or with no penalized request in the batch, V2's own kernel runs.
"""

from __future__ import annotations

import torch

from vllm_ddtree.verify.sampling import path_token_counts, penalize
from vllm_ddtree.verify.step import TreeStep
from vllm_ddtree.verify.v2_processors import wrap_v2_processor


def unpack_bits(packed: torch.Tensor, num_bits: int) -> torch.Tensor:
    """[rows, W] int32 words (bit b of word w = item 32 w + b) -> [rows, num_bits] bool."""
    shifts = torch.arange(32, device=packed.device, dtype=torch.int32)
    bits = (packed.unsqueeze(-1) >> shifts) & 1  # [rows, W, 32]
    return bits.flatten(1)[:, :num_bits].bool()


def tree_penalties_(
    logits: torch.Tensor,  # [rows, V] logits rows of a verification step (modified in place)
    step: TreeStep,
    row_tokens: torch.Tensor,  # [rows] the token of each row's node
    expanded_idx_mapping: torch.Tensor,  # [rows] request slot of each row
    penalties_state,  # V2's PenaltiesState
) -> None:
    vocab_size = logits.shape[1]
    slots = expanded_idx_mapping.to(torch.int64)
    node_tokens = row_tokens.to(torch.int64)[step.node_rows]  # [R, N]
    counts = penalties_state.output_bin_counts[slots].to(torch.float32)  # [rows, V]
    counts += path_token_counts(step, node_tokens, vocab_size)
    prompt_mask = unpack_bits(penalties_state.prompt_bin_mask[slots], vocab_size)
    penalized = penalize(
        logits.to(torch.float32),
        counts,
        prompt_mask,
        penalties_state.repetition_penalty.gpu[slots],
        penalties_state.frequency_penalty.gpu[slots],
        penalties_state.presence_penalty.gpu[slots],
    )
    logits.copy_(penalized)


def install_tree_penalties(penalties_state, state) -> None:
    """Wrap V2's penalties call (`v2_processors.wrap_v2_processor`: `apply_penalties` in 0.26, `apply` in 0.32).
    `state.step` is the tree layout of the step being verified, None otherwise."""

    def tree_rule(logits, expanded_idx_mapping, idx_mapping_np, input_ids) -> bool:
        if state.step is None or not bool(penalties_state.use_penalty[idx_mapping_np].any()):
            return False
        tree_penalties_(logits, state.step, input_ids, expanded_idx_mapping, penalties_state)
        return True

    wrap_v2_processor(penalties_state, "apply_penalties", tree_rule)

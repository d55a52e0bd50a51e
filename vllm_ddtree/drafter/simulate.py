"""Greedy speculative decoding replayed in pure torch on the target's own greedy answers: the acceptance length
vLLM should report for a drafter, for vLLM's chain and for DDTree trees, without an engine.

At temperature 0 every accepted token is the target's greedy token, so decoding an answer that is the target's
greedy answer accepts, at each step, the longest run of the answer's next tokens that the draft holds: the chain's
longest matching prefix, or the deepest tree node on the answer's path (the walk follows the target's argmax, which
is the answer's next token at every node on that path). The drafter sees the target features of the accepted
positions only (its context is the answer so far), as in the engine. Only the numerics differ from a GPU engine's
(the drafter and target run here in the precision given).

The same replay holds for answers sampled from the target at a temperature T > 0. There the engine's walk
follows the target's own sample at each node, so with the same samples the output is that sampled answer
whatever the draft was, and a step accepts the deepest draft node on its path. Averaged over sampled answers,
this is the engine's acceptance at T. For vLLM's chain with greedy drafts this is its rejection rule too (a
draft token d is kept with probability p(d), the chance that the target's sample is d).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_ddtree.drafter.features import padded_length, target_features
from vllm_ddtree.tree import build_draft_tree

# accepted(block_logits [S - 1, V] for offsets 1..S-1, root token, the answer's next S - 1 tokens) -> accepted count
Policy = Callable[[torch.Tensor, int, list[int]], int]


def chain_policy(block_logits: torch.Tensor, root: int, truth: list[int]) -> int:
    """vLLM's DFlash chain: the argmax at every offset; accepted while it matches the answer."""
    proposal = block_logits.argmax(-1).tolist()
    n = 0
    while n < len(truth) and proposal[n] == truth[n]:
        n += 1
    return n


def tree_policy(budget: int, temperature: float | torch.Tensor = 1.0, max_topk: int | None = None) -> Policy:
    """DDTree with `budget` nodes, built from the drafter's logits divided by `temperature` (1: as the plugin
    builds it; a [S - 1, 1] tensor: one per depth); accepted: the depth of the deepest node on the answer's path."""

    def accepted(block_logits: torch.Tensor, root: int, truth: list[int]) -> int:
        tree = build_draft_tree((block_logits / temperature)[None], torch.tensor([root]), budget, max_topk)
        tokens, parents = tree.token_ids[0].tolist(), tree.parents[0].tolist()
        children: dict[tuple[int, int], int] = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens)) if i}
        node, depth = 0, 0
        while depth < len(truth) and (node, truth[depth]) in children:
            node, depth = children[(node, truth[depth])], depth + 1
        return depth

    return accepted


def simulate_acceptance_lengths(drafter, target, seqs, policies: dict[str, Policy]) -> dict[str, float]:
    """Mean acceptance length (1 + accepted / drafts, as vLLM reports it) per policy over `seqs` (each with
    `prompt`, `response` and `ids`; the responses must be the target's own: greedy ones, or samples at the
    temperature being simulated, see the module docstring)."""
    counts = simulate_draft_counts(drafter, target, seqs, policies)
    return {name: acceptance_length(*counts[name]) for name in policies}


def acceptance_length(drafts: int, accepted: int) -> float:
    """vLLM's mean acceptance length, 1 + accepted / drafts."""
    return 1.0 + accepted / max(1, drafts)


@torch.no_grad()
def simulate_draft_counts(drafter, target, seqs, policies: dict[str, Policy]) -> dict[str, tuple[int, int]]:
    """(drafts, accepted tokens) per policy over `seqs`, as `simulate_acceptance_lengths` counts them (counts add
    up over groups of answers, e.g. per prompt source). The drafter's block at a position is computed once for
    all policies."""
    device = next(drafter.parameters()).device
    layer_ids, S = drafter.config.target_layer_ids, drafter.config.block_size
    drafts = dict.fromkeys(policies, 0)
    accepted = dict.fromkeys(policies, 0)
    for seq in seqs:
        if len(seq.response) < 2:
            continue
        ids = torch.tensor([seq.ids], device=device)
        features = target_features(target, ids, torch.tensor([ids.shape[1]], device=device), layer_ids)  # [1, L, F]
        # Contexts cut at padded lengths (positions from the anchor on are masked): a few shapes, not one a position
        tail = padded_length(ids.shape[1]) - ids.shape[1]
        features = torch.cat([features, features[:, -1:].expand(-1, tail, -1)], dim=1)
        blocks: dict[int, torch.Tensor] = {}

        def block_logits(pos: int) -> torch.Tensor:  # [S - 1, V] float32, offsets 1..S-1 after position pos
            if pos not in blocks:
                block = torch.full((1, 1, S), drafter.config.mask_token_id, device=device)
                block[0, 0, 0] = ids[0, pos]
                hidden = drafter(block, torch.tensor([[pos]], device=device), features[:, : padded_length(pos)])
                blocks[pos] = drafter.logits(hidden[0, 0, 1:]).float().cpu()
            return blocks[pos]

        end = len(seq.ids)
        for name, policy in policies.items():
            pos = len(seq.prompt)
            while pos < end - 1:
                n = policy(block_logits(pos), seq.ids[pos], seq.ids[pos + 1 : pos + S])
                drafts[name] += 1
                accepted[name] += n
                pos += n + 1
    return {name: (drafts[name], accepted[name]) for name in policies}


def simulate_acceptance(drafter, target, seqs) -> float:
    """The chain's simulated acceptance length (`simulate_acceptance_lengths` with `chain_policy`)."""
    return simulate_acceptance_lengths(drafter, target, seqs, {"chain": chain_policy})["chain"]

"""Drafts without a kept tree: vLLM's placeholder drafts are laid out as a chain and never accepted.

vLLM 0.32's scheduler pads a new request that needs a single token (a one-token prompt that arrives while other
requests decode) with `num_speculative_tokens` placeholder drafts (-1, clamped to token 0 before the forward) so
the step keeps a uniform shape. The runner proposed no tree for that request. Before the fix `build_tree_step`
failed on it (under `vllm serve`: "EngineCore encountered a fatal error", then HTTP 500 for every request).
"""

import torch

from vllm_ddtree.tree import build_draft_tree
from vllm_ddtree.verify.scorer import accepted_path_moves, node_tokens, sampled_token_ids, walk_step
from vllm_ddtree.verify.step import build_tree_step

BUDGET = 3
WIDTH = BUDGET + 1
DEPTH = 3


def _kept_tree():
    # One proposed tree: a chain of the drafter's argmax (token 10 + depth) at every depth.
    logits = torch.full((1, DEPTH, 16), -10.0)
    for d in range(DEPTH):
        logits[0, d, 10 + d] = 10.0
    return build_draft_tree(logits, torch.tensor([5]), budget=BUDGET)


def test_placeholder_drafts_are_a_chain_that_is_never_accepted():
    tree = _kept_tree()
    # Request 0 verifies the kept tree; request 1 is a padded new request (placeholders, no tree); request 2
    # decodes without drafts. Scheduled tokens: [root, 3 nodes | root, 3 placeholders | root].
    input_ids = torch.cat([tree.token_ids[0], torch.tensor([7, 0, 0, 0]), torch.tensor([9])])
    step = build_tree_step([BUDGET, BUDGET, 0], torch.arange(input_ids.shape[0]), tree.parents, tree.depths,
                           [0, -1, -1], WIDTH)  # fmt: skip

    assert step.parents[1].tolist() == [-1, 0, 1, 2]
    assert step.depths[1].tolist() == [0, 1, 2, 3]
    assert step.parents[0].tolist() == tree.parents[0].tolist()
    assert step.num_walk_nodes.tolist() == [WIDTH, 1, 1]

    tokens = node_tokens(step, input_ids)  # [R, N]
    # The target agrees with every node of both requests (token 0 after 7, 0 after 0, ...), so only the walk's
    # node limit keeps the placeholders out.
    choices = torch.zeros(step.num_nodes_cpu.sum(), dtype=torch.int64)
    for req in range(2):
        rows = step.node_rows[req, : step.num_nodes_cpu[req]]
        nxt = torch.cat([tokens[req, 1:], tokens.new_tensor([42])])[: rows.shape[0]]
        choices[rows] = nxt
    choices[step.node_rows[2, 0]] = 43
    walk = walk_step(step, choices, tokens, DEPTH)

    assert walk.num_accepted.tolist() == [DEPTH, 0, 0]
    out = sampled_token_ids(walk, WIDTH)
    assert out[0].tolist() == [10, 11, 12, 42]
    assert out[1].tolist() == [0, -1, -1, -1]  # the target's choice at the root, nothing accepted
    assert out[2].tolist() == [43, -1, -1, -1]
    src, dst = accepted_path_moves(step, walk)
    moved = src != dst
    assert not moved.view(3, -1)[1:].any()  # no KV moves for the placeholder and root-only requests


def test_only_placeholders_without_any_kept_tree():
    input_ids = torch.tensor([7, 0, 0, 0])
    step = build_tree_step([BUDGET], torch.arange(4), None, None, [-1], WIDTH)
    assert step.parents.tolist() == [[-1, 0, 1, 2]]
    assert step.num_walk_nodes.tolist() == [1]
    tokens = node_tokens(step, input_ids)
    walk = walk_step(step, torch.zeros(4, dtype=torch.int64), tokens, DEPTH)
    assert walk.num_accepted.tolist() == [0]
    assert sampled_token_ids(walk, WIDTH).tolist() == [[0, -1, -1, -1]]

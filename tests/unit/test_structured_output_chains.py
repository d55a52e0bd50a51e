"""Structured output with DDTree (vllm_ddtree/structured.py): a constrained request drafts its argmax chain.

Oracles: the per-depth argmax of the logits (the chain), the unconstrained tree for the other rows, and the
tree invariants (parents before children, depth = parent's depth + 1). The end-to-end check against vLLM without
speculation is tests/e2e/test_structured_output.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_ddtree.structured import chain_length, keep_chain_drafts_
from vllm_ddtree.tree import build_draft_tree


def _check_tree(tree, row: int) -> None:
    parents, depths = tree.parents[row].tolist(), tree.depths[row].tolist()
    assert parents[0] == -1 and depths[0] == 0
    for node in range(1, len(parents)):
        assert 0 <= parents[node] < node
        assert depths[node] == depths[parents[node]] + 1


@pytest.mark.parametrize("budget,depth", [(5, 8), (8, 8), (17, 8), (40, 6)])  # budgets below, at and above D
def test_chain_rows_draft_the_argmax_chain_first_and_other_rows_keep_their_trees(budget, depth):
    torch.manual_seed(budget)
    logits = torch.randn(3, depth, 50) * 3  # [R, D, V]
    roots = torch.tensor([1, 2, 3])
    chain_rows = torch.tensor([False, True, False])

    tree = build_draft_tree(logits, roots, budget, chain_rows=chain_rows)
    free = build_draft_tree(logits, roots, budget)

    length = min(budget, depth)
    argmax = logits[1].argmax(dim=-1)  # [D]
    assert tree.token_ids[1, 1 : 1 + length].tolist() == argmax[:length].tolist()
    assert tree.parents[1, 1 : 1 + length].tolist() == list(range(length))
    assert tree.depths[1, 1 : 1 + length].tolist() == list(range(1, length + 1))
    for row in range(3):
        _check_tree(tree, row)
    for row in (0, 2):
        for field in ("token_ids", "parents", "depths", "log_probs"):
            assert torch.equal(getattr(tree, field)[row], getattr(free, field)[row]), field
    # The unconstrained tree of a row is no chain once the budget allows siblings: the constraint changed something.
    if budget > 1:
        assert free.parents[1, 1 : 1 + length].tolist() != list(range(length))


def test_the_scheduler_keeps_a_constrained_requests_chain_only():
    requests = {
        "json": SimpleNamespace(use_structured_output=True),
        "free": SimpleNamespace(use_structured_output=False),
    }
    drafts = SimpleNamespace(req_ids=["json", "free", "gone"], draft_token_ids=[list(range(32)) for _ in range(3)])
    keep_chain_drafts_(requests, drafts, 15)
    assert drafts.draft_token_ids == [list(range(15)), list(range(32)), list(range(32))]


def test_chain_length_is_the_smaller_of_budget_and_depth():
    config = SimpleNamespace(ddtree_config={"budget": 32, "depth": 15})
    assert chain_length(config) == 15
    assert chain_length(SimpleNamespace(ddtree_config={"budget": 7, "depth": 15})) == 7
    assert chain_length(SimpleNamespace()) is None


@pytest.mark.parametrize("runner,refused", [("v1", False), ("v2", True)])
def test_structured_output_is_refused_where_ddtree_may_run_model_runner_v2(monkeypatch, runner, refused):
    pytest.importorskip("vllm")
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from vllm_ddtree.requests import unsupported_reason

    monkeypatch.setenv("VLLM_DDTREE_RUNNER", runner)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    problem = unsupported_reason(params)
    if not refused:
        assert problem is None
        return
    parameter, why = problem
    assert parameter == "structured_outputs"
    assert "VLLM_DDTREE_RUNNER=v1" in why and "structured output" in why

"""The runner keeps the tree of a request that a step left out: vLLM keeps its drafts and verifies them when the
request is scheduled again (a step's token budget can leave running requests out, e.g. 300 running requests at
budget 31 with max_num_batched_tokens 8192).

Before the fix the runner kept only the trees of the last step's requests: such a request's drafts were laid out
with another request's tree (wrong attention masks and walk; seen as `index -1 is out of bounds` in the walk),
and since the placeholder-draft handling, as a chain the walk never accepts (correct tokens, no speculation).
"""

import torch

from vllm_ddtree.runner import DDTreeRunnerState, remember_trees_
from vllm_ddtree.tree import build_draft_tree
from vllm_ddtree.verify.step import build_tree_step

BUDGET, DEPTH, VOCAB = 3, 3, 8


def trees(seed: int, num_reqs: int):
    logits = torch.randn(num_reqs, DEPTH, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    return build_draft_tree(logits, torch.zeros(num_reqs, dtype=torch.int64), BUDGET)


def test_unscheduled_requests_keep_their_trees():
    state = DDTreeRunnerState(budget=BUDGET, depth=DEPTH)
    first = trees(0, 4)
    remember_trees_(state, first, ["a", "b", "c", "d"], live_req_ids={"a", "b", "c", "d"})
    # Next step: "a" is left out (still running), "d" finished, "e" is new.
    second = trees(1, 3)
    remember_trees_(state, second, ["b", "c", "e"], live_req_ids={"a", "b", "c", "e"})
    assert state.prev_rows == {"b": 0, "c": 1, "e": 2, "a": 3}
    assert torch.equal(state.prev_parents[:3], second.parents)
    assert torch.equal(state.prev_parents[3], first.parents[0])
    assert torch.equal(state.prev_depths[3], first.depths[0])

    # "a" is scheduled again with its old drafts, next to "c": its own tree is laid out and may be accepted.
    step = build_tree_step([BUDGET, BUDGET], torch.arange(2 * (BUDGET + 1)), state.prev_parents, state.prev_depths,
                           [state.prev_rows["a"], state.prev_rows["c"]], BUDGET + 1)  # fmt: skip
    assert torch.equal(step.parents[0], first.parents[0])
    assert torch.equal(step.parents[1], second.parents[1])
    assert step.num_walk_nodes is None or step.num_walk_nodes.tolist() == [BUDGET + 1, BUDGET + 1]


def test_step_without_proposals_keeps_older_trees():
    state = DDTreeRunnerState(budget=BUDGET, depth=DEPTH)
    first = trees(2, 2)
    remember_trees_(state, first, ["a", "b"], live_req_ids={"a", "b"})
    remember_trees_(state, None, ["b"], live_req_ids={"a", "b"})  # "b" got no drafts this step
    assert state.prev_rows == {"a": 0}
    assert torch.equal(state.prev_parents, first.parents[:1])
    remember_trees_(state, None, ["b"], live_req_ids={"b"})  # "a" finished
    assert state.prev_rows == {} and state.prev_parents is None

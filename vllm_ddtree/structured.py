"""Structured output (JSON schema, regex, choice, grammar) for DDTree requests.

vLLM's scheduler checks a request's drafts against its grammar and computes one token mask per draft position as if
the drafts were a chain: the mask of draft i assumes drafts 1..i-1 were accepted. A tree's nodes are not a chain, so
for a request with structured output DDTree hands the scheduler its tree's parents with the drafts, and:

- `update_draft_token_ids` (and `_in_output` under async scheduling) keeps all of the tree's nodes: vLLM's check would
  cut the node list at the first node that does not follow the previous one (`take_tree_drafts`);
- `grammar_bitmask` gives node i the mask of the grammar state after the tokens on node i's own path. Where the
  grammar constrains the request's whole window (no reasoning still going on: the common case), one walk down the
  tree fills each node's mask once with the grammar's own calls (`fill_tree_bitmask_`); otherwise vLLM's code,
  which knows where reasoning ends, computes them one root-to-leaf path at a time (`tree_bitmask_rows`). A node
  whose token its path's grammar rejects gets its parent's mask: the target's masked choice at the parent never is
  that token, so the walk never reaches it.

The runner attaches the parents when it hands over the drafts (`attach_tree_parents`): the V1 runner hook
(`runner.constrained_tree_parents`) and, on Model Runner V2, its draft tokens handler
(`runner_v2.hand_tree_parents_to_scheduler`). Requests without structured output are untouched.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from vllm_ddtree import config as ddtree_config

ATTRIBUTE = "ddtree_parents"  # on vLLM's DraftTokenIds ({req_id: parents}) and Request (parents of its drafts)


def tree_bitmask_rows(
    tokens: list[int],  # [n] the scheduled drafts, node i + 1's token at i
    parents: list[int],  # [n + 1] parent node of each node, -1 for the root (node 0)
    valid_prefix: Callable[[list[int]], int],  # how many leading tokens of a path the grammar accepts
    chain_rows: Callable[[list[int]], np.ndarray],  # [k + 1, W] vLLM's masks for a valid chain of k drafts
) -> np.ndarray:
    """[n + 1, W] one mask per node: the grammar state after the node's own path (module docstring)."""
    n = len(tokens)
    has_child = [False] * (n + 1)
    for node in range(1, n + 1):
        has_child[parents[node]] = True
    rows: list[np.ndarray | None] = [None] * (n + 1)
    for leaf in [node for node in range(n + 1) if not has_child[node]]:
        path = []  # nodes from the root's child down to the leaf
        node = leaf
        while node > 0:
            path.append(node)
            node = parents[node]
        path.reverse()
        path_tokens = [tokens[node - 1] for node in path]
        accepted = valid_prefix(path_tokens)
        masks = chain_rows(path_tokens[:accepted])  # row j: after the path's first j tokens
        rows[0] = masks[0]
        for j in range(accepted):
            rows[path[j]] = masks[j + 1]
    for node in range(1, n + 1):  # nodes the grammar rejects (parents come first)
        if rows[node] is None:
            rows[node] = rows[parents[node]]
    return np.stack(rows)


def fill_tree_bitmask_(
    rows,  # [n + 1, W] torch.int32, the grammar backend's bitmask layout: filled
    tokens: list[int],  # [n] node i + 1's token at i
    parents: list[int],  # [n + 1] parent node of each node, -1 for the root (node 0)
    grammar,  # vLLM's StructuredOutputGrammar at the request's current state; left in it
    req_id: str,
) -> None:
    """One mask per node, the grammar's after the node's own path, in one walk down the tree: each node's token
    accepted on the way down and rolled back on the way up, one fill per node. A grammar that has ended masks
    nothing (vLLM's rule); a node whose token the grammar rejects gets, with its subtree, its parent's mask. A token
    is offered to the grammar only where its parent's mask allows it (backends log every token they reject)."""
    children: list[list[int]] = [[] for _ in range(len(tokens) + 1)]
    for node in range(1, len(tokens) + 1):
        children[parents[node]].append(node)
    words = rows.numpy()  # [n + 1, W] the same memory: bits read and rows copied without torch's ~2 us a call

    def copy_subtree(source: int, node: int) -> None:
        words[node] = words[source]
        for child in children[node]:
            copy_subtree(source, child)

    def visit(node: int) -> None:
        if grammar.is_terminated():
            words[node] = -1
        else:
            grammar.fill_bitmask(rows, node)
        for child in children[node]:
            token = tokens[child - 1]
            allowed = (int(words[node, token >> 5]) >> (token & 31)) & 1  # bit set: allowed
            if allowed and not grammar.is_terminated() and grammar.accept_tokens(req_id, [token]):
                visit(child)
                grammar.rollback(1)
            else:
                copy_subtree(node, child)

    visit(0)


def attach_tree_parents(draft_token_ids, parents_by_req: dict[str, list[int]]) -> None:
    """Put the parents of the structured-output requests' trees on vLLM's `DraftTokenIds` (it travels to the
    scheduler as it is, pickled where the worker is another process)."""
    if parents_by_req:
        setattr(draft_token_ids, ATTRIBUTE, parents_by_req)


def take_tree_drafts(scheduler, draft_token_ids, scheduler_output=None):
    """Take, for the scheduler, the drafts of the requests whose trees carry parents, as vLLM takes drafts but
    without its chain check; return the `DraftTokenIds` of the other requests for vLLM's own code.

    `scheduler_output` given: the async path (`update_draft_token_ids_in_output`): drafts replace the scheduled
    placeholders, cut to their number. Otherwise `update_draft_token_ids`: they become the request's next drafts."""
    parents_by_req = getattr(draft_token_ids, ATTRIBUTE, None)
    if not parents_by_req:  # no constrained tree this step: vLLM takes every draft
        for req_id in draft_token_ids.req_ids:
            _forget_parents(scheduler.requests.get(req_id))
        return draft_token_ids
    rest_ids, rest_drafts = [], []
    for req_id, drafts in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
        parents = parents_by_req.get(req_id)
        request = scheduler.requests.get(req_id)
        if parents is not None and request is not None and request.structured_output_request is None:
            parents = None  # a tree without a grammar: vLLM's to take
        if parents is None:
            _forget_parents(request)
            rest_ids.append(req_id)
            rest_drafts.append(drafts)
            continue
        if request is None or request.is_finished():
            continue
        if scheduler_output is not None:
            scheduled = scheduler_output.scheduled_spec_decode_tokens
            if not scheduled.get(req_id):
                continue
            drafts = list(drafts[: len(scheduled[req_id])])
            scheduled[req_id] = drafts
        elif request.is_prefill_chunk:
            request.spec_token_ids = []
            continue
        else:
            request.spec_token_ids = list(drafts)
        setattr(request, ATTRIBUTE, list(parents[: len(drafts) + 1]))
    return type(draft_token_ids)(rest_ids, rest_drafts)


def _forget_parents(request) -> None:
    """The request's next drafts are vLLM's to check, as a chain: drop the parents of an earlier tree."""
    if getattr(request, ATTRIBUTE, None) is not None:
        setattr(request, ATTRIBUTE, None)


def install_tree_mask_hooks() -> None:
    """Wrap the scheduler's two ways of taking drafts and the structured-output manager's `grammar_bitmask`
    (0.26 and 0.32) as the module docstring says, and 0.26's `should_advance` (`_latching_reasoning_end_anywhere`).
    Idempotent; other methods and requests pass through."""
    from vllm_ddtree.compat import Scheduler, StructuredOutputManager

    for name in ("update_draft_token_ids", "update_draft_token_ids_in_output"):
        original = getattr(Scheduler, name, None)
        if original is not None and not getattr(original, "_ddtree_hook", False):
            setattr(Scheduler, name, _taking_tree_drafts(original))
    original = StructuredOutputManager.grammar_bitmask
    if not getattr(original, "_ddtree_hook", False):
        StructuredOutputManager.grammar_bitmask = _tree_bitmasks(original)
    original = getattr(StructuredOutputManager, "should_advance", None)  # 0.26; 0.32 advances in accept_tokens
    if original is not None and not getattr(original, "_ddtree_hook", False):
        StructuredOutputManager.should_advance = _latching_reasoning_end_anywhere(original)


def _taking_tree_drafts(original):
    def update(self, draft_token_ids, *args, **kwargs):
        if ddtree_config.settings_of(self.vllm_config.speculative_config) is not None:
            scheduler_output = args[0] if args else kwargs.get("scheduler_output")
            draft_token_ids = take_tree_drafts(self, draft_token_ids, scheduler_output)
        return original(self, draft_token_ids, *args, **kwargs)

    update._ddtree_hook = True
    update.__wrapped__ = original
    return update


def _latching_reasoning_end_anywhere(original):
    """0.26's `should_advance` sees a reasoning end only as a step's last token; one among the step's accepted
    drafts never latched, and the answer went on unconstrained (session 43). For DDTree engines, while reasoning
    holds the grammar back, look for the end in all of the output instead (`latch_reasoning_end_in_output`) and
    advance the grammar at once with the step's tokens after it. 0.26's own check is not asked meanwhile: in a step
    such as [".", "[", "1", "."] it would latch at the last end marker and the grammar would never see "[", "1", ".".
    On an H100 (session 45) the reasoning e2e test's greedy answers are token-identical to no speculation with it."""
    from vllm_ddtree.compat import latch_reasoning_end_in_output, reasoning_holds_grammar_back

    def should_advance(self, request):
        structured = request.structured_output_request
        if (structured is None or structured.reasoning_ended
                or ddtree_config.settings_of(self.vllm_config.speculative_config) is None
                or not reasoning_holds_grammar_back(self, request)):
            return original(self, request)
        return latch_reasoning_end_in_output(self, request)

    should_advance._ddtree_hook = True
    should_advance.__wrapped__ = original
    return should_advance


def _tree_bitmasks(original):
    from vllm_ddtree.compat import grammar_constrains_whole_window, grammar_valid_prefix

    def grammar_bitmask(self, requests, structured_output_request_ids, scheduled_spec_decode_tokens):
        def is_tree(req_id: str) -> bool:  # the scheduler may have scheduled a prefix of the nodes: still a tree
            parents = getattr(requests[req_id], ATTRIBUTE, None)
            return parents is not None and len(parents) > len(scheduled_spec_decode_tokens.get(req_id, ()))

        if not any(is_tree(req_id) for req_id in structured_output_request_ids):
            return original(self, requests, structured_output_request_ids, scheduled_spec_decode_tokens)

        def masks(req_id: str, drafts: list[int]) -> np.ndarray:  # vLLM's rows for one request and a chain
            return original(self, requests, [req_id], {req_id: drafts}).copy()  # its buffer is reused

        pieces = []
        for req_id in structured_output_request_ids:
            drafts = scheduled_spec_decode_tokens.get(req_id, [])
            if not is_tree(req_id):
                pieces.append(masks(req_id, drafts))
                continue
            request, parents = requests[req_id], getattr(requests[req_id], ATTRIBUTE)[: len(drafts) + 1]
            if -1 not in drafts and grammar_constrains_whole_window(self, request):
                rows = self.backend.allocate_token_bitmask(len(drafts) + 1)  # [n + 1, W]
                fill_tree_bitmask_(rows, drafts, parents, request.structured_output_request.grammar, req_id)
                pieces.append(rows.numpy())
                continue
            pieces.append(tree_bitmask_rows(
                drafts,
                parents,
                lambda path, request=request: grammar_valid_prefix(self, request, path),
                lambda path, req_id=req_id: masks(req_id, path),
            ))  # fmt: skip
        return np.concatenate(pieces)

    grammar_bitmask._ddtree_hook = True
    grammar_bitmask.__wrapped__ = original
    return grammar_bitmask

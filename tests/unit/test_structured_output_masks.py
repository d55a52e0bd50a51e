"""Structured output with DDTree (vllm_ddtree/structured.py): one grammar mask per tree node, from its own path.

Oracle: a small grammar stepped along each node's path by brute force. The end-to-end checks against vLLM without
speculation are tests/e2e/test_structured_output.py and tests/serve/test_openai_api.py.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest

from vllm_ddtree.structured import ATTRIBUTE, fill_tree_bitmask_, take_tree_drafts, tree_bitmask_rows

VOCAB = 6


def allowed_after(path: list[int]) -> np.ndarray | None:
    """[VOCAB] 0/1 mask of the toy grammar after `path`, None if `path` breaks it: tokens must not fall by more than
    one, and token 5 ends the text (nothing may follow it except 5)."""
    for previous, token in zip([0] + path, path):
        if token < previous - 1 or (previous == 5 and token != 5):
            return None
    last = path[-1] if path else 0
    return np.array([int((t >= last - 1) and (last != 5 or t == 5)) for t in range(VOCAB)], dtype=np.int32)


def valid_prefix(path: list[int]) -> int:
    return max(k for k in range(len(path) + 1) if allowed_after(path[:k]) is not None)


def chain_rows(path: list[int]) -> np.ndarray:
    assert allowed_after(path) is not None, "vLLM's masks are asked for a valid chain only"
    return np.stack([allowed_after(path[:j]) for j in range(len(path) + 1)])


def random_tree(rng: random.Random, num_nodes: int) -> tuple[list[int], list[int]]:
    parents = [-1] + [rng.randrange(node) for node in range(1, num_nodes + 1)]
    tokens = [rng.randrange(VOCAB) for _ in range(num_nodes)]
    return tokens, parents


def path_of(node: int, tokens: list[int], parents: list[int]) -> list[int]:
    path = []
    while node > 0:
        path.append(tokens[node - 1])
        node = parents[node]
    return path[::-1]


@pytest.mark.parametrize("seed", range(40))
def test_every_reachable_node_gets_the_mask_of_its_own_path(seed):
    rng = random.Random(seed)
    tokens, parents = random_tree(rng, rng.randrange(0, 20))
    rows = tree_bitmask_rows(tokens, parents, valid_prefix, chain_rows)

    assert rows.shape == (len(tokens) + 1, VOCAB)
    for node in range(len(tokens) + 1):
        expected = allowed_after(path_of(node, tokens, parents))
        if expected is not None:
            assert rows[node].tolist() == expected.tolist(), (node, tokens, parents)
        else:  # a node the grammar rejects: its parent's mask, which never lets the walk reach it
            assert rows[node].tolist() == rows[parents[node]].tolist()
            assert rows[parents[node]][tokens[node - 1]] == 0 or allowed_after(
                path_of(parents[node], tokens, parents)) is None  # fmt: skip


class ToyGrammar:
    """The toy grammar behind vLLM's `StructuredOutputGrammar` calls; with `ends_at_5`, token 5 ends it instead."""

    def __init__(self, ends_at_5: bool = False):
        self.path: list[int] = []
        self.ends_at_5 = ends_at_5

    def is_terminated(self) -> bool:
        return self.ends_at_5 and self.path[-1:] == [5]

    def accept_tokens(self, req_id: str, tokens: list[int]) -> bool:
        assert not self.is_terminated()
        assert allowed_after(self.path + tokens) is not None, "offered a token its mask forbids"
        self.path += tokens
        return True

    def rollback(self, num_tokens: int) -> None:
        del self.path[len(self.path) - num_tokens :]

    def fill_bitmask(self, rows, index: int) -> None:
        rows[index, 0] = packed(allowed_after(self.path))


def packed(mask: np.ndarray) -> int:
    """A [VOCAB] 0/1 mask as vLLM's grammar backends store it: bit t of a row's int32 words is token t."""
    return sum(int(allowed) << token for token, allowed in enumerate(mask))


def walked_rows(tokens, parents, grammar) -> np.ndarray:
    """[n + 1, VOCAB] the walk's masks, unpacked (-1: a grammar that has ended masks nothing)."""
    import torch

    rows = torch.full((len(tokens) + 1, 1), 1 << 30, dtype=torch.int32)  # poisoned: every row must be written
    fill_tree_bitmask_(rows, tokens, parents, grammar, "req")
    assert grammar.path == [], "the walk leaves the grammar as it found it"
    words = rows[:, 0].tolist()
    return np.array([[-1] * VOCAB if word == -1 else [(word >> t) & 1 for t in range(VOCAB)] for word in words])


@pytest.mark.parametrize("seed", range(40))
def test_one_walk_down_the_tree_gives_each_node_the_mask_of_its_path(seed):
    rng = random.Random(seed)
    tokens, parents = random_tree(rng, rng.randrange(0, 20))
    walked = walked_rows(tokens, parents, ToyGrammar())
    assert walked.tolist() == tree_bitmask_rows(tokens, parents, valid_prefix, chain_rows).tolist()


@pytest.mark.parametrize("seed", range(20))
def test_a_grammar_that_has_ended_masks_nothing_and_accepts_nothing(seed):
    rng = random.Random(seed)
    tokens, parents = random_tree(rng, rng.randrange(1, 20))
    rows = walked_rows(tokens, parents, ToyGrammar(ends_at_5=True))
    for node in range(len(tokens) + 1):
        path = path_of(node, tokens, parents)
        ended = [j for j, token in enumerate(path) if token == 5][:1]  # where the grammar ends, if it does
        if ended and ended[0] < len(path) - 1 or allowed_after(path) is None:  # rejected: its parent's mask
            expected = None
        else:
            expected = np.full(VOCAB, -1) if ended else allowed_after(path)
        if expected is None:
            assert rows[node].tolist() == rows[parents[node]].tolist()
        else:
            assert rows[node].tolist() == expected.tolist(), (node, path)


def test_a_chain_is_masked_as_vllm_masks_it():
    tokens, parents = [1, 2, 2, 1], [-1, 0, 1, 2, 3]
    rows = tree_bitmask_rows(tokens, parents, valid_prefix, chain_rows)
    assert rows.tolist() == chain_rows(tokens).tolist()


def scheduler_with(*req_ids, prefill_chunk=(), unconstrained=()):
    requests = {
        req_id: SimpleNamespace(is_finished=lambda: False, is_prefill_chunk=req_id in prefill_chunk, spec_token_ids=[],
                                structured_output_request=None if req_id in unconstrained else object())
        for req_id in req_ids
    }  # fmt: skip
    return SimpleNamespace(requests=requests)


def drafts_of(req_ids, drafts, parents=None):
    """vLLM's own `DraftTokenIds`, with the parents the runner attaches."""
    from vllm.v1.outputs import DraftTokenIds

    draft_token_ids = DraftTokenIds(list(req_ids), [list(d) for d in drafts])
    if parents is not None:
        setattr(draft_token_ids, ATTRIBUTE, parents)
    return draft_token_ids


def test_the_scheduler_takes_a_trees_drafts_unchecked_and_leaves_the_rest_to_vllm():
    scheduler = scheduler_with("json", "free", "chunk", prefill_chunk=("chunk",), unconstrained=("free",))
    tree = [-1, 0, 0, 1, 1]
    drafts = drafts_of(["json", "free", "chunk"], [[5, 6, 7, 8], [1, 2], [3, 4]], {"json": tree, "chunk": tree})

    rest = take_tree_drafts(scheduler, drafts)

    assert (rest.req_ids, rest.draft_token_ids) == (["free"], [[1, 2]])
    assert scheduler.requests["json"].spec_token_ids == [5, 6, 7, 8]
    assert getattr(scheduler.requests["json"], ATTRIBUTE) == tree
    assert scheduler.requests["chunk"].spec_token_ids == []


def test_trees_of_unconstrained_requests_stay_vllms_to_take():
    """Model Runner V2 attaches the parents of every request of a batch with structured output."""
    scheduler = scheduler_with("json", "free", unconstrained=("free",))
    tree = [-1, 0, 0]
    rest = take_tree_drafts(scheduler, drafts_of(["json", "free"], [[5, 6], [1, 2]], {"json": tree, "free": tree}))
    assert (rest.req_ids, rest.draft_token_ids) == (["free"], [[1, 2]])
    assert getattr(scheduler.requests["free"], ATTRIBUTE, None) is None
    assert getattr(scheduler.requests["json"], ATTRIBUTE) == tree


def test_async_scheduling_fills_the_scheduled_placeholders_with_a_prefix_of_the_tree():
    scheduler = scheduler_with("json")
    scheduled = {"json": [-1, -1, -1]}
    drafts = drafts_of(["json"], [[5, 6, 7, 8]], {"json": [-1, 0, 0, 1, 1]})

    rest = take_tree_drafts(scheduler, drafts, SimpleNamespace(scheduled_spec_decode_tokens=scheduled))

    assert rest.req_ids == []
    assert scheduled["json"] == [5, 6, 7]
    assert getattr(scheduler.requests["json"], ATTRIBUTE) == [-1, 0, 0, 1]


def test_drafts_without_parents_clear_a_requests_old_parents():
    scheduler = scheduler_with("json")
    setattr(scheduler.requests["json"], ATTRIBUTE, [-1, 0])
    rest = take_tree_drafts(scheduler, drafts_of(["json"], [[5]]))
    assert rest.req_ids == ["json"]
    assert getattr(scheduler.requests["json"], ATTRIBUTE) is None


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_structured_output_is_served_on_either_model_runner(monkeypatch, runner):
    """Structured output runs on both of DDTree's model runners (V2: session 43's GPU check), so no request is
    refused for it whatever runner the engine may pick."""
    pytest.importorskip("vllm")
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from vllm_ddtree.requests import unsupported_reason

    monkeypatch.setenv("VLLM_DDTREE_RUNNER", runner)
    assert unsupported_reason(SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-z]+"))) is None


END = 9  # the reasoning's end marker in the steps below


class _ThinkTokenReasoner:
    """Ends reasoning at token END, as vLLM's think-token parsers do (`end_token_id in delta_ids`)."""

    def is_reasoning_end_streaming(self, input_ids, delta_ids) -> bool:
        return END in list(delta_ids)


class _Manager026:
    """The parts of vLLM 0.26's `StructuredOutputManager` that `_latching_reasoning_end_anywhere` reads; its own
    `should_advance` is recorded, never run (the wrapper must not ask it while reasoning holds the grammar back)."""

    def __init__(self, ddtree: bool, enable_in_reasoning: bool = False):
        self.vllm_config = SimpleNamespace(speculative_config=SimpleNamespace(ddtree_config={} if ddtree else None))
        self.enable_in_reasoning = enable_in_reasoning
        self.asked = 0

    def _get_reasoner(self, request):
        return _ThinkTokenReasoner()

    @staticmethod
    def _find_reasoning_end_index(reasoner, all_token_ids, start) -> int:
        return next(i for i in range(start, len(all_token_ids)) if all_token_ids[i] == END)


def _request(prompt: list[int]) -> SimpleNamespace:
    structured = SimpleNamespace(reasoning_ended=False, reasoning_end_token_index=None)
    return SimpleNamespace(structured_output_request=structured, all_token_ids=list(prompt),
                           num_prompt_tokens=len(prompt))  # fmt: skip


def test_a_reasoning_end_among_a_steps_tokens_latches_at_the_first_end_marker():
    """vLLM 0.26: a step accepting [7, END, 3, 4, END] ends reasoning at its first END (the prompt's END does not
    count), so the grammar gets [3, 4, END]; 0.26's own last-token check, asked instead, would have latched at the
    last END and the grammar would never have seen 3, 4, END."""
    from vllm_ddtree.structured import _latching_reasoning_end_anywhere

    def original(manager, request):
        manager.asked += 1
        return "0.26's answer"

    manager, request = _Manager026(ddtree=True), _request([1, END, 2])
    should_advance = _latching_reasoning_end_anywhere(original)
    request.all_token_ids += [5, 6]  # a step within reasoning
    assert should_advance(manager, request) is False
    assert should_advance(manager, request) is False  # asked again in the same step: nothing new to search
    step = [7, END, 3, 4, END]
    request.all_token_ids += step
    assert should_advance(manager, request) is True
    end = request.structured_output_request.reasoning_end_token_index
    assert request.structured_output_request.reasoning_ended and end == len(request.all_token_ids) - 4
    assert request.all_token_ids[end + 1:] == [3, 4, END]  # what 0.26's trim_reasoning_for_advance hands on
    assert manager.asked == 0
    assert should_advance(manager, request) == "0.26's answer"  # reasoning over: 0.26 decides again
    assert manager.asked == 1


@pytest.mark.parametrize("ddtree, enable_in_reasoning", [(False, False), (True, True)])
def test_reasoning_end_latch_leaves_other_engines_and_requests_to_vllm(ddtree, enable_in_reasoning):
    from vllm_ddtree.structured import _latching_reasoning_end_anywhere

    manager, request = _Manager026(ddtree, enable_in_reasoning), _request([1, 2])
    request.all_token_ids += [7, END, 3]
    should_advance = _latching_reasoning_end_anywhere(lambda manager, request: "0.26's answer")
    assert should_advance(manager, request) == "0.26's answer"
    assert not request.structured_output_request.reasoning_ended

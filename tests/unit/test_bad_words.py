"""bad_words at tree nodes (`verify/bad_words.py`) against vLLM's own rule (`vllm.v1.sample.ops.bad_words`, the
V1 sampler's) applied row by row with each node's context written out by hand: the request's output tokens, then
the node's path below the root, found by walking its parents. Model Runner V2's wrapper is checked against the
same, with V2's request state (all_token_ids, prompt and total lengths per slot) built from the same requests."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.v1.sample.ops.bad_words import _apply_bad_words_single_batch

from vllm_ddtree.tree import build_draft_tree
from vllm_ddtree.verify.bad_words import install_tree_bad_words, mask_v1_bad_words
from vllm_ddtree.verify.sampling import node_requests
from vllm_ddtree.verify.scorer import node_tokens
from vllm_ddtree.verify.step import build_tree_step

VOCAB = 6  # small, so that random words match often
MAX_REQS, MAX_LEN = 8, 64


def _batch(budget: int, seed: int):
    """A step of three requests (a tree, a request decoding without drafts, a tree), their outputs and words."""
    gen = torch.Generator().manual_seed(seed)
    outputs = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 0, 2)]
    roots = torch.tensor([outputs[0][-1], outputs[2][-1]])  # the root is the last output token
    draft = torch.randn(2, 4, VOCAB, generator=gen) * 2
    tree = build_draft_tree(draft, roots, budget=budget)
    num_drafts = [budget, 0, budget]
    input_ids = torch.cat([tree.token_ids[0], torch.tensor([3]), tree.token_ids[1]])  # request 1: a prompt token
    step = build_tree_step(num_drafts, torch.arange(input_ids.shape[0]), tree.parents, tree.depths, [0, -1, 1],
                           budget + 1)  # fmt: skip
    return step, input_ids, outputs, _words(step, input_ids, outputs, gen)


def _paths(step, input_ids, outputs) -> list[tuple[int, int, list[int]]]:
    """(request, logits row, the row's context: output tokens, then its path below the root) per valid node."""
    tokens = node_tokens(step, input_ids)
    rows = []
    for req, count in enumerate(step.num_nodes_cpu.tolist()):
        for node in range(count):
            path, at = [], node
            while int(step.parents[req, at]) >= 0:
                path.append(int(tokens[req, at]))
                at = int(step.parents[req, at])
            rows.append((req, int(step.node_rows[req, node]), outputs[req] + path[::-1]))
    return rows


def _words(step, input_ids, outputs, gen) -> dict[int, list[list[int]]]:
    """Per request: random words of 1-4 tokens, and words that end a real node's context (so they ban something
    below the root, some reaching back into the output tokens)."""
    words = {0: [], 2: []}
    for req, _, context in _paths(step, input_ids, outputs):
        if req in words and context and torch.rand((), generator=gen) < 0.3:
            length = int(torch.randint(1, min(len(context), 4) + 1, (), generator=gen))
            words[req].append(context[-length:] + [int(torch.randint(0, VOCAB, (), generator=gen))])
    for req in words:
        words[req] += [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (1, 2, 3, 4)]
    return words


def _expected(logits, step, input_ids, outputs, words):
    expected = logits.clone()
    for req, row, context in _paths(step, input_ids, outputs):
        if req in words:
            _apply_bad_words_single_batch(expected[row], words[req], context)
    return expected


def _v1_metadata(outputs, words):
    return SimpleNamespace(bad_words_token_ids=words, output_token_ids=outputs)


@pytest.mark.parametrize("budget,seed", [(1, 0), (4, 1), (9, 2), (15, 3)])
def test_tree_bad_words_match_vllms_rule_along_each_path(budget, seed):
    step, input_ids, outputs, words = _batch(budget, seed)
    logits = torch.randn(input_ids.shape[0], VOCAB, generator=torch.Generator().manual_seed(seed + 10))

    got = mask_v1_bad_words(logits, step, node_tokens(step, input_ids), _v1_metadata(outputs, words))

    expected = _expected(logits, step, input_ids, outputs, words)
    assert torch.equal(got, expected)
    assert torch.isinf(got).sum() > torch.isinf(logits).sum()  # some words matched
    assert not torch.isinf(logits).any()  # the input is not modified


def _v2_bad_words_state(slots, prompts, outputs):
    all_tokens = torch.full((MAX_REQS, MAX_LEN), -7, dtype=torch.int32)  # -7: never read
    prompt_len = torch.zeros(MAX_REQS, dtype=torch.int32)
    total_len = torch.zeros(MAX_REQS, dtype=torch.int32)
    for slot, prompt, out in zip(slots, prompts, outputs):
        tokens = prompt + out
        all_tokens[slot, : len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
        prompt_len[slot], total_len[slot] = len(prompt), len(tokens)
    req_states = SimpleNamespace(
        all_token_ids=SimpleNamespace(gpu=all_tokens), prompt_len=SimpleNamespace(gpu=prompt_len),
        total_len=SimpleNamespace(gpu=total_len),
    )  # fmt: skip
    calls = []
    state = SimpleNamespace(
        req_states=req_states,
        add_request=lambda req_idx, params: calls.append(("add", req_idx)),
        apply_bad_words=lambda *args, **kwargs: calls.append(("v2", args)),
    )
    return state, calls


@pytest.mark.parametrize("budget,seed", [(4, 4), (15, 5)])
def test_v2_wrapper_reads_the_outputs_from_v2s_state(budget, seed):
    step, input_ids, outputs, words = _batch(budget, seed)
    slots, prompts = [5, 2, 7], [[1, 2, 3], [4, 4], [0]]
    bad_words_state, calls = _v2_bad_words_state(slots, prompts, outputs)
    runner_state = SimpleNamespace(step=None)
    install_tree_bad_words(bad_words_state, runner_state)
    for req, slot in enumerate(slots):
        bad_words_state.add_request(slot, SimpleNamespace(bad_words_token_ids=words.get(req)))
    assert [c[0] for c in calls] == ["add"] * 3  # V2's own add_request still runs
    logits = torch.randn(input_ids.shape[0], VOCAB, generator=torch.Generator().manual_seed(seed + 10))
    expanded = torch.tensor(slots)[node_requests(step)]  # [rows] slot of each row
    local_pos = torch.cat([torch.arange(n) for n in step.num_nodes_cpu.tolist()])

    got = logits.clone()
    bad_words_state.apply_bad_words(got, expanded, np.array(slots), input_ids, local_pos)  # not a tree step
    assert calls[-1][0] == "v2" and torch.equal(got, logits)
    runner_state.step = step
    bad_words_state.apply_bad_words(got, expanded, np.array(slots), input_ids, local_pos)

    assert len(calls) == 4  # the tree rule ran instead of V2's kernel
    assert torch.equal(got, _expected(logits, step, input_ids, outputs, words))
    assert torch.isinf(got).any()
    # V2's logits rows can be a strided view (the H200 run of the e2e test hit `view` on one): the same bans land.
    wide = torch.zeros(logits.shape[0], VOCAB + 3)
    strided = wide[:, :VOCAB]
    strided.copy_(logits)
    bad_words_state.apply_bad_words(strided, expanded, np.array(slots), input_ids, local_pos)
    assert not strided.is_contiguous() and torch.equal(strided, got)
    assert not wide[:, VOCAB:].any()  # nothing written past the view


def test_v2_wrapper_without_words_in_the_batch_runs_v2s_kernel():
    step, input_ids, outputs, _ = _batch(4, 6)
    slots = [5, 2, 7]
    bad_words_state, calls = _v2_bad_words_state(slots, [[1], [2], [3]], outputs)
    install_tree_bad_words(bad_words_state, SimpleNamespace(step=step))
    for slot in slots:
        bad_words_state.add_request(slot, SimpleNamespace(bad_words_token_ids=None))
    bad_words_state.add_request(0, SimpleNamespace(bad_words_token_ids=[[1, 2]]))  # a slot outside the batch
    logits = torch.zeros(input_ids.shape[0], VOCAB)
    bad_words_state.apply_bad_words(logits, torch.tensor(slots)[node_requests(step)], np.array(slots), input_ids, None)
    assert calls[-1][0] == "v2"


def test_v2_wrapper_in_vllm_032s_form():
    """0.32's BadWordsState is a logits processor: `apply(logits, ctx)` with the batch on a LogitsContext."""
    step, input_ids, outputs, words = _batch(4, 7)
    slots = [5, 2, 7]
    bad_words_state, calls = _v2_bad_words_state(slots, [[1], [2], [3]], outputs)
    del bad_words_state.apply_bad_words
    bad_words_state.apply = lambda logits, ctx: calls.append("v2") or logits
    install_tree_bad_words(bad_words_state, SimpleNamespace(step=step))
    for req, slot in enumerate(slots):
        bad_words_state.add_request(slot, SimpleNamespace(bad_words_token_ids=words.get(req)))
    logits = torch.randn(input_ids.shape[0], VOCAB, generator=torch.Generator().manual_seed(3))
    ctx = SimpleNamespace(expanded_idx_mapping=torch.tensor(slots)[node_requests(step)], idx_mapping_np=np.array(slots),
                          input_ids=input_ids)  # fmt: skip
    got = bad_words_state.apply(logits.clone(), ctx)
    assert "v2" not in calls and torch.equal(got, _expected(logits, step, input_ids, outputs, words))


def test_compat_finds_v2s_bad_words_state_in_either_release():
    from vllm.v1.worker.gpu.sample.bad_words import BadWordsState

    from vllm_ddtree.compat import v2_bad_words_state

    state = BadWordsState.__new__(BadWordsState)  # no request state needed to tell it apart
    assert v2_bad_words_state(SimpleNamespace(logits_processors=[object(), state])) is state  # 0.32
    assert v2_bad_words_state(SimpleNamespace(bad_words_state=state, logits_processors=[])) is state  # 0.26


def test_a_banned_token_past_the_logits_bans_nothing():
    """vLLM's rule slices `logits[t : t + 1]`, empty for t >= V: no ban, and nothing written into the next row."""
    step, input_ids, outputs, _ = _batch(4, 8)
    logits = torch.randn(input_ids.shape[0], VOCAB, generator=torch.Generator().manual_seed(8))
    words = {0: [[VOCAB]], 2: [[VOCAB + 1]]}
    got = mask_v1_bad_words(logits, step, node_tokens(step, input_ids), _v1_metadata(outputs, words))
    assert torch.equal(got, _expected(logits, step, input_ids, outputs, words)) and torch.equal(got, logits)

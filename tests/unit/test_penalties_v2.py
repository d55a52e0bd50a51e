"""Penalties for tree rows on Model Runner V2 (`verify/penalties_v2.py`), against two oracles:
- the V1 scorer's penalties (`sampling.apply_penalties_`, itself checked exactly in test_sampling_exact.py), fed
  the same requests through V1's metadata (token lists) instead of V2's state (bin counts, packed prompt bits);
- on a chain, V2's own kernel rule restated in torch (row j counts the request's draft tokens 1..j).
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_ddtree.tree import build_draft_tree
from vllm_ddtree.verify.penalties_v2 import install_tree_penalties, tree_penalties_, unpack_bits
from vllm_ddtree.verify.sampling import apply_penalties_, node_requests
from vllm_ddtree.verify.scorer import node_tokens
from vllm_ddtree.verify.step import build_tree_step

VOCAB = 40
MAX_REQS = 8


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """[rows, V] bool -> [rows, ceil(V / 32)] int32, bit b of word w = item 32 w + b (V2's prompt_bin_mask)."""
    rows, vocab = mask.shape
    words = -(-vocab // 32)
    padded = torch.zeros(rows, words * 32, dtype=torch.int64)
    padded[:, :vocab] = mask.long()
    values = (padded.view(rows, words, 32) << torch.arange(32)).sum(-1)
    return torch.where(values >= 2**31, values - 2**32, values).to(torch.int32)


def _requests(seed: int):
    gen = torch.Generator().manual_seed(seed)
    slots = [5, 2, 7]  # request slots (req_state_idx) of the batch's three requests
    outputs = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (6, 0, 3)]
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (4, 9, 1)]
    params = [(1.3, 0.4, 0.2), (0.8, -0.2, 0.5), (1.0, 0.0, 0.0)]  # (repetition, frequency, presence)
    return slots, outputs, prompts, params


def _v2_state(slots, outputs, prompts, params):
    counts = torch.zeros(MAX_REQS, VOCAB, dtype=torch.int32)
    prompt_mask = torch.zeros(MAX_REQS, VOCAB, dtype=torch.bool)
    rep, freq, pres = torch.ones(MAX_REQS), torch.zeros(MAX_REQS), torch.zeros(MAX_REQS)
    use = np.zeros(MAX_REQS, dtype=bool)
    for slot, out, prompt, (r, f, p) in zip(slots, outputs, prompts, params):
        counts[slot] = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=VOCAB).int()
        prompt_mask[slot, prompt] = True
        rep[slot], freq[slot], pres[slot] = r, f, p
        use[slot] = (r, f, p) != (1.0, 0.0, 0.0)
    return SimpleNamespace(
        output_bin_counts=counts,
        prompt_bin_mask=_pack_bits(prompt_mask),
        repetition_penalty=SimpleNamespace(gpu=rep),
        frequency_penalty=SimpleNamespace(gpu=freq),
        presence_penalty=SimpleNamespace(gpu=pres),
        use_penalty=use,
    )


def _v1_metadata(outputs, prompts, params):
    width = max(len(p) for p in prompts)
    prompt_ids = torch.full((len(prompts), width), VOCAB, dtype=torch.int64)  # vLLM pads prompts with V
    for i, p in enumerate(prompts):
        prompt_ids[i, : len(p)] = torch.tensor(p)
    rep, freq, pres = (torch.tensor([p[k] for p in params]) for k in range(3))
    return SimpleNamespace(
        output_token_ids=outputs, prompt_token_ids=prompt_ids, repetition_penalties=rep,
        frequency_penalties=freq, presence_penalties=pres,
    )  # fmt: skip


def _step(budget: int, chain: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    draft = torch.randn(2, 4, VOCAB, generator=gen) * 4
    if chain:
        draft = draft * 0 + torch.arange(VOCAB) * 0.01  # argmax everywhere: max_topk=1 gives a chain
    tree = build_draft_tree(draft, torch.tensor([1, 2]), budget=budget, max_topk=1 if chain else None)
    # Request 0 verifies tree 0, request 1 decodes without drafts, request 2 verifies tree 1.
    num_drafts = [budget, 0, budget]
    input_ids = torch.cat([tree.token_ids[0], torch.tensor([9]), tree.token_ids[1]])
    step = build_tree_step(num_drafts, torch.arange(input_ids.shape[0]), tree.parents, tree.depths, [0, -1, 1],
                           budget + 1)  # fmt: skip
    return step, input_ids


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_penalties_match_the_v1_scorers(seed):
    slots, outputs, prompts, params = _requests(seed)
    step, input_ids = _step(budget=4 if seed else 1, chain=False, seed=seed)
    rows = input_ids.shape[0]
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed + 10)) * 3
    expanded = torch.tensor(slots)[node_requests(step)]  # [rows] slot of each row

    expected = apply_penalties_(logits.clone(), node_requests(step), step, node_tokens(step, input_ids),
                                _v1_metadata(outputs, prompts, params))  # fmt: skip
    got = logits.clone()
    tree_penalties_(got, step, input_ids, expanded, _v2_state(slots, outputs, prompts, params))

    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert not torch.equal(got, logits)  # the penalties did something


def test_on_a_chain_they_match_v2s_own_rule():
    slots, outputs, prompts, params = _requests(3)
    step, input_ids = _step(budget=4, chain=True, seed=3)
    assert step.parents[0].tolist() == [-1, 0, 1, 2, 3]
    rows = input_ids.shape[0]
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(4)) * 3
    state = _v2_state(slots, outputs, prompts, params)
    expanded = torch.tensor(slots)[node_requests(step)]
    local = torch.cat([torch.arange(n) for n in step.num_nodes_cpu.tolist()])

    # V2's kernel, restated: row j of a request counts its output tokens and the tokens at local positions 1..j.
    expected = logits.clone()
    prompt_bits = unpack_bits(state.prompt_bin_mask, VOCAB)
    for row in range(rows):
        slot, j = int(expanded[row]), int(local[row])
        counts = state.output_bin_counts[slot].float().clone()
        for k in range(1, j + 1):
            counts[input_ids[row - j + k]] += 1
        seen = (counts > 0) | prompt_bits[slot]
        r, f, p = (float(x.gpu[slot]) for x in (state.repetition_penalty, state.frequency_penalty,
                                                   state.presence_penalty))  # fmt: skip
        x = expected[row]
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
        expected[row] = x - f * counts - p * (counts > 0)
    got = logits.clone()
    tree_penalties_(got, step, input_ids, expanded, state)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_the_wrapper_runs_v2s_kernel_outside_tree_steps_and_for_unpenalized_batches():
    slots, outputs, prompts, params = _requests(5)
    penalties = _v2_state(slots, outputs, prompts, params)
    calls = []
    penalties.apply_penalties = lambda *args, **kwargs: calls.append("v2")
    runner_state = SimpleNamespace(step=None)
    install_tree_penalties(penalties, runner_state)
    install_tree_penalties(penalties, runner_state)  # idempotent
    logits = torch.zeros(3, VOCAB)
    penalties.apply_penalties(logits, torch.tensor(slots), np.array(slots), torch.zeros(3), torch.zeros(3))
    assert calls == ["v2"]  # no tree step: V2's own kernel
    runner_state.step, input_ids = _step(budget=2, chain=False, seed=5)
    rows = input_ids.shape[0]
    no_penalty_slots = np.array([2, 2, 2])
    penalties.use_penalty[:] = False
    penalties.apply_penalties(torch.zeros(rows, VOCAB), torch.tensor([2] * rows), no_penalty_slots, input_ids, None)
    assert calls == ["v2", "v2"]  # nothing penalized: V2's kernel (it skips the launch itself)
    penalties.use_penalty[slots[0]] = True
    logits = torch.randn(rows, VOCAB)
    before = logits.clone()
    expanded = torch.tensor(slots)[node_requests(runner_state.step)]
    penalties.apply_penalties(logits, expanded, np.array(slots), input_ids, None)
    assert calls == ["v2", "v2"] and not torch.equal(logits, before)  # the tree rule, in place


def test_unpack_bits_reads_v2s_packing():
    mask = torch.rand(3, 70) > 0.5
    mask[:, 31] = True  # the sign bit of a word
    assert torch.equal(unpack_bits(_pack_bits(mask), 70), mask)


def test_the_wrapper_speaks_vllm_0_32s_call_too():
    slots, outputs, prompts, params = _requests(6)
    penalties = _v2_state(slots, outputs, prompts, params)
    penalties.apply = lambda logits, ctx: "v2"  # 0.32: PenaltiesState.apply(logits, ctx)
    runner_state = SimpleNamespace(step=None)
    install_tree_penalties(penalties, runner_state)
    ctx = SimpleNamespace(idx_mapping_np=np.array(slots), expanded_idx_mapping=torch.tensor(slots),
                          input_ids=torch.zeros(3, dtype=torch.int64))  # fmt: skip
    assert penalties.apply(torch.zeros(3, VOCAB), ctx) == "v2"
    runner_state.step, input_ids = _step(budget=3, chain=False, seed=6)
    expanded = torch.tensor(slots)[node_requests(runner_state.step)]
    ctx = SimpleNamespace(idx_mapping_np=np.array(slots), expanded_idx_mapping=expanded, input_ids=input_ids)
    logits = torch.randn(input_ids.shape[0], VOCAB)
    expected = logits.clone()
    tree_penalties_(expected, runner_state.step, input_ids, expanded, penalties)
    assert torch.equal(penalties.apply(logits, ctx), expected)

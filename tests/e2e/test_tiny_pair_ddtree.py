"""DDTree with a drafter that agrees with its target (tests/fixtures/tiny_pair, trained by the project): long
accepted paths really happen, and the output stays token-identical to vLLM without speculation, also when a
request ends inside an accepted path (max_tokens, a stop token) or runs up to max_model_len."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.engine import make_llm, run
from vllm_ddtree.compat import shutdown_llm

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "tiny_pair"
TARGET = str(FIXTURE / "target")
DRAFTER = str(FIXTURE / "drafter")
BLOCK_SIZE = json.loads((FIXTURE / "drafter" / "config.json").read_text())["block_size"]
ENGINE = dict(skip_tokenizer_init=False, max_model_len=512)

pytestmark = pytest.mark.slow


def ddtree(budget: int) -> dict:
    return {"method": "ddtree", "model": DRAFTER, "num_speculative_tokens": budget}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    texts = json.loads((FIXTURE / "prompts.json").read_text())[:12]
    return [tokenizer.encode(t) for t in texts]


def greedy(max_tokens: int, **kwargs):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False, **kwargs)


@pytest.fixture(scope="module")
def baseline(prompts):
    # Answers end with the target's EOS (past it the target leaves its training language and nothing agrees).
    return run(TARGET, None, prompts, greedy(96), **ENGINE)


@pytest.mark.parametrize("budget", [3, BLOCK_SIZE, 2 * BLOCK_SIZE + 1, 31])
def test_long_accepted_paths_and_identical_output(prompts, baseline, budget):
    result = run(TARGET, ddtree(budget), prompts, greedy(96), **ENGINE)
    assert result.token_ids == baseline.token_ids
    assert result.finish_reasons == baseline.finish_reasons
    assert result.acceptance_length > 3.0, result.metrics
    per_pos = result.metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert per_pos[min(budget, BLOCK_SIZE - 1) - 1] > 0  # some paths reach the deepest level the tree allows


def test_requests_ending_inside_accepted_paths(prompts, baseline):
    """max_tokens and stop tokens cut accepted paths; max_model_len truncates the drafts of a request."""
    llm = make_llm(TARGET, ddtree(BLOCK_SIZE + 1), **ENGINE)
    try:
        from tests.e2e.engine import generate

        for max_tokens in (1, 2, 5, 11, 17):
            result = generate(llm, prompts, greedy(max_tokens))
            assert result.token_ids == [t[:max_tokens] for t in baseline.token_ids]
        # A stop token that occurs mid-output: each request must end right at its first occurrence.
        stop = baseline.token_ids[0][len(baseline.token_ids[0]) // 2]
        result = generate(llm, prompts, greedy(96, stop_token_ids=[stop]))
        for tokens, full, reason in zip(result.token_ids, baseline.token_ids, result.finish_reasons):
            expected = full[: full.index(stop) + 1] if stop in full else full
            assert tokens == expected
            assert reason == "stop"
        assert result.acceptance_length > 2.0
    finally:
        shutdown_llm(llm)


def test_eos_inside_accepted_path(prompts, baseline):
    """Every answer ends with the target's EOS, mostly inside a long accepted path."""
    eos = 2
    assert all(t[-1] == eos for t in baseline.token_ids) and set(baseline.finish_reasons) == {"stop"}
    tree = run(TARGET, ddtree(BLOCK_SIZE), prompts, greedy(96), **ENGINE)
    assert tree.token_ids == baseline.token_ids
    assert tree.finish_reasons == baseline.finish_reasons


def test_min_tokens_masks_eos_by_node_depth(prompts, baseline):
    """min_tokens keeps EOS out of every node whose depth leaves the answer short of it; past that, EOS ends the
    answer as usual. Per-request limits around each answer's own EOS, so the limit falls inside accepted paths and
    some requests are not limited at all; vLLM without speculation is the oracle."""
    lengths = [len(t) for t in baseline.token_ids]  # each answer ends with EOS
    limits = [min(max(n + shift, 0), 96) for n, shift in zip(lengths, [-3, 0, 1, 5, 9, 17] * 2)]
    params = [greedy(96, min_tokens=m) for m in limits]
    plain = run(TARGET, None, prompts, params, **ENGINE)
    tree = run(TARGET, ddtree(BLOCK_SIZE + 1), prompts, params, **ENGINE)
    assert tree.token_ids == plain.token_ids
    assert tree.finish_reasons == plain.finish_reasons
    assert all(len(t) >= m for t, m in zip(tree.token_ids, limits))
    assert sum(t != b for t, b in zip(plain.token_ids, baseline.token_ids)) >= 6  # the limit changed those answers


def test_bad_words_match_along_tree_paths(prompts, baseline):
    """A piece of each answer without speculation (2-4 tokens, from different offsets), banned: a word spans several
    nodes of a path and reaches back into the answer's earlier tokens. vLLM without speculation is the oracle."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    pieces = [tokenizer.decode(t[3 + i % 5 : 5 + i % 5 + i % 3]) for i, t in enumerate(baseline.token_ids)]
    params = [greedy(96, bad_words=[piece]) for piece in pieces]
    plain = run(TARGET, None, prompts, params, **ENGINE)
    tree = run(TARGET, ddtree(BLOCK_SIZE + 1), prompts, params, **ENGINE)
    assert tree.token_ids == plain.token_ids
    assert tree.finish_reasons == plain.finish_reasons
    assert sum(t != b for t, b in zip(plain.token_ids, baseline.token_ids)) >= 6  # the bans changed those answers
    # Past a ban the answers leave the drafter's training text (acceptance ~1.6), yet deep paths are still accepted.
    assert tree.metrics["vllm:spec_decode_num_accepted_tokens_per_pos"][3] > 0, tree.metrics


def test_generation_up_to_max_model_len(prompts):
    max_model_len = max(len(p) for p in prompts) + 40
    engine = dict(ENGINE, max_model_len=max_model_len)
    plain = run(TARGET, None, prompts, greedy(max_model_len, ignore_eos=True), **engine)
    tree = run(TARGET, ddtree(2 * BLOCK_SIZE), prompts, greedy(max_model_len, ignore_eos=True), **engine)
    assert tree.token_ids == plain.token_ids
    assert all(len(p) + len(t) == max_model_len for p, t in zip(prompts, tree.token_ids))


def test_budget_per_batch_size(prompts, baseline):
    """`num_speculative_tokens_per_batch_size` (vLLM's key): requests end at different lengths, so the batch shrinks
    from 12 through every range of the schedule: no speculation at 9-12 requests, the first 5 nodes of each tree at
    4-8, the whole 31-node tree at 1-3. Each step verifies a prefix of the best-first tree (itself a tree), and the
    output stays token-identical to vLLM without speculation."""
    budget, small = 31, 5
    spec = dict(ddtree(budget), num_speculative_tokens_per_batch_size=[[1, 3, budget], [4, 8, small], [9, 64, 0]])
    result = run(TARGET, spec, prompts, greedy(96), **ENGINE)
    assert result.token_ids == baseline.token_ids
    assert result.finish_reasons == baseline.finish_reasons
    m = result.metrics
    drafts, draft_tokens = m["vllm:spec_decode_num_drafts"], m["vllm:spec_decode_num_draft_tokens"]
    per_pos = m["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert small * drafts < draft_tokens < budget * drafts  # both tree sizes were verified
    assert per_pos[small] > 0  # paths past the small tree's reach: the whole tree at small batches
    assert result.acceptance_length > 2.0, m


def test_one_token_per_depth_verifies_the_chains_own_drafts(prompts, baseline):
    """With `max_topk` 1 and B = block - 1 the best-first tree is the chain of the drafter's argmaxes, i.e. vLLM's
    DFlash chain drafts, verified through DDTree's path (tree layout, ancestor masks, walk, KV compaction, the
    drafter conditioned on the accepted nodes). So it accepts what the chain accepts, position by position, and
    both keep the output of no speculation (benchmark.py's `-chaintree`: DDTree's cost at the chain's acceptance)."""
    depth = BLOCK_SIZE - 1
    chain = run(TARGET, {"method": "dflash", "model": DRAFTER, "num_speculative_tokens": depth}, prompts, greedy(96),
                **ENGINE)  # fmt: skip
    tree = run(TARGET, dict(ddtree(depth), max_topk=1), prompts, greedy(96), **ENGINE)
    assert chain.token_ids == baseline.token_ids and tree.token_ids == baseline.token_ids
    for name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos"):
        assert tree.metrics[name] == chain.metrics[name], name
    assert tree.acceptance_length > 3.0, tree.metrics


def test_preempted_requests_keep_greedy_output(prompts):
    """A KV cache of ~384 tokens for twelve requests that each grow to ~220: vLLM preempts running requests (frees
    their KV and recomputes them later) again and again, also between a tree's verification and the next draft.
    DDTree's per-request state (the drafter's context rows, the accepted path's KV, remembered trees) must follow,
    and the output stays token-identical to vLLM without speculation and without preemption."""
    from tests.e2e.engine import generate, metric

    params = greedy(200, ignore_eos=True)  # past EOS: longer answers, that still need drafts and accept some
    engine = dict(ENGINE, max_model_len=256)
    plain = run(TARGET, None, prompts, params, **engine)
    llm = make_llm(TARGET, ddtree(2 * BLOCK_SIZE + 1), **dict(engine, kv_cache_memory_bytes=600_000))
    try:
        tree = generate(llm, prompts, params)
        preemptions = metric(llm, "vllm:num_preemptions")
    finally:
        shutdown_llm(llm)
    assert preemptions > 10, "the small KV cache should have preempted requests"
    assert tree.token_ids == plain.token_ids
    assert tree.acceptance_length > 1.2, tree.metrics


def test_requests_aborted_mid_answer(prompts, baseline):
    """Every other request is aborted between two steps, partway into its answer (a client that went away, without
    the API server's timing): the others' answers stay token-identical to vLLM without speculation, the aborted
    ones' partial answers are prefixes of theirs, and nothing of the aborted requests is left behind (the engine
    answers every prompt again as before, with its KV cache all free)."""
    from tests.e2e.engine import generate, metric

    llm = make_llm(TARGET, ddtree(2 * BLOCK_SIZE + 1), **ENGINE)
    try:
        engine = llm.llm_engine
        for i, p in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": p}, greedy(96))
        answers, steps = {}, 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                answers[int(output.request_id)] = list(output.outputs[0].token_ids)
            steps += 1
            if steps == 3:
                aborted = [i for i in range(1, len(prompts), 2) if len(answers.get(i, [])) < len(baseline.token_ids[i])]
                engine.abort_request([str(i) for i in aborted])
        again = generate(llm, prompts, greedy(96))
        kv_usage = metric(llm, "vllm:kv_cache_usage_perc")
    finally:
        shutdown_llm(llm)
    assert len(aborted) >= 3, "the aborts should catch requests mid-answer"
    for i, expected in enumerate(baseline.token_ids):
        if i in aborted:
            assert 0 < len(answers[i]) < len(expected) and answers[i] == expected[: len(answers[i])], i
        else:
            assert answers[i] == expected, i
    assert again.token_ids == baseline.token_ids
    assert kv_usage == 0.0


def test_chunked_prefill_and_prefix_cache_keep_greedy_output():
    """Eight ~410-token prompts sharing a ~386-token prefix, 128 batched tokens a step (vLLM 0.26 keeps 4 x 17 of
    them for the drafter's query slots, 0.32 none) and 4 requests: the prompts prefill in chunks in the same steps
    as other requests' tree verifications, and the second round reuses the first's cached prefix blocks (which
    tree KV writes must never touch). Oracle: vLLM without speculation."""
    from transformers import AutoTokenizer

    from tests.e2e.engine import generate, metric

    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    texts = json.loads((FIXTURE / "prompts.json").read_text())
    shared = " ".join(texts[8:24])
    prompts = [tokenizer.encode(f"{shared} {text}") for text in texts[:8]]
    engine = dict(ENGINE, max_num_batched_tokens=128, max_num_seqs=4)
    plain = run(TARGET, None, prompts, greedy(64), **engine)
    llm = make_llm(TARGET, ddtree(2 * BLOCK_SIZE + 1), **engine)
    try:
        rounds = [generate(llm, prompts, greedy(64)) for _ in range(2)]
        hits = metric(llm, "vllm:prefix_cache_hits")
    finally:
        shutdown_llm(llm)
    assert min(len(p) for p in prompts) > 128  # every prompt needs several chunks
    assert hits > 0
    assert [r.token_ids for r in rounds] == [plain.token_ids] * 2
    assert rounds[0].acceptance_length > 1.0, rounds[0].metrics


@pytest.mark.parametrize("max_depth,budget,max_topk", [(1, 5, None), (3, 20, None), (5, 40, 3)])
def test_max_depth_caps_the_tree_below_the_block(prompts, baseline, max_depth, budget, max_topk):
    """`max_depth` below the drafter's block - 1 (7): every size derived from the depth (tree levels, the drafter's
    KV lookahead, accepted positions) follows the cap, the budget stays independent of both, and the output stays
    token-identical to vLLM without speculation."""
    spec = dict(ddtree(budget), max_depth=max_depth, **({"max_topk": max_topk} if max_topk else {}))
    result = run(TARGET, spec, prompts, greedy(96), **ENGINE)
    assert result.token_ids == baseline.token_ids
    per_pos = result.metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == budget  # vLLM counts per draft slot: B of them
    assert per_pos[max_depth - 1] > 0 and not any(per_pos[max_depth:]), per_pos
    assert result.acceptance_length > 1 + 0.5 * max_depth, result.metrics


@pytest.mark.parametrize("max_depth,budget", [(3, 20), (None, 2 * BLOCK_SIZE + 1)])
def test_per_path_chains_follow_the_depth_bound(prompts, baseline, max_depth, budget, monkeypatch):
    """VLLM_DDTREE_PER_PATH_ATTENTION=chains (on the CPU through the pure-torch stand-in for FA3, which refuses a
    sequence longer than the call's max_seqlen_q, as FA3 would misread it) sizes its calls by the trees' depth bound:
    the drafter's block - 1, or max_depth below it. This pair's trees are deep (the drafter agrees with its target),
    so chains reach that bound, and the output stays token-identical to vLLM without speculation."""
    monkeypatch.setenv("VLLM_DDTREE_PER_PATH_ATTENTION", "chains")
    spec = dict(ddtree(budget), **({"max_depth": max_depth} if max_depth else {}))
    result = run(TARGET, spec, prompts, greedy(96), **ENGINE)
    assert result.token_ids == baseline.token_ids
    per_pos = result.metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert per_pos[(max_depth or BLOCK_SIZE - 1) - 1] > 0, per_pos  # accepted paths (chains) reach the bound

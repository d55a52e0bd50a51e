"""DDTree returns logprobs like vLLM: output token j gets the logprobs of the logits row of the path node that
produced it (raw logprobs by default, vLLM's `logprobs_mode`).

Greedy: the returned logprobs (token, top-k, ranks) equal plain vLLM's within 1e-4. Sampled: every returned logprob
is the target's at that token's context, recomputed with transformers (raw, or processed = temperature applied,
with `logprobs_mode="processed_logprobs"`). `prompt_logprobs` (from the prefill) equal plain vLLM's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.e2e.engine import Engine
from tests.tiny_models import make_tiny_dflash_drafter, make_tiny_target

VOCAB = 64
PROMPTS = [[5, 17, 33, 8], [7], [40, 41, 42, 43, 44, 45, 46], [3, 9] * 6, [60, 2, 2, 31, 17]]
MAX_TOKENS = 16
NUM_LOGPROBS = [5, 0, 3, 5, 1]  # per prompt: the batch computes the largest, vLLM trims per request
TOL = 1e-4
CASES = [(7, "raw_logprobs"), (3, "processed_logprobs")]  # (budget, logprobs_mode)


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_logprobs")
    target = make_tiny_target(root / "target", num_layers=1, vocab_size=VOCAB, lm_head_scale=16.0)
    drafter = make_tiny_dflash_drafter(root / "drafter", block_size=8, num_target_layers=1, vocab_size=VOCAB)
    return str(target), str(drafter)


def generate(llm, sampling_params) -> list:
    """The first completion of every prompt (token_ids, logprobs)."""
    from vllm.inputs import TokensPrompt

    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], sampling_params, use_tqdm=False)
    return [o.outputs[0] for o in outputs]


def greedy_params(**kwargs) -> list:
    from vllm import SamplingParams

    return [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=k, ignore_eos=True, detokenize=False, **kwargs)
        for k in NUM_LOGPROBS
    ]


def sampled_params(temperature: float) -> list:
    from vllm import SamplingParams

    return [
        SamplingParams(temperature=temperature, seed=7 + i, max_tokens=MAX_TOKENS, logprobs=k, ignore_eos=True,
                       detokenize=False)
        for i, k in enumerate(NUM_LOGPROBS)
    ]  # fmt: skip


@pytest.fixture(scope="module")
def plain(models):
    """Plain vLLM's greedy outputs and prompt logprobs (one engine, before DDTree's: one engine at a time)."""
    engine = Engine(models[0], None)
    try:
        return generate(engine.llm, greedy_params()), prompt_logprobs(engine.llm)
    finally:
        engine.close()


@pytest.fixture(scope="module", params=CASES, ids=lambda case: f"B{case[0]}-{case[1]}")
def ddtree(request, models, plain):
    budget, mode = request.param
    spec = {"method": "ddtree", "model": models[1], "num_speculative_tokens": budget}
    engine = Engine(models[0], spec, logprobs_mode=mode)
    yield mode, engine
    engine.close()


def test_greedy_logprobs_equal_plain_vllm(ddtree, plain):
    _, engine = ddtree
    for i, (ours, theirs) in enumerate(zip(generate(engine.llm, greedy_params()), plain[0])):
        assert list(ours.token_ids) == list(theirs.token_ids), f"prompt {i}"
        assert len(ours.logprobs) == len(theirs.logprobs) == MAX_TOKENS
        for j, (a, b) in enumerate(zip(ours.logprobs, theirs.logprobs)):
            assert set(a) == set(b), (i, j, sorted(a), sorted(b))
            assert len(a) in (NUM_LOGPROBS[i], NUM_LOGPROBS[i] + 1)  # top-k plus the token when outside it
            for token, lp in a.items():
                assert abs(lp.logprob - b[token].logprob) < TOL, (i, j, token, lp, b[token])
                assert lp.rank == b[token].rank, (i, j, token, lp, b[token])


def prompt_logprobs(llm) -> list:
    """Every prompt's `prompt_logprobs` (2 per position) as (token, logprob, rank) lists; greedy, 4 new tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    return [[None if d is None else sorted((t, lp.logprob, lp.rank) for t, lp in d.items()) for d in o.prompt_logprobs]
            for o in outputs]  # fmt: skip


def test_prompt_logprobs_equal_plain_vllm(ddtree, plain):
    """`prompt_logprobs` come from the prefill, before any tree: the same as plain vLLM's."""
    _, engine = ddtree
    for i, (ours, theirs) in enumerate(zip(prompt_logprobs(engine.llm), plain[1])):
        assert len(ours) == len(theirs) == len(PROMPTS[i]) and ours[0] is None, i
        for j, (a, b) in enumerate(zip(ours[1:], theirs[1:]), start=1):
            assert [(t, r) for t, _, r in a] == [(t, r) for t, _, r in b], (i, j)
            assert all(abs(x[1] - y[1]) < TOL for x, y in zip(a, b)), (i, j, a, b)


def target_logprobs(target: str, prompt: list[int], tokens: list[int], temperature: float) -> np.ndarray:
    """[len(tokens), V] log-softmax(logits / temperature) of the target before each of `tokens`."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(target, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return (logits.double() / temperature).log_softmax(dim=-1).numpy()


def test_sampled_logprobs_are_the_targets(ddtree, models):
    mode, engine = ddtree
    temperature = 0.8
    for i, out in enumerate(generate(engine.llm, sampled_params(temperature))):
        tokens = list(out.token_ids)
        want = target_logprobs(models[0], PROMPTS[i], tokens, temperature if mode.startswith("processed") else 1.0)
        assert len(out.logprobs) == MAX_TOKENS
        for j, (token, logprobs) in enumerate(zip(tokens, out.logprobs)):
            assert token in logprobs
            for t, lp in logprobs.items():
                assert abs(lp.logprob - want[j, t]) < TOL, (i, j, t, lp.logprob, want[j, t])
                assert lp.rank == int((want[j] >= want[j, t] - 1e-6).sum()), (i, j, t, lp)
            top = sorted(logprobs, key=lambda t: -logprobs[t].logprob)[: NUM_LOGPROBS[i]]
            assert set(top) <= set(np.argsort(-want[j])[: NUM_LOGPROBS[i] + 1].tolist())

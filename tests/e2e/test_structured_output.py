"""Structured output with DDTree (vllm_ddtree/structured.py), on the real SmolLM2 pair (vLLM's CPU build, V1 model
runner, float32): JSON schemas, regexes and choices in one batch with unconstrained requests, B = 32 against depth 15.

Oracles: greedy answers token-identical to vLLM without speculation under the same constraints; sampled answers
(T = 1) that satisfy their constraint; constrained requests that keep the tree's gain over vLLM's DFlash chain. With
vLLM's own chain masks on a tree (siblings masked as if they followed each other) the identity test fails: one regex
answer came out garbled.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.e2e.engine import run

pytestmark = pytest.mark.slow

ENGINE = dict(skip_tokenizer_init=False, max_model_len=1024)
MAX_TOKENS = 48
BUDGET = 32  # not the drafter's depth (15)
DEPTH = 15

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
NUMBERS = {"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 6}
COLORS = r"(red|green|blue|yellow)(, (red|green|blue|yellow)){2}\."
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
SENTIMENTS = ["positive", "negative", "neutral"]

# (user message, structured outputs params as keywords, or None: unconstrained)
CASES = [
    ("Describe a cat as JSON with fields name and age.", {"json": PERSON}),
    ("Give me a JSON list of the first few prime numbers.", {"json": NUMBERS}),
    ("List three colors.", {"regex": COLORS}),
    ("When did the first person land on the moon? Answer with a date.", {"regex": DATE}),
    ("What is the sentiment of: 'I loved this movie, it was great!'", {"choice": SENTIMENTS}),
    ("Write a Python function that adds two numbers.", None),
    ("Describe a dog as JSON with fields name and age.", {"json": PERSON}),
    ("What is the capital of France?", None),
]


def satisfies(text: str, constraint: dict) -> bool:
    if "json" in constraint:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return False
        if constraint["json"] is PERSON:
            return isinstance(value, dict) and isinstance(value.get("name"), str) and type(value.get("age")) is int
        return isinstance(value, list) and 3 <= len(value) <= 6 and all(type(v) is int for v in value)
    if "regex" in constraint:
        return re.fullmatch(constraint["regex"], text) is not None
    return text in constraint["choice"]


def encode(tokenizer, message: str) -> list[int]:
    """A user message in the target's chat template, as token ids."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip
    return tokenizer(text, add_special_tokens=False).input_ids


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    return [encode(tokenizer, message) for message, _ in CASES]


def sampling_params(temperature: float, seed: int | None = None) -> list:
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    return [
        SamplingParams(
            temperature=temperature,
            max_tokens=MAX_TOKENS,
            seed=None if seed is None else seed + i,
            structured_outputs=None if constraint is None else StructuredOutputsParams(**constraint),
        )
        for i, (_, constraint) in enumerate(CASES)
    ]


def ddtree(drafter: str) -> dict:
    return {"method": "ddtree", "model": drafter, "num_speculative_tokens": BUDGET}


def texts(smollm2, result) -> list[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in result.token_ids]


def test_greedy_answers_match_no_speculation_under_the_same_constraints(smollm2, drafter, prompts):
    plain = run(smollm2, None, prompts, sampling_params(0.0), **ENGINE)
    tree = run(smollm2, ddtree(drafter), prompts, sampling_params(0.0), **ENGINE)

    assert tree.token_ids == plain.token_ids
    assert tree.finish_reasons == plain.finish_reasons
    for text, (_, constraint) in zip(texts(smollm2, plain), CASES):
        if constraint is not None:
            assert satisfies(text, constraint), (text, constraint)
    assert tree.acceptance_length > 1.3, tree.metrics


def test_constrained_requests_keep_their_trees(smollm2, drafter, prompts):
    """Constrained requests alone: the same answers as vLLM's DFlash chain with D speculative tokens, and more
    accepted tokens a step (the grammar masks follow every tree path; a chain-only DDTree accepts what the chain
    does)."""
    constrained = [i for i, (_, constraint) in enumerate(CASES) if constraint is not None]
    params = sampling_params(0.0)
    chosen_prompts, chosen_params = [prompts[i] for i in constrained], [params[i] for i in constrained]
    chain = run(smollm2, {"method": "dflash", "model": drafter, "num_speculative_tokens": DEPTH}, chosen_prompts,
                chosen_params, **ENGINE)  # fmt: skip
    tree = run(smollm2, ddtree(drafter), chosen_prompts, chosen_params, **ENGINE)

    assert tree.token_ids == chain.token_ids
    assert tree.acceptance_length > chain.acceptance_length + 0.2, (tree.metrics, chain.metrics)


def test_sampled_answers_satisfy_their_constraints(smollm2, drafter, prompts):
    result = run(smollm2, ddtree(drafter), prompts, sampling_params(1.0, seed=7), **ENGINE)

    for text, finish, (_, constraint) in zip(texts(smollm2, result), result.finish_reasons, CASES):
        if constraint is not None and finish == "stop":
            assert satisfies(text, constraint), (text, constraint)
    assert sum(f == "stop" for f, (_, c) in zip(result.finish_reasons, CASES) if c is not None) >= 3


def test_greedy_answers_match_no_speculation_with_a_reasoning_parser(smollm2, drafter, prompts):
    """A reasoning parser (the first sentence is reasoning: tests/e2e/sentence_reasoning_parser.py): while
    reasoning goes on, the masks come from vLLM's per-path code, which knows where reasoning ends; once a
    sentence ends, from the one-walk fill. Greedy answers are token-identical to vLLM without speculation. On vLLM
    0.26 the grammar takes over where reasoning ended inside a tree path through
    `structured._latching_reasoning_end_anywhere` (passed on an H100, session 45)."""
    from pathlib import Path

    from tests.e2e import sentence_reasoning_parser as parser

    engine = dict(ENGINE, reasoning_parser=parser.NAME, reasoning_parser_plugin=str(Path(parser.__file__)))
    constrained = [i for i, (_, constraint) in enumerate(CASES) if constraint is not None]
    params = sampling_params(0.0)
    chosen_prompts, chosen_params = [prompts[i] for i in constrained], [params[i] for i in constrained]
    plain = run(smollm2, None, chosen_prompts, chosen_params, **engine)
    tree = run(smollm2, ddtree(drafter), chosen_prompts, chosen_params, **engine)

    assert tree.token_ids == plain.token_ids
    assert tree.finish_reasons == plain.finish_reasons
    period = 30  # "." in SmolLM2's vocabulary: the reasoning's end
    reasoned = [ids for ids in plain.token_ids if period in ids[:-1]]
    assert len(reasoned) >= 2, "too few answers switch from reasoning to the grammar to test the switch"
    assert tree.acceptance_length > 1.3, tree.metrics

"""DDTree inside real vLLM (CPU build) is lossless at temperature 0: token-identical to vLLM without speculation.

Budgets B sweep below, at and above the drafter's block size (the place where a size derived from the block size
instead of B + 1 would show), for two block sizes, on a batch of prompts of different lengths submitted together.
"""

from __future__ import annotations

import pytest

from tests.e2e.engine import run
from tests.tiny_models import make_tiny_dflash_drafter, make_tiny_target

BUDGETS = [1, 2, 3, 7, 8, 15, 16, 17, 31, 64]
BLOCK_SIZES = [4, 16]
MAX_TOKENS = 40


def prompts() -> list[list[int]]:
    # Six prompts of lengths 1..~70, different contents.
    return [[7], [5, 17, 33, 8], [100 + i for i in range(13)], [3, 9] * 11, [400 - 3 * i for i in range(37)], [11] * 70]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    target = make_tiny_target(root / "target")
    drafters = {bs: make_tiny_dflash_drafter(root / f"drafter{bs}", block_size=bs) for bs in BLOCK_SIZES}
    return str(target), {bs: str(d) for bs, d in drafters.items()}


@pytest.fixture(scope="module")
def greedy_params():
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)


@pytest.fixture(scope="module")
def baseline(models, greedy_params):
    return run(models[0], None, prompts(), greedy_params)


def check_spec_metrics(result, budget: int, depth: int) -> None:
    m = result.metrics
    drafts = m["vllm:spec_decode_num_drafts"]
    accepted = m["vllm:spec_decode_num_accepted_tokens"]
    per_pos = list(m["vllm:spec_decode_num_accepted_tokens_per_pos"])
    assert drafts > 0
    assert m["vllm:spec_decode_num_draft_tokens"] == budget * drafts
    assert sum(per_pos) == accepted
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])), per_pos  # a node is accepted only after its parent
    assert all(count == 0 for count in per_pos[min(budget, depth) :])  # paths never exceed the tree's depth
    produced = sum(len(t) - 1 for t in result.token_ids)  # tokens after each request's first (prefill) token
    assert produced <= drafts + accepted


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("budget", BUDGETS)
def test_greedy_identical_to_no_speculation(models, baseline, greedy_params, block_size, budget):
    target, drafters = models
    spec = {"method": "ddtree", "model": drafters[block_size], "num_speculative_tokens": budget}
    result = run(target, spec, prompts(), greedy_params)
    assert result.token_ids == baseline.token_ids
    check_spec_metrics(result, budget, depth=block_size - 1)


PENALTIES = dict(repetition_penalty=1.3, frequency_penalty=0.3, presence_penalty=0.2)


def test_greedy_with_penalties_identical_to_no_speculation(models, baseline):
    """Greedy decoding with repetition, frequency and presence penalties is deterministic, so DDTree's tokens must
    equal plain vLLM's: each tree node's penalties count the tokens on its own path (V1: `sampling.py`; Model
    Runner V2: `penalties_v2.py`), not those before it in the step's list of drafts."""
    from vllm import SamplingParams

    target, drafters = models
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False, **PENALTIES)
    penalized = run(target, None, prompts(), params)
    assert penalized.token_ids != baseline.token_ids  # the penalties change plain vLLM's output: the test has power
    spec = {"method": "ddtree", "model": drafters[4], "num_speculative_tokens": 7}
    result = run(target, spec, prompts(), params)
    assert result.token_ids == penalized.token_ids
    check_spec_metrics(result, 7, depth=3)


ATTENTION_SWITCHES = [
    # Rows whose ancestors are the nodes before them keep the attention backend's causal output, the others the
    # tree attention's (experimental).
    ("VLLM_DDTREE_BACKEND_ROWS", "1", 4, 17), ("VLLM_DDTREE_BACKEND_ROWS", "1", 16, 31),
    # Every node verified as one query over its context and its own path (on the CPU through the pure-torch
    # stand-in for FA3), with budgets above and below the block size; all nodes in one call (1), one call per
    # node index (decode) or per chain index (chains: chains of at most the drafter's depth + 1 nodes).
    ("VLLM_DDTREE_PER_PATH_ATTENTION", "1", 4, 17), ("VLLM_DDTREE_PER_PATH_ATTENTION", "1", 16, 7),
    ("VLLM_DDTREE_PER_PATH_ATTENTION", "1", 16, 64), ("VLLM_DDTREE_PER_PATH_ATTENTION", "decode", 4, 17),
    ("VLLM_DDTREE_PER_PATH_ATTENTION", "decode", 16, 31), ("VLLM_DDTREE_PER_PATH_ATTENTION", "chains", 4, 17),
    ("VLLM_DDTREE_PER_PATH_ATTENTION", "chains", 16, 7), ("VLLM_DDTREE_PER_PATH_ATTENTION", "chains", 16, 64),
]


@pytest.mark.parametrize("switch,value,block_size,budget", ATTENTION_SWITCHES)
def test_attention_switches_keep_greedy_output(models, baseline, greedy_params, switch, value, block_size, budget,
                                               monkeypatch):  # fmt: skip
    """Each experimental attention switch inside the engine: still token-identical to plain vLLM."""
    monkeypatch.setenv(switch, value)
    target, drafters = models
    spec = {"method": "ddtree", "model": drafters[block_size], "num_speculative_tokens": budget}
    result = run(target, spec, prompts(), greedy_params)
    assert result.token_ids == baseline.token_ids
    check_spec_metrics(result, budget, depth=block_size - 1)


@pytest.mark.parametrize(
    "block_size,budget,switches",
    [(16, 15, {"tree_in_graph": False}), (4, 17, {"layout_in_graph": False}),
     (16, 31, {"tree_in_graph": False, "layout_in_graph": False})],
)
def test_graph_switches_keep_greedy_output(models, baseline, greedy_params, block_size, budget, switches):
    """Model Runner V2's host-time switches, against their defaults (the cases above): the tree built after the
    drafter's pass instead of inside its CUDA graph ("tree_in_graph": false) and the step laid out from the host
    instead of inside the target's graph ("layout_in_graph": false), each from the graphs' own fixed-address
    buffers, give plain vLLM's tokens too."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("Model Runner V2 only (the GPU build); the CPU build runs the V1 runner, where the keys do nothing")
    target, drafters = models
    spec = {"method": "ddtree", "model": drafters[block_size], "num_speculative_tokens": budget, **switches}
    result = run(target, spec, prompts(), greedy_params)
    assert result.token_ids == baseline.token_ids
    check_spec_metrics(result, budget, depth=block_size - 1)


@pytest.mark.parametrize("switches", [{}, {"layout_in_graph": False}])
def test_prompts_of_exactly_the_tree_width_keep_greedy_output(models, greedy_params, switches):
    """Prompts of exactly B + 1 tokens, prefilled together: vLLM runs such a batch (every request n = B + 1
    scheduled tokens) in the FULL graph it captured for n-node tree verifications (on the GPU), so the prefill
    chunks must be laid out there as chains of n nodes, not left to stale tree inputs."""
    import torch

    if switches and not torch.cuda.is_available():
        pytest.skip("Model Runner V2 only (the GPU build); the CPU build runs V1, where the key does nothing")
    target, drafters = models
    budget = 15
    batch = [[(31 * r + 7 * i) % 500 + 3 for i in range(budget + 1)] for r in range(3)]
    plain = run(target, None, batch, greedy_params)
    spec = {"method": "ddtree", "model": drafters[16], "num_speculative_tokens": budget, **switches}
    result = run(target, spec, batch, greedy_params)
    assert result.token_ids == plain.token_ids
    check_spec_metrics(result, budget, depth=15)

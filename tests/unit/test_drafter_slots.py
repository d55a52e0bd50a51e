"""vLLM reserves the query slots DDTree's drafter adds per request: D = the tree depth (block size - 1), not the
node budget B, whenever B < D. Built through vLLM's own `EngineArgs.create_engine_config` (the CPU build) on the
tiny pair, for budgets below, at and above the depth."""

from __future__ import annotations

import pytest

from tests.e2e.test_tiny_pair_ddtree import BLOCK_SIZE, DRAFTER, TARGET
from vllm_ddtree import config as ddtree_config
from vllm_ddtree.engine_hooks import tree_depth

DEPTH = BLOCK_SIZE - 1


def engine_config(budget: int):
    import vllm_ddtree
    from vllm_ddtree.compat import EngineArgs

    vllm_ddtree.register()
    args = EngineArgs(
        model=TARGET,
        speculative_config={"method": "ddtree", "model": DRAFTER, "num_speculative_tokens": budget},
        max_model_len=256,
        max_num_seqs=4,
        skip_tokenizer_init=True,
    )
    return args.create_engine_config()


def dflash_slots(num_tokens: int, spec) -> int:
    """vLLM's own count for a DFlash config drafting `num_tokens` per pass (the hook bypassed)."""
    import copy

    from vllm.config import SpeculativeConfig

    view = copy.copy(spec)
    view.num_speculative_tokens = num_tokens
    setattr(view, ddtree_config.ATTRIBUTE, None)
    return SpeculativeConfig.max_num_new_slots_for_drafting.fget(view)


@pytest.mark.parametrize("budget", [1, DEPTH - 1, DEPTH, DEPTH + 1, 2 * DEPTH + 3])
def test_drafter_slots_cover_the_tree_depth(budget):
    spec = engine_config(budget).speculative_config
    assert spec.num_speculative_tokens == budget  # vLLM still schedules B draft tokens per request
    assert tree_depth(spec) == DEPTH
    assert spec.max_num_new_slots_for_drafting == dflash_slots(max(budget, DEPTH), spec)
    if dflash_slots(DEPTH, spec) == 0:
        pytest.skip("this vLLM (0.33) reserves no drafting slots for DFlash: the KV lookahead test covers the depth")
    assert spec.max_num_new_slots_for_drafting >= dflash_slots(DEPTH, spec) > 0


@pytest.mark.parametrize("budget", [1, DEPTH - 1, DEPTH, DEPTH + 1, 2 * DEPTH + 3])
def test_kv_lookahead_covers_the_drafter_queries(budget):
    """The drafter queries the bonus token and D masks after the accepted path (slots from the block table):
    D + 1 KV slots past it, more than vLLM's B + 1 for DFlash when B < D."""
    config = engine_config(budget)
    assert config.num_lookahead_tokens == max(budget, DEPTH) + 1


@pytest.mark.slow
def test_scheduler_reserves_the_drafter_kv():
    """The running scheduler (in-process engine, the real CPU build) holds the lookahead, not only the config."""
    from tests.e2e.engine import make_llm
    from vllm_ddtree.compat import shutdown_llm

    llm = make_llm(TARGET, {"method": "ddtree", "model": DRAFTER, "num_speculative_tokens": 1})
    try:
        assert llm.llm_engine.engine_core.engine_core.scheduler.num_lookahead_tokens == DEPTH + 1
    finally:
        shutdown_llm(llm)

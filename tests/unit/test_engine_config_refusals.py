"""Engine configurations DDTree cannot run are refused when the engine's config is built, with the value and the
fix in the message (vLLM's own `EngineArgs.create_engine_config`, CPU build, the tiny pair)."""

from __future__ import annotations

import pytest

from tests.e2e.test_tiny_pair_ddtree import DRAFTER, TARGET


def engine_args(**kwargs):
    import vllm_ddtree
    from vllm_ddtree.compat import EngineArgs

    vllm_ddtree.register()
    return EngineArgs(
        model=TARGET,
        speculative_config={"method": "ddtree", "model": DRAFTER, "num_speculative_tokens": 4},
        max_model_len=256,
        max_num_seqs=4,
        skip_tokenizer_init=True,
        **kwargs,
    )


def test_pipeline_parallelism_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=2.*tensor_parallel_size.*'dflash'"):
        engine_args(pipeline_parallel_size=2).create_engine_config()


def test_one_pipeline_stage_is_accepted():
    assert engine_args(pipeline_parallel_size=1).create_engine_config().parallel_config.pipeline_parallel_size == 1


def test_m_rope_targets_are_refused_on_both_runners():
    """Tree positions (root + depth) are one-dimensional; an M-RoPE target would take V2's own positions instead
    (`model_state.prepare_inputs`), so the check sits at config time, before either runner starts."""
    from types import SimpleNamespace

    args = engine_args()
    with pytest.raises(ValueError, match="M-RoPE.*'dflash'"):
        args.create_speculative_config(SimpleNamespace(uses_mrope=True), SimpleNamespace(pipeline_parallel_size=1))


@pytest.mark.parametrize("name,accepted", [("VLLM_DDTREE_TOP_K", "auto, triton, torch"),
                                           ("VLLM_DDTREE_TREE_KERNELS", "triton, torch"),
                                           ("VLLM_DDTREE_SPLIT_ATTENTION", "auto"),
                                           ("VLLM_DDTREE_PER_PATH_ATTENTION", "0, 1, decode or chains")])
def test_a_bad_switch_is_refused_when_the_config_is_built(monkeypatch, name, accepted):
    monkeypatch.setenv(name, "fast")
    with pytest.raises(ValueError, match=rf"{name}='fast' is not one of {accepted}"):
        engine_args().create_engine_config()

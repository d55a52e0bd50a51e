"""`compat.v1_model_runner_for`: the benchmarks' `dflash-v1` engines start on vLLM's V1 model runner (DDTree's),
so a tree/chain ratio can be read on one runner; other method names leave vLLM's choice alone."""

import os

import pytest


@pytest.mark.parametrize("before", [None, "1"])
def test_v1_suffix_asks_for_the_v1_runner_and_restores_the_environment(monkeypatch, before):
    import vllm.envs as envs

    from vllm_ddtree.compat import v1_model_runner_for

    if before is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", before)
    with v1_model_runner_for("dflash-v1"):
        assert envs.VLLM_USE_V2_MODEL_RUNNER is False  # what VllmConfig.use_v2_model_runner reads first
    assert os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == before
    with v1_model_runner_for("dflash"):
        assert os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == before

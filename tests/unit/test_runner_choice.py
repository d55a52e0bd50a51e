"""Which model runner DDTree runs on: V1 by default, Model Runner V2 with VLLM_DDTREE_RUNNER=v2; and
`compat.model_runner_for`, the benchmarks' method suffixes (`dflash-v1`: vLLM's chain on the V1 runner, so a
tree/chain ratio can be read on one runner; `ddtree-...-v2`: DDTree on Model Runner V2)."""

import os

import pytest


@pytest.mark.parametrize("before", [None, "1"])
def test_v1_suffix_asks_for_the_v1_runner_and_restores_the_environment(monkeypatch, before):
    import vllm.envs as envs

    from vllm_ddtree.compat import model_runner_for

    if before is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", before)
    with model_runner_for("dflash-v1"):
        assert envs.VLLM_USE_V2_MODEL_RUNNER is False  # what VllmConfig.use_v2_model_runner reads first
    assert os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == before
    with model_runner_for("dflash"):
        assert os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == before


def test_v2_suffix_asks_for_ddtree_on_model_runner_v2(monkeypatch):
    from vllm_ddtree.compat import method_without_runner, model_runner_for, v2_runner_requested

    monkeypatch.delenv("VLLM_DDTREE_RUNNER", raising=False)
    with model_runner_for("ddtree-B32-v2"):
        assert v2_runner_requested()
    assert not v2_runner_requested()
    assert [method_without_runner(m) for m in ("dflash-v1", "ddtree-B32-v2", "ddtree", "none")] == [
        "dflash", "ddtree-B32", "ddtree", "none",
    ]  # fmt: skip


def _vllm_config_like(speculative_config):
    """What `VllmConfig.use_v2_model_runner` reads before its platform checks (0.26, 0.32)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        speculative_config=speculative_config,
        attention_config=SimpleNamespace(hisparse_config=None),
        watermark_config=None,
    )


def test_runner_for_ddtree_configs_is_v1_unless_v2_is_asked_for(monkeypatch):
    from types import SimpleNamespace

    from vllm.config import VllmConfig

    from vllm_ddtree import config as ddtree_config
    from vllm_ddtree.engine_hooks import install_config_hook

    install_config_hook()
    ddtree = _vllm_config_like(SimpleNamespace(**{ddtree_config.ATTRIBUTE: {"budget": 8, "depth": 15, "max_topk": None}}))
    use_v2 = VllmConfig.use_v2_model_runner.fget
    monkeypatch.delenv("VLLM_DDTREE_RUNNER", raising=False)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    assert use_v2(ddtree) is False
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ValueError, match="VLLM_DDTREE_RUNNER=v2"):
        use_v2(ddtree)
    monkeypatch.setenv("VLLM_DDTREE_RUNNER", "v2")
    assert use_v2(ddtree) is True  # vLLM's own choice: the explicit VLLM_USE_V2_MODEL_RUNNER=1

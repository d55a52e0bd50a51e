"""Which model runner DDTree runs on: vLLM's choice by default (Model Runner V2 on vLLM 0.26's GPU build, V1 on
the CPU build), one forced with VLLM_DDTREE_RUNNER=v1|v2; and
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
    import vllm.envs as envs

    from vllm_ddtree.compat import method_without_runner, model_runner_for, requested_runner

    monkeypatch.delenv("VLLM_DDTREE_RUNNER", raising=False)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    with model_runner_for("ddtree-B32-v2"):
        assert requested_runner() == "v2" and envs.VLLM_USE_V2_MODEL_RUNNER is True
    with model_runner_for("ddtree-B32-v1"):
        assert requested_runner() == "v1" and envs.VLLM_USE_V2_MODEL_RUNNER is False
    assert requested_runner() == "auto"
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


def _use_v2_model_runner():
    from vllm.config import VllmConfig

    from vllm_ddtree.engine_hooks import install_config_hook

    install_config_hook()
    return VllmConfig.use_v2_model_runner.fget


def _ddtree_config():
    from types import SimpleNamespace

    from vllm_ddtree import config as ddtree_config

    settings = {"budget": 8, "depth": 15, "max_topk": None}
    return _vllm_config_like(SimpleNamespace(**{ddtree_config.ATTRIBUTE: settings}))


@pytest.mark.parametrize(
    "ddtree_runner, vllm_env, expected",
    [
        (None, None, False),  # auto: vLLM's choice, V1 on the CPU build (no Triton driver)
        ("auto", "1", True),  # auto: vLLM's choice, V2 when asked for
        ("auto", "0", False),
        ("v1", None, False),
        ("v1", "0", False),
        ("v2", None, True),
        ("V2", "1", True),
    ],
)
def test_ddtree_follows_vllm_unless_a_runner_is_forced(monkeypatch, ddtree_runner, vllm_env, expected):
    for name, value in (("VLLM_DDTREE_RUNNER", ddtree_runner), ("VLLM_USE_V2_MODEL_RUNNER", vllm_env)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert _use_v2_model_runner()(_ddtree_config()) is expected


@pytest.mark.parametrize("ddtree_runner, vllm_env", [("v1", "1"), ("v2", "0")])
def test_contradicting_runner_settings_are_refused_with_the_fix(monkeypatch, ddtree_runner, vllm_env):
    monkeypatch.setenv("VLLM_DDTREE_RUNNER", ddtree_runner)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", vllm_env)
    with pytest.raises(ValueError, match=f"VLLM_DDTREE_RUNNER={ddtree_runner}.*VLLM_USE_V2_MODEL_RUNNER={vllm_env}.*auto"):
        _use_v2_model_runner()(_ddtree_config())


def test_unknown_runner_name_is_refused_with_the_choices(monkeypatch):
    monkeypatch.setenv("VLLM_DDTREE_RUNNER", "v3")
    with pytest.raises(ValueError, match="VLLM_DDTREE_RUNNER='v3'.*auto.*v1 or v2"):
        _use_v2_model_runner()(_ddtree_config())


def test_other_configs_keep_vllms_choice(monkeypatch):
    monkeypatch.setenv("VLLM_DDTREE_RUNNER", "v1")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert _use_v2_model_runner()(_vllm_config_like(None)) is True


def test_engine_shutdown_gives_the_next_in_process_engine_a_fresh_cuda_graph_pool(monkeypatch):
    """vLLM's per-process CUDA-graph pool outlives an in-process engine; the next engine capturing into it after
    the first one's graphs are freed hit a caching-allocator assert on the H200 (sessions 15 and 16)."""
    from types import SimpleNamespace

    from vllm.platforms import current_platform

    from vllm_ddtree.compat import shutdown_llm

    platform_class = type(current_platform)
    monkeypatch.setattr(platform_class, "_global_graph_pool", (0, 1), raising=False)
    stopped = []
    llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: stopped.append(1))))
    shutdown_llm(llm)
    assert stopped == [1]
    assert platform_class._global_graph_pool is None


def test_registration_hooks_both_runners_whatever_the_runner_variable_says(monkeypatch):
    """The runner is chosen per engine config, after registration: session 16's benchmark registered the plugin
    (method `none` first) before VLLM_DDTREE_RUNNER=v2 was set for its DDTree methods, and those ran vLLM's own
    DFlash on V2 because the V2 hooks had not been installed."""
    import vllm_ddtree
    from vllm_ddtree.compat import GPUModelRunner, v2_model_runner_module

    monkeypatch.setenv("VLLM_DDTREE_RUNNER", "v1")
    vllm_ddtree.register()
    v2 = v2_model_runner_module()
    assert GPUModelRunner.__dict__.get("_ddtree_hooked") is True
    assert v2.GPUModelRunner.__dict__.get("_ddtree_hooked") is True
    assert v2.init_speculator.__module__ == "vllm_ddtree.runner_v2"


@pytest.mark.parametrize(
    "vllm_picks_v2, explicit, version, tp, expected",
    [
        (True, False, "0.26.0", 1, True),  # the H200's vLLM, where the V2 hooks ran end to end
        (True, False, "0.26.3", 1, True),
        (True, False, "0.32.0", 1, False),  # V2 hooks not verified there: V1, with a warning
        (True, False, "0.260.0", 1, False),
        (True, False, "0.26.0", 2, False),  # tensor parallelism: verified on V1 only
        (True, True, "0.32.0", 2, True),  # an explicit VLLM_USE_V2_MODEL_RUNNER=1 stands
        (False, False, "0.26.0", 1, False),
        (False, True, "0.26.0", 1, False),
    ],
)
def test_auto_takes_vllms_v2_only_where_ddtrees_v2_hooks_are_verified(vllm_picks_v2, explicit, version, tp, expected):
    from vllm_ddtree.compat import auto_runner_is_v2

    assert auto_runner_is_v2(vllm_picks_v2, explicit, version, tp) is expected


def test_forcing_v2_where_its_hooks_are_not_verified_warns_with_the_release(monkeypatch):
    import logging

    import vllm.logger

    from vllm_ddtree.compat import LOGGER_NAME, V2_VERIFIED_VLLM, VLLM_VERSION

    vllm.logger._print_warning_once.cache_clear()  # an earlier test may have forced V2 already
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger(LOGGER_NAME).addHandler(handler)
    monkeypatch.setenv("VLLM_DDTREE_RUNNER", "v2")
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    try:
        assert _use_v2_model_runner()(_ddtree_config()) is True
    finally:
        logging.getLogger(LOGGER_NAME).removeHandler(handler)
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert VLLM_VERSION != V2_VERIFIED_VLLM  # the CPU build is 0.32
    assert any(f"verified on vLLM {V2_VERIFIED_VLLM} only" in w and VLLM_VERSION in w for w in warnings), warnings

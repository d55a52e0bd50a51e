"""`vllm serve TARGET --spec-method ddtree --spec-model DRAFTER --spec-tokens B`: vLLM's own CLI parser (the one
`vllm serve` builds, plugins loaded by it) and `EngineArgs.create_engine_config` (CPU build, the tiny pair) give
the same DDTree config as `--speculative-config '{"method": "ddtree", ...}'`."""

from __future__ import annotations

import json

import pytest

from tests.e2e.test_tiny_pair_ddtree import DRAFTER, TARGET
from vllm_ddtree.engine_hooks import tree_depth

ENGINE_FLAGS = ["--max-model-len", "256", "--max-num-seqs", "4", "--skip-tokenizer-init"]


def engine_config(*flags: str):
    from vllm_ddtree.compat import AsyncEngineArgs, FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())  # loads the plugins, as `vllm serve` does
    args = parser.parse_args(["--model", TARGET, *ENGINE_FLAGS, *flags])
    return AsyncEngineArgs.from_cli_args(args).create_engine_config()


def ddtree_settings(config) -> tuple:
    spec = config.speculative_config
    return spec.method, spec.model, spec.num_speculative_tokens, tree_depth(spec)


def test_spec_flags_give_a_ddtree_config():
    config = engine_config("--spec-method", "ddtree", "--spec-model", DRAFTER, "--spec-tokens", "5")
    method, model, budget, depth = ddtree_settings(config)
    assert (method, model, budget) == ("dflash", DRAFTER, 5)  # DDTree runs on vLLM's DFlash config
    assert depth is not None


def test_spec_flags_equal_the_json_config():
    flags = engine_config("--spec-method", "ddtree", "--spec-model", DRAFTER, "--spec-tokens", "5")
    spec = json.dumps({"method": "ddtree", "model": DRAFTER, "num_speculative_tokens": 5})
    assert ddtree_settings(flags) == ddtree_settings(engine_config("--speculative-config", spec))


def test_spec_tokens_completes_a_json_ddtree_config():
    spec = json.dumps({"method": "ddtree", "model": DRAFTER})
    assert ddtree_settings(engine_config("--speculative-config", spec, "--spec-tokens", "3"))[2] == 3


def test_a_key_given_twice_is_refused_as_vllm_refuses_it():
    spec = json.dumps({"method": "ddtree", "model": DRAFTER, "num_speculative_tokens": 5})
    with pytest.raises(ValueError, match=r"--spec-tokens and --speculative-config\['num_speculative_tokens'\]"):
        engine_config("--speculative-config", spec, "--spec-tokens", "3")


def test_unknown_methods_are_still_refused_by_the_parser():
    with pytest.raises(SystemExit):
        engine_config("--spec-method", "no-such-method", "--spec-model", DRAFTER)

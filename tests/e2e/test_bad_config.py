"""Bad DDTree configs fail when the engine is built, with an error naming the value and the fix."""

from __future__ import annotations

import json

import pytest

from tests.e2e.engine import make_llm
from tests.tiny_models import make_tiny_dflash_drafter, make_tiny_target


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return str(make_tiny_target(tmp_path_factory.mktemp("bad") / "target"))


def drafter_with(tmp_path, edit) -> str:
    path = make_tiny_dflash_drafter(tmp_path / "drafter", block_size=4)
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def expect_error(target, spec, error, match):
    with pytest.raises(error, match=match):
        make_llm(target, spec)


def test_budget_out_of_range(target, tmp_path):
    drafter = drafter_with(tmp_path, lambda c: None)
    expect_error(target, {"method": "ddtree", "model": drafter, "num_speculative_tokens": 0}, ValueError, "got 0")
    expect_error(
        target, {"method": "ddtree", "model": drafter, "num_speculative_tokens": 1000}, ValueError, "maximum 256"
    )


def test_unknown_key(target, tmp_path):
    drafter = drafter_with(tmp_path, lambda c: None)
    spec = {"method": "ddtree", "model": drafter, "num_speculative_tokens": 4, "budget": 4}
    expect_error(target, spec, ValueError, r"Unknown key\(s\) \['budget'\]")


def test_no_drafter(target):
    expect_error(target, {"method": "ddtree", "num_speculative_tokens": 4}, ValueError, "needs 'model'")


def test_drafter_without_dflash_config(target, tmp_path):
    drafter = drafter_with(tmp_path, lambda c: c.pop("dflash_config"))
    spec = {"method": "ddtree", "model": drafter, "num_speculative_tokens": 4}
    expect_error(target, spec, ValueError, "has no 'dflash_config'")


def test_drafter_hidden_size_mismatch(target, tmp_path):
    drafter = drafter_with(tmp_path, lambda c: c.update(target_hidden_size=128))
    spec = {"method": "ddtree", "model": drafter, "num_speculative_tokens": 4}
    expect_error(target, spec, ValueError, "expects target hidden size 128")


def test_drafter_vocab_mismatch(target, tmp_path):
    path = make_tiny_dflash_drafter(tmp_path / "small_vocab", block_size=4, vocab_size=256)
    spec = {"method": "ddtree", "model": str(path), "num_speculative_tokens": 4}
    expect_error(target, spec, ValueError, "vocab_size 256, but the target's is 512")


def test_unsupported_feature(target, tmp_path):
    drafter = drafter_with(tmp_path, lambda c: None)
    spec = {"method": "ddtree", "model": drafter, "num_speculative_tokens": 4, "disable_padded_drafter_batch": True}
    expect_error(target, spec, NotImplementedError, "disable_padded_drafter_batch")


def test_budget_above_what_the_tree_can_hold(target, tmp_path):
    drafter = drafter_with(tmp_path, lambda c: None)  # block size 4: depth 3
    spec = {"method": "ddtree", "model": drafter, "num_speculative_tokens": 8, "max_topk": 1}
    expect_error(target, spec, ValueError, r"num_speculative_tokens=8 is more nodes than a tree of depth 3")


def test_budget_per_batch_size_above_the_budget(target, tmp_path):
    drafter = drafter_with(tmp_path, lambda c: None)
    spec = {"method": "ddtree", "model": drafter, "num_speculative_tokens": 4,
            "num_speculative_tokens_per_batch_size": [[1, 2, 4], [3, 64, 8]]}  # fmt: skip
    expect_error(target, spec, ValueError, r"entry \[3, 64, 8\] asks for 8 nodes")


@pytest.mark.parametrize("layers", [[0, 9], [-1, 1], []])
def test_drafter_reading_target_layers_that_do_not_exist(target, tmp_path, layers):
    drafter = drafter_with(tmp_path, lambda c: c["dflash_config"].update(target_layer_ids=layers))
    spec = {"method": "ddtree", "model": drafter, "num_speculative_tokens": 4}
    expect_error(target, spec, ValueError, r"reads target layers .* but the target has 2 decoder layers \(ids 0\.\.1\)")


def test_drafter_mask_token_outside_the_vocabulary(target, tmp_path):
    drafter = drafter_with(tmp_path, lambda c: c["dflash_config"].update(mask_token_id=512))
    spec = {"method": "ddtree", "model": drafter, "num_speculative_tokens": 4}
    expect_error(target, spec, ValueError, r"mask_token_id=512, outside the vocabulary \(0\.\.511\)")

"""DDTree's speculative-config keys: split into vLLM's DFlash config, defaults, and clear errors."""

import pytest
import torch

from vllm_ddtree.config import MAX_BUDGET, DDTreeConfig, split_ddtree_config


def spec(**extra):
    return {"method": "ddtree", "model": "/drafter", "num_speculative_tokens": 15, **extra}


def test_split_passes_vllm_keys_and_keeps_tree_knobs():
    dflash, ddtree = split_ddtree_config(spec(max_topk=4, max_depth=6, tree_in_graph=True, layout_in_graph=False,
                                              max_model_len=128))  # fmt: skip
    assert dflash == {"method": "dflash", "model": "/drafter", "num_speculative_tokens": 15, "max_model_len": 128}
    assert ddtree == DDTreeConfig(budget=15, max_topk=4, max_depth=6, tree_in_graph=True, layout_in_graph=False)


def test_defaults():
    _, ddtree = split_ddtree_config(spec())
    assert ddtree.max_topk is None and ddtree.max_depth is None
    assert ddtree.tree_in_graph and ddtree.layout_in_graph  # Model Runner V2's host-time cuts
    assert ddtree.depth_for(block_size=16) == 15
    assert DDTreeConfig(budget=3, max_depth=4).depth_for(block_size=16) == 4


@pytest.mark.parametrize("budget", [0, -1, MAX_BUDGET + 1, 2.5, "8", True])
def test_bad_budget_names_key_and_range(budget):
    with pytest.raises(ValueError, match="num_speculative_tokens") as err:
        split_ddtree_config(spec(num_speculative_tokens=budget))
    assert repr(budget) in str(err.value) or str(budget) in str(err.value)


def test_missing_budget_and_drafter():
    with pytest.raises(ValueError, match="needs 'num_speculative_tokens'"):
        split_ddtree_config({"method": "ddtree", "model": "/drafter"})
    with pytest.raises(ValueError, match="needs 'model'"):
        split_ddtree_config({"method": "ddtree", "num_speculative_tokens": 4})


def test_unknown_key_is_named():
    with pytest.raises(ValueError, match=r"Unknown key\(s\) \['tree_width'\]"):
        split_ddtree_config(spec(tree_width=3))


@pytest.mark.parametrize("key", ["max_topk", "max_depth"])
def test_bad_knobs(key):
    with pytest.raises(ValueError, match=key):
        split_ddtree_config(spec(**{key: 0}))


@pytest.mark.parametrize("key", ["tree_in_graph", "layout_in_graph"])
@pytest.mark.parametrize("value", [1, "true", None])
def test_switches_must_be_bools(key, value):
    with pytest.raises(ValueError, match=rf"'{key}'\] must be true or false, got " + repr(value)):
        split_ddtree_config(spec(**{key: value}))


@pytest.mark.parametrize(
    "key,value",
    [("disable_padded_drafter_batch", True), ("draft_sample_method", "probabilistic"),
     ("use_heterogeneous_vocab", True)],
)
def test_unsupported_vllm_features_are_named(key, value):
    with pytest.raises(NotImplementedError, match=key):
        split_ddtree_config(spec(**{key: value}))


@pytest.mark.parametrize("key,value", [("prompt_lookup_max", 4), ("suffix_decoding_max_tree_depth", 24)])
def test_other_methods_vllm_keys_are_refused_by_name(key, value):
    """Keys of the installed vLLM's SpeculativeConfig that DDTree does not wire through: refused as such (not as
    unknown), whatever the vLLM version adds."""
    with pytest.raises(NotImplementedError, match=rf"\['{key}'\] = {value}: vLLM's key .* remove the key"):
        split_ddtree_config(spec(**{key: value}))


def test_budget_per_batch_size_passes_to_vllm():
    schedule = [[1, 4, 15], [5, 64, 7], [65, 256, 0]]
    dflash, ddtree = split_ddtree_config(spec(num_speculative_tokens_per_batch_size=schedule))
    assert dflash["num_speculative_tokens_per_batch_size"] == schedule and dflash["num_speculative_tokens"] == 15
    assert ddtree.budget == 15  # the largest tree; the schedule verifies its first n nodes


@pytest.mark.parametrize(
    "schedule,why",
    [([[1, 4, 16]], "in 0..num_speculative_tokens"), ([[2, 4, 8]], "start at batch size 1"),
     ([[1, 8, 8], [4, 16, 2]], "overlap at batch size 4"), ([[1, 8]], "not three integers"),
     ([[1, 8, 2.5]], "not three integers"), ([[5, 1, 3]], "first_batch_size <= last_batch_size"),
     ([], "non-empty list"), ("auto", "non-empty list"), ([[1, 8, -1]], "in 0..num_speculative_tokens")],
)
def test_bad_budget_per_batch_size_is_named(schedule, why):
    with pytest.raises(ValueError, match="num_speculative_tokens_per_batch_size") as err:
        split_ddtree_config(spec(num_speculative_tokens_per_batch_size=schedule))
    assert why in str(err.value)


def test_drafting_config_drafts_every_position_at_every_batch_size():
    """The drafter's copy of vLLM's config: D positions per pass and no per-batch-size schedule (Model Runner V2
    sizes the drafter's CUDA graphs from it); vLLM's own config keeps B and the schedule for the scheduler."""
    from types import SimpleNamespace

    from vllm_ddtree.config import drafting_config

    schedule = [[1, 4, 64], [5, 64, 15]]
    spec_config = SimpleNamespace(num_speculative_tokens=64, num_speculative_tokens_per_batch_size=schedule)
    vllm_config = SimpleNamespace(speculative_config=spec_config, model_config="target")
    drafting = drafting_config(vllm_config, 15)
    assert drafting.speculative_config.num_speculative_tokens == 15
    assert drafting.speculative_config.num_speculative_tokens_per_batch_size is None
    assert drafting.model_config == "target"
    assert spec_config.num_speculative_tokens == 64 and spec_config.num_speculative_tokens_per_batch_size is schedule


@pytest.mark.parametrize(
    "name,typo,refusal,accepted",
    [("VLLM_DDTREE_TOP_K", "trtion", r"VLLM_DDTREE_TOP_K='trtion'.*auto, triton, torch", " Torch "),
     # used to take any value but "torch" as triton
     ("VLLM_DDTREE_TREE_KERNELS", "torhc", r"VLLM_DDTREE_TREE_KERNELS='torhc' is not one of triton, torch", " Torch "),
     # the next three used to take any value but "0" as on ("off" too), or any but "1" as off ("true" too)
     ("VLLM_DDTREE_SPLIT_ATTENTION", "off", r"SPLIT_ATTENTION='off' is not one of auto .*, 0 .* or 1", " Auto "),
     ("VLLM_DDTREE_FULL_CUDA_GRAPHS", "off", r"VLLM_DDTREE_FULL_CUDA_GRAPHS='off' is not 1 .* or 0", " 0 "),
     ("VLLM_DDTREE_BACKEND_ROWS", "true", r"VLLM_DDTREE_BACKEND_ROWS='true' is not 0 .* or 1", " 1 "),
     ("VLLM_DDTREE_PER_PATH_ATTENTION", "on", r"PER_PATH_ATTENTION='on' is not one of 0, 1, decode", " Chains "),
     ("VLLM_DDTREE_PER_PATH_SPLITS", "two", r"VLLM_DDTREE_PER_PATH_SPLITS='two' is not a whole number", " 4 ")],
)
def test_bad_switch_is_named_at_config_time(monkeypatch, name, typo, refusal, accepted):
    from vllm_ddtree.tree.dispatch import use_triton

    monkeypatch.setenv(name, typo)
    with pytest.raises(ValueError, match=refusal):
        split_ddtree_config(spec())
    monkeypatch.setenv(name, accepted)
    split_ddtree_config(spec())  # case and spaces as VLLM_DDTREE_RUNNER's
    assert not use_triton(torch.zeros(1))  # CPU tensors take the tensor-op versions whatever the switch


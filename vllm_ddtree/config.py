"""DDTree's speculative-config keys: parsing, defaults and validation.

A user writes `{"method": "ddtree", "model": DRAFTER, "num_speculative_tokens": B, ...}`. vLLM knows no method
"ddtree" and rejects unknown keys, so `split_ddtree_config` turns that dict into the in-tree DFlash config vLLM
validates (method "dflash", the same drafter, B draft tokens per step) plus a `DDTreeConfig` holding the tree
knobs. `validate_models` then checks the drafter against the target once vLLM has loaded both configs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from vllm_ddtree.attention.layers import check_attention_switches
from vllm_ddtree.tree.dispatch import top_k_choice, tree_kernels_choice

METHOD = "ddtree"
MAX_BUDGET = 256
# Where the DDTree settings travel with vLLM's config (pickled to the engine core and the workers).
ATTRIBUTE = "ddtree_config"


def settings_of(speculative_config) -> dict[str, Any] | None:
    """The DDTree settings a vLLM speculative config carries (None for other methods and for no config)."""
    return getattr(speculative_config, ATTRIBUTE, None)

# Keys of vLLM's SpeculativeConfig that DDTree passes through unchanged.
_PASSTHROUGH_KEYS = frozenset(
    {
        "model",
        "num_speculative_tokens",
        "draft_tensor_parallel_size",
        "tensor_parallel_size",
        "max_model_len",
        "revision",
        "code_revision",
        "quantization",
        "enforce_eager",
        "attention_backend",
        "kv_cache_dtype",
        "num_speculative_tokens_per_batch_size",  # checked by `_check_budget_schedule`
    }
)
# Keys of vLLM's SpeculativeConfig that select behaviour DDTree replaces or does not support (yet).
_UNSUPPORTED_KEYS = {
    "disable_padded_drafter_batch": "DDTree needs vLLM's padded drafter batch; remove the key",
    "parallel_drafting": "DDTree always drafts a whole block in parallel; remove the key",
    "rejection_sample_method": "DDTree verifies the tree with its own sampler; remove the key",
    "draft_sample_method": "DDTree builds the tree from the drafter's distributions; remove the key",
    "use_local_argmax_reduction": "DDTree needs the drafter's full logits; remove the key",
    "use_heterogeneous_vocab": "the drafter must share the target's vocabulary",
    "enable_adaptive_verification": "not supported with DDTree; remove the key",
    "synthetic_acceptance_rates": "not supported with DDTree; remove the key",
    "synthetic_acceptance_length": "not supported with DDTree; remove the key",
}


# DDTree's true/false keys and their defaults (host-time cuts of Model Runner V2; no effect on V1).
_SWITCH_KEYS = {"tree_in_graph": True, "layout_in_graph": True}


@dataclass(frozen=True)
class DDTreeConfig:
    """The tree's knobs. `budget` is B: draft nodes verified per step besides the root."""

    budget: int
    # Cap on the tokens kept per depth before the best-first selection (None: up to B).
    max_topk: int | None = None
    # Cap on the tree depth (None: the drafter's block size - 1).
    max_depth: int | None = None
    # Model Runner V2: build the tree inside the drafter's CUDA graph (speculator_v2.py); false: after its pass.
    tree_in_graph: bool = True
    # Model Runner V2: lay out uniform verification steps inside the target's FULL CUDA graphs (verify/step.py,
    # GraphStepLayouts); false: from the host. On by default since session 35 (faster at batch 1-64 on the H200).
    layout_in_graph: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def depth_for(self, block_size: int) -> int:
        """Tree depth for a drafter whose block holds `block_size` positions (the first is the root)."""
        depth = block_size - 1
        return depth if self.max_depth is None else min(depth, self.max_depth)


def drafting_config(vllm_config, num_tokens: int):
    """A shallow copy of vLLM's config whose speculative config drafts `num_tokens` positions per pass: the DFlash
    drafter of a DDTree config queries D = depth positions, while vLLM's own config schedules B drafts. The drafter
    drafts all D at every batch size, so its copy has no `num_speculative_tokens_per_batch_size` (Model Runner V2's
    graph manager would otherwise capture the drafter's FULL graphs for the schedule's verification lengths, none
    of which is the drafter's own 1 + D)."""
    import copy

    spec = copy.copy(vllm_config.speculative_config)
    spec.num_speculative_tokens = num_tokens
    if getattr(spec, "num_speculative_tokens_per_batch_size", None) is not None:
        spec.num_speculative_tokens_per_batch_size = None
    config = copy.copy(vllm_config)
    config.speculative_config = spec
    return config


def _positive_int(key: str, value: Any, upper: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"speculative_config[{key!r}] must be a positive integer, got {value!r}.")
    if upper is not None and value > upper:
        raise ValueError(
            f"speculative_config[{key!r}] = {value} is above the supported maximum {upper}; "
            f"use a value in 1..{upper}."
        )
    return value


def split_ddtree_config(spec: dict[str, Any]) -> tuple[dict[str, Any], DDTreeConfig]:
    """Split a `{"method": "ddtree", ...}` dict into vLLM's DFlash dict and the DDTree settings."""
    assert spec.get("method") == METHOD
    ddtree_keys = {"max_topk", "max_depth", *_SWITCH_KEYS}
    unknown = sorted(set(spec) - _PASSTHROUGH_KEYS - ddtree_keys - set(_UNSUPPORTED_KEYS) - {"method"})
    from vllm_ddtree.compat import speculative_config_keys

    for key in unknown:
        if key in speculative_config_keys():  # a key of this vLLM that DDTree does not wire through
            raise NotImplementedError(
                f"speculative_config[{key!r}] = {spec[key]!r}: vLLM's key for other speculative methods or features, "
                "not supported with method 'ddtree'; remove the key."
            )
    if unknown:
        raise ValueError(
            f"Unknown key(s) {unknown} in speculative_config for method 'ddtree'. Known keys: "
            f"{sorted(_PASSTHROUGH_KEYS | ddtree_keys | {'method'})}."
        )
    for key, why in _UNSUPPORTED_KEYS.items():
        if key in spec:
            raise NotImplementedError(f"speculative_config[{key!r}] = {spec[key]!r} with method 'ddtree': {why}.")
    if not spec.get("model"):
        raise ValueError(
            "speculative_config for method 'ddtree' needs 'model': the path of a DFlash drafter "
            "(a folder whose config.json has 'dflash_config')."
        )
    if "num_speculative_tokens" not in spec:
        raise ValueError(
            "speculative_config for method 'ddtree' needs 'num_speculative_tokens': the tree's node budget B "
            f"(draft nodes verified per step), an integer in 1..{MAX_BUDGET}."
        )
    budget = _positive_int("num_speculative_tokens", spec["num_speculative_tokens"], MAX_BUDGET)
    top_k_choice()  # VLLM_DDTREE_TOP_K and VLLM_DDTREE_TREE_KERNELS: a typo fails here, not at the first draft
    tree_kernels_choice()
    check_attention_switches()
    if "num_speculative_tokens_per_batch_size" in spec:
        _check_budget_schedule(spec["num_speculative_tokens_per_batch_size"], budget)
    max_topk = spec.get("max_topk")
    max_depth = spec.get("max_depth")
    for key, default in _SWITCH_KEYS.items():
        if not isinstance(spec.get(key, default), bool):
            raise ValueError(
                f"speculative_config[{key!r}] must be true or false, got {spec[key]!r} ({type(spec[key]).__name__})."
            )
    ddtree = DDTreeConfig(
        budget=budget,
        max_topk=None if max_topk is None else _positive_int("max_topk", max_topk),
        max_depth=None if max_depth is None else _positive_int("max_depth", max_depth),
        **{key: spec.get(key, default) for key, default in _SWITCH_KEYS.items()},
    )
    dflash = {k: v for k, v in spec.items() if k in _PASSTHROUGH_KEYS}
    dflash["method"] = "dflash"
    return dflash, ddtree


def _check_budget_schedule(schedule: Any, budget: int) -> None:
    """Check `num_speculative_tokens_per_batch_size`, vLLM's own key for a draft length per batch size, as DDTree
    reads it: [[first, last, nodes], ...] (inclusive request-count ranges, the first from 1, ascending, disjoint),
    each step verifying the first `nodes` nodes of every tree (a best-first tree's first n nodes are its best n,
    so every prefix is a tree; 0: no speculation at that batch size). `num_speculative_tokens` is the largest."""
    def fail(why: str) -> ValueError:
        return ValueError(
            f"speculative_config['num_speculative_tokens_per_batch_size'] = {schedule!r}: {why}. Expected a list of "
            f"[first_batch_size, last_batch_size, num_nodes] ranges, e.g. [[1, 4, {budget}], [5, 256, "
            f"{min(budget, 15)}]]."
        )

    if not isinstance(schedule, (list, tuple)) or not schedule:
        raise fail("not a non-empty list")
    ranges = []
    for entry in schedule:
        if not isinstance(entry, (list, tuple)) or len(entry) != 3 or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in entry
        ):
            raise fail(f"entry {entry!r} is not three integers")
        first, last, nodes = entry
        if not 1 <= first <= last:
            raise fail(f"entry {list(entry)} needs 1 <= first_batch_size <= last_batch_size")
        if not 0 <= nodes <= budget:
            raise fail(
                f"entry {list(entry)} asks for {nodes} nodes; each must be in 0..num_speculative_tokens "
                f"({budget}), the largest tree (raise num_speculative_tokens to {nodes} for that range)"
            )
        ranges.append((first, last, nodes))
    ranges.sort()
    if ranges[0][0] != 1:
        raise fail("the first range must start at batch size 1")
    for (_, last, _), (first, _, _) in zip(ranges, ranges[1:]):
        if first <= last:
            raise fail(f"the ranges overlap at batch size {first}")


def validate_models(ddtree: DDTreeConfig, target_hf_config: Any, drafter_hf_config: Any, drafter_path: str) -> int:
    """Check the drafter against the target; returns the tree depth."""
    dflash_config = getattr(drafter_hf_config, "dflash_config", None)
    if not dflash_config:
        raise ValueError(
            f"The drafter at {drafter_path!r} has no 'dflash_config' in its config.json: method 'ddtree' needs a "
            "DFlash drafter (config with architectures ['DFlashDraftModel'], 'block_size' and "
            "'dflash_config': {'mask_token_id': ..., 'target_layer_ids': [...]})."
        )
    block_size = getattr(drafter_hf_config, "block_size", None)
    if not isinstance(block_size, int) or block_size < 2:
        raise ValueError(
            f"The drafter at {drafter_path!r} has block_size={block_size!r}; a DFlash drafter needs an integer "
            "block_size >= 2 in its config.json."
        )
    target_text = getattr(target_hf_config, "text_config", None) or target_hf_config
    target_hidden = getattr(target_text, "hidden_size", None)
    drafter_target_hidden = getattr(drafter_hf_config, "target_hidden_size", None) or drafter_hf_config.hidden_size
    if drafter_target_hidden != target_hidden:
        raise ValueError(
            f"The drafter at {drafter_path!r} expects target hidden size {drafter_target_hidden}, but the target "
            f"model's hidden_size is {target_hidden}. Use a drafter trained for this target."
        )
    target_vocab = getattr(target_text, "vocab_size", None)
    if drafter_hf_config.vocab_size != target_vocab:
        raise ValueError(
            f"The drafter at {drafter_path!r} has vocab_size {drafter_hf_config.vocab_size}, but the target's is "
            f"{target_vocab}. DDTree needs a drafter over the target's vocabulary."
        )
    _check_dflash_ids(dflash_config, getattr(target_text, "num_hidden_layers", None), target_vocab, drafter_path)
    depth = ddtree.depth_for(block_size)
    from vllm_ddtree.tree import max_tree_nodes

    available = max_tree_nodes(depth, drafter_hf_config.vocab_size, ddtree.max_topk, ddtree.budget)
    if ddtree.budget > available:
        raise ValueError(
            f"num_speculative_tokens={ddtree.budget} is more nodes than a tree of depth {depth} with "
            f"max_topk={ddtree.max_topk} can hold ({available}); lower num_speculative_tokens or raise max_topk / "
            "max_depth."
        )
    return depth


def _check_dflash_ids(dflash_config: dict, num_target_layers: int | None, vocab_size: int, drafter_path: str) -> None:
    """The drafter's mask token and the target layers it reads exist in the target (vLLM itself fails later, at
    engine start, with an index error or a feature-size mismatch that names neither)."""
    mask = dflash_config.get("mask_token_id")
    if mask is not None and (isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < vocab_size):
        raise ValueError(
            f"The drafter at {drafter_path!r} has dflash_config.mask_token_id={mask!r}, outside the vocabulary "
            f"(0..{vocab_size - 1}). Use the mask token id the drafter was trained with."
        )
    layers = dflash_config.get("target_layer_ids")
    if layers is None or num_target_layers is None:
        return
    missing = [i for i in layers if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_target_layers]
    if missing or not layers:
        raise ValueError(
            f"The drafter at {drafter_path!r} reads target layers {layers} (dflash_config.target_layer_ids), but the "
            f"target has {num_target_layers} decoder layers (ids 0..{num_target_layers - 1}); "
            f"{missing or 'an empty list'} do not exist. Use a drafter trained for this target."
        )

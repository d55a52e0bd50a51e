"""The target model's attention layers, and the wrapper that gives them tree verification."""

from __future__ import annotations

import torch

from vllm_ddtree.attention.metadata import ATTRIBUTE as TREE_METADATA
from vllm_ddtree.attention.reference import tree_attention_reference_
from vllm_ddtree.kv.paged import paged_kv_for


def target_attention_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Attention layers of the target model (the drafter's are not inside it), by vLLM layer name."""
    layers = {}
    for module in model.modules():
        name = getattr(module, "layer_name", None)
        if name is not None and hasattr(module, "impl") and hasattr(module, "kv_cache"):
            layers[name] = module
    return layers


def check_layer_supported(layer: torch.nn.Module) -> None:
    impl = layer.impl
    problems = {
        "sliding-window attention": getattr(layer, "sliding_window", None) not in (None, -1),
        "ALiBi": getattr(impl, "alibi_slopes", None) is not None,
        "attention logit soft-capping": bool(getattr(impl, "logits_soft_cap", 0) or 0),
        "attention sinks": getattr(impl, "sinks", None) is not None,
        "a quantized (fp8) KV cache": str(getattr(layer, "kv_cache_dtype", "auto")).startswith("fp8"),
    }
    for what, present in problems.items():
        if present:
            raise NotImplementedError(
                f"DDTree tree attention does not support {what} yet (layer {layer.layer_name}); "
                "use method 'dflash' for this model."
            )


def wrap_tree_attention(layer: torch.nn.Module) -> None:
    """Make `layer.impl.forward` redo the tree requests' rows with ancestor masks. Idempotent."""
    impl = layer.impl
    if getattr(impl, "_ddtree_wrapped", False):
        return
    check_layer_supported(layer)
    inner_forward = impl.forward

    def forward(attn_layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        result = inner_forward(attn_layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        tree = getattr(attn_metadata, TREE_METADATA, None) if attn_metadata is not None else None
        if tree is not None:
            num_heads, head_size = impl.num_heads, impl.head_size
            out = output.view(-1, num_heads, head_size)
            tree_attention_reference_(
                query.view(-1, num_heads, head_size), paged_kv_for(impl, kv_cache), tree, impl.scale, out
            )
        return result

    impl.forward = forward
    impl._ddtree_wrapped = True

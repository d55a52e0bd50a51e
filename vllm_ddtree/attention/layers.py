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


def _skips_backend_attention(layer: torch.nn.Module) -> bool:
    """True where the backend writes the KV cache before its forward (vLLM 0.26's GPU backends): then a step
    whose rows are all tree rows needs none of the backend's own attention."""
    backend = getattr(layer, "attn_backend", None)
    return backend is not None and not getattr(backend, "forward_includes_kv_cache_update", True)


def tree_attention_(impl, query: torch.Tensor, kv_cache: torch.Tensor, tree, out: torch.Tensor) -> None:
    """Overwrite the tree rows of `out` [num_tokens, Hq, D]: the Triton kernel on CUDA, else the reference."""
    kv = paged_kv_for(impl, kv_cache)
    if query.is_cuda:
        from vllm_ddtree.attention.triton_tree import tree_attention_triton_

        tree_attention_triton_(
            query, kv.keys, kv.values, tree.block_table, tree.query_start, tree.seq_lens, tree.num_nodes,
            tree.node_mask, tree.max_seq_len, impl.scale, out,
        )  # fmt: skip
    else:
        tree_attention_reference_(query, kv, tree, impl.scale, out)


def wrap_tree_attention(layer: torch.nn.Module) -> None:
    """Make `layer.impl.forward` redo the tree requests' rows with ancestor masks. Idempotent."""
    impl = layer.impl
    if getattr(impl, "_ddtree_wrapped", False):
        return
    check_layer_supported(layer)
    inner_forward = impl.forward
    may_skip = _skips_backend_attention(layer)

    def forward(attn_layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        tree = getattr(attn_metadata, TREE_METADATA, None) if attn_metadata is not None else None
        if tree is not None and may_skip and tree.covers_all_tokens and query.is_cuda:
            result = output  # every row is recomputed below; the KV cache was written before this call
        else:
            result = inner_forward(attn_layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        if tree is not None:
            num_heads, head_size = impl.num_heads, impl.head_size
            out = output.view(-1, num_heads, head_size)
            tree_attention_(impl, query.view(-1, num_heads, head_size), kv_cache, tree, out)
        return result

    impl.forward = forward
    impl._ddtree_wrapped = True

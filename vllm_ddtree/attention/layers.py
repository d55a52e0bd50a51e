"""The target model's attention layers, and the wrapper that gives them tree verification."""

from __future__ import annotations

import torch

from vllm_ddtree.attention.metadata import ATTRIBUTE as TREE_METADATA
from vllm_ddtree.attention.metadata import backend_rows_requested, full_cuda_graphs_requested
from vllm_ddtree.attention.per_path import (
    fa3_attend,
    per_path_attention_,
    per_path_mode,
    per_path_requested,
    per_path_splits,
    reference_attend,
)
from vllm_ddtree.attention.reference import tree_attention_reference_
from vllm_ddtree.env import env_choice
from vllm_ddtree.kv.paged import paged_kv_for

SPLIT_ATTENTION_ENV = "VLLM_DDTREE_SPLIT_ATTENTION"


def target_attention_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Attention layers of the target model (the drafter's are not inside it), by vLLM layer name."""
    layers = {}
    for module in model.modules():
        name = getattr(module, "layer_name", None)
        if name is not None and hasattr(module, "impl") and hasattr(module, "kv_cache"):
            layers[name] = module
    return layers


def wrap_target_layers(model: torch.nn.Module, kv_cache_config):
    """The target's attention layers by name, wrapped for tree verification (`wrap_tree_attention`), and the same
    layers by KV cache group of vLLM's `kv_cache_config` (`layers_by_kv_group`)."""
    layers = target_attention_layers(model)
    for layer in layers.values():
        wrap_tree_attention(layer)
    return layers, layers_by_kv_group(layers, kv_cache_config)


def layers_by_kv_group(layers: dict[str, torch.nn.Module], kv_cache_config) -> list[tuple[int, list[torch.nn.Module]]]:
    """[(gid, layers)]: the layers of each KV cache group (gid indexes the group's slot mapping), in layer order.
    Built once per KV cache; KV compaction walks it every step."""
    group_of = {name: gid for gid, group in enumerate(kv_cache_config.kv_cache_groups) for name in group.layer_names}
    groups: dict[int, list[torch.nn.Module]] = {}
    for name, layer in layers.items():
        groups.setdefault(group_of[name], []).append(layer)
    return list(groups.items())


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


def _split_attention_applies(impl, query: torch.Tensor, tree) -> bool:
    """The split design (FA3 over the context with LSE + a small tree kernel, merged) needs a batch of tree
    requests only and FlashAttention-3 (16-bit dtypes). VLLM_DDTREE_SPLIT_ATTENTION: "auto" (default) uses it for
    two or more requests, "1" always, "0" never. With one request the one-pass kernel was as fast or faster as CUDA
    graph replays on the H200 (Qwen3-8B attention, B = 15: 17.4 vs 24.7 us at 1k context, 41.9 vs 41.8 us at 8k;
    from batch 8 on the split was faster: docs/benchmarks.md, session 15)."""
    choice = split_attention_choice()
    return (
        tree.covers_all_tokens
        and tree.cu_seqlens_q is not None
        and query.dtype in (torch.float16, torch.bfloat16)
        and getattr(impl, "vllm_flash_attn_version", None) == 3
        and choice != "0"
        and (choice == "1" or tree.num_tree_reqs > 1)
    )


def split_attention_choice() -> str:
    """`VLLM_DDTREE_SPLIT_ATTENTION`: auto (the default), 0 or 1 (`_split_attention_applies`)."""
    return env_choice(SPLIT_ATTENTION_ENV, ("auto", "0", "1"), "is not one of auto (split for two or more tree "
                      "requests, the default), 0 (never) or 1 (always)")  # fmt: skip


def check_attention_switches() -> None:
    """Read every tree-attention switch once, so that a bad value fails when the config is built, not mid-step:
    VLLM_DDTREE_SPLIT_ATTENTION, _PER_PATH_ATTENTION, _PER_PATH_SPLITS, _BACKEND_ROWS and _FULL_CUDA_GRAPHS."""
    split_attention_choice(), per_path_mode(), per_path_splits(), backend_rows_requested(), full_cuda_graphs_requested()


def _per_path_applies(impl, query: torch.Tensor) -> bool:
    """`VLLM_DDTREE_PER_PATH_ATTENTION` on (`attention/per_path.py`): on CUDA with FlashAttention-3 and a 16-bit
    dtype, every node verified by FA3 over its context and path, to round as plain decoding does; on the CPU build
    through its pure-torch stand-in (slow: the way the engine tests check the path's wiring)."""
    if not per_path_requested():
        return False
    if not query.is_cuda:
        return True
    return query.dtype in (torch.float16, torch.bfloat16) and getattr(impl, "vllm_flash_attn_version", None) == 3


def split_tree_attention_(query, keys, values, tree, scale: float, out: torch.Tensor, launch=None) -> None:
    """The split design on CUDA: FA3 over each request's context (non-causal, with LSE; every scheduled row is a
    tree node, `tree.covers_all_tokens`), then the tree part merged into `out` by one Triton launch (`launch`: a
    prefix of `triton_tree._launch_config`'s tuple for scripts/bench_attention.py's A/B; None: the kernel's choice).
    query/out [num_tokens, Hq, D]; keys/values [num_blocks, page, Hkv, D]."""
    from vllm_ddtree.attention.triton_tree import tree_attention_split_
    from vllm_ddtree.compat import flash_attn_varlen

    context_out, context_lse = flash_attn_varlen()(
        query, keys, values, max_seqlen_q=tree.node_mask.shape[1], cu_seqlens_q=tree.cu_seqlens_q,
        max_seqlen_k=tree.max_seq_len, seqused_k=tree.context_lens, causal=False, block_table=tree.block_table,
        softmax_scale=scale, return_softmax_lse=True, fa_version=3,
    )  # fmt: skip
    tree_attention_split_(
        query, keys, values, tree.block_table, tree.query_start, tree.seq_lens, tree.num_nodes, tree.node_mask,
        tree.max_seq_len, scale, context_out, context_lse, out, launch=launch,
    )  # fmt: skip


def tree_attention_(impl, query: torch.Tensor, kv_cache: torch.Tensor, tree, out: torch.Tensor) -> None:
    """Overwrite the tree rows of `out` [num_tokens, Hq, D]: the Triton kernel on CUDA, else the reference."""
    kv = paged_kv_for(impl, kv_cache)
    if _per_path_applies(impl, query):
        per_path_attention_(query, kv, tree, impl.scale, out, fa3_attend if query.is_cuda else reference_attend)
    elif query.is_cuda and _split_attention_applies(impl, query, tree):
        split_tree_attention_(query, kv.keys, kv.values, tree, impl.scale, out)
    elif query.is_cuda:
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
        keep_backend = tree is not None and tree.backend_rows is not None
        if tree is not None and may_skip and tree.covers_all_tokens and query.is_cuda and not keep_backend:
            result = output  # every row is recomputed below; the KV cache was written before this call
        else:
            result = inner_forward(attn_layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        if tree is not None:
            num_heads, head_size = impl.num_heads, impl.head_size
            out = output.view(-1, num_heads, head_size)
            if keep_backend:
                rows, keep = tree.backend_rows  # [T, N]
                backend_out = out[rows]  # [T, N, Hq, D] the backend's causal rows
            tree_attention_(impl, query.view(-1, num_heads, head_size), kv_cache, tree, out)
            if keep_backend:
                out[rows] = torch.where(keep[:, :, None, None], backend_out, out[rows])
        return result

    impl.forward = forward
    impl._ddtree_wrapped = True

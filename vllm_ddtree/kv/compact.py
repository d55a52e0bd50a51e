"""KV compaction: after the walk, the accepted path's keys and values move into the slots right after the root,
in every target layer, so the cache looks as if the path had been decoded one token at a time.

On CUDA all layers of a KV cache group move in one Triton launch (`triton_compact.py`), which is the walk's own
launch where the target has one KV cache group (`kv_for_the_walk`); elsewhere (the CPU build) each layer is a
gather then a scatter in torch.
"""

from __future__ import annotations

import torch

from vllm_ddtree.kv.paged import paged_kv_for


def slot_mapping_of(runner) -> dict[int, torch.Tensor]:
    """This step's slot of every scheduled token, per KV cache group, as vLLM computed it."""
    block_tables = runner.input_batch.block_table
    return {gid: block_tables[gid].slot_mapping.gpu for gid in range(len(runner.kv_cache_config.kv_cache_groups))}


def _cache_ptr(layer: torch.nn.Module) -> int:
    cache = layer.kv_cache[0] if isinstance(layer.kv_cache, (list, tuple)) else layer.kv_cache
    return cache.data_ptr()


def _layer_table(layers: list[torch.nn.Module], tables: dict):
    """The cached device table of these layers' cache addresses (`layers`: a group list of the runner's state,
    `attention.layers.layers_by_kv_group`), rebuilt if the caches were reallocated (all together: the first layer's
    address tells)."""
    from vllm_ddtree.kv.triton_compact import LayerTable

    key, ptr = ("table", id(layers)), _cache_ptr(layers[0])
    cached = tables.get(key)
    if cached is None or cached[0] is not layers or cached[1] != ptr:
        views = [paged_kv_for(layer.impl, layer.kv_cache) for layer in layers]
        cached = tables[key] = (layers, ptr, LayerTable([v.keys for v in views], [v.values for v in views]))
    return cached[2]


def kv_for_the_walk(
    groups: list[tuple[int, list[torch.nn.Module]]],  # the target layers by KV cache group (`layers_by_kv_group`)
    slot_mappings: dict[int, torch.Tensor],  # gid -> [num_tokens] slot per scheduled token
    tables: dict,
    on: torch.Tensor,  # a tensor of the step (its device and the kernel choice decide)
) -> tuple | None:
    """(LayerTable, slot mapping) for the walk's launch to move the accepted paths' KV itself
    (`tree.triton_walk`), where the Triton kernels run and the target's layers form one KV cache group; None
    otherwise, and `compact_accepted_kv_` runs after the walk."""
    from vllm_ddtree.tree.dispatch import use_triton

    if len(groups) != 1 or not use_triton(on):
        return None
    gid, layers = groups[0]
    return _layer_table(layers, tables), slot_mappings[gid]


def compact_accepted_kv_(
    groups: list[tuple[int, list[torch.nn.Module]]],  # the target layers by KV cache group (`layers_by_kv_group`)
    src: torch.Tensor,  # [R * M] scheduled-token index whose KV moves (request-major, M moves per request)
    dst: torch.Tensor,  # [R * M] scheduled-token index it moves to
    slot_mappings: dict[int, torch.Tensor],  # gid -> [num_tokens] slot per scheduled token
    num_reqs: int | None = None,
    tables: dict | None = None,
) -> None:
    for gid, group in groups:
        if src.is_cuda and num_reqs and tables is not None:  # one launch; the kernel reads the slots itself
            from vllm_ddtree.kv.triton_compact import compact_kv_triton_

            table = _layer_table(group, tables)
            compact_kv_triton_(table, src.view(num_reqs, -1), dst.view(num_reqs, -1), slot_mappings[gid])
            continue
        slots = slot_mappings[gid].to(torch.int64)
        src_slots, dst_slots = slots[src], slots[dst]
        for layer in group:
            paged_kv_for(layer.impl, layer.kv_cache).copy_slots(src_slots, dst_slots)

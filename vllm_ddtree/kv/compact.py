"""KV compaction: after the walk, the accepted path's keys and values move into the slots right after the root,
in every target layer, so the cache looks as if the path had been decoded one token at a time."""

from __future__ import annotations

import torch

from vllm_ddtree.kv.paged import paged_kv_for


def slot_mapping_of(runner) -> dict[int, torch.Tensor]:
    """This step's slot of every scheduled token, per KV cache group, as vLLM computed it."""
    block_tables = runner.input_batch.block_table
    return {gid: block_tables[gid].slot_mapping.gpu for gid in range(len(runner.kv_cache_config.kv_cache_groups))}


def compact_accepted_kv_(
    layers: dict[str, torch.nn.Module],
    src: torch.Tensor,  # [M] scheduled-token index whose KV moves
    dst: torch.Tensor,  # [M] scheduled-token index it moves to
    slot_mappings: dict[int, torch.Tensor],  # gid -> [num_tokens] slot per scheduled token
    layer_groups: dict[str, int] | None = None,
) -> None:
    for name, layer in layers.items():
        gid = 0 if layer_groups is None else layer_groups[name]
        slots = slot_mappings[gid].to(torch.int64)
        paged_kv_for(layer.impl, layer.kv_cache).copy_slots(slots[src], slots[dst])

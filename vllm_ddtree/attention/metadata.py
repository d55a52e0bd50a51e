"""Tree-aware verification attention metadata.

vLLM's own metadata builder still builds the backend's metadata for the whole batch (prefills, plain decodes and
the tree requests, with causal masks). `TreeAttentionMetadataBuilder` adds what the tree requests need on top:
which requests are trees, where their nodes are, and each node's ancestor mask. It is attached to the backend's
metadata as the attribute `ddtree`, so it reaches the attention layers through vLLM's forward context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_ddtree.tree import ancestor_mask
from vllm_ddtree.verify.step import TreeStep, to_device

ATTRIBUTE = "ddtree"


@dataclass
class TreeAttentionMetadata:
    tree_reqs: torch.Tensor  # [T] int64, batch index of each request with draft nodes
    num_nodes_cpu: list[int]  # [T] nodes per tree request, root included (host)
    query_start: torch.Tensor  # [T] int64, index of each tree request's root among the scheduled tokens
    seq_lens: torch.Tensor  # [T] int64, context + nodes
    block_table: torch.Tensor  # [T, max_blocks] int32
    node_mask: torch.Tensor  # [T, N, N] bool, node i may attend node j (j is i or an ancestor of i)
    num_nodes: torch.Tensor  # [T] int64, device copy of num_nodes_cpu
    max_seq_len: int  # host upper bound of seq_lens (sizes the GPU kernel's context splits)
    # Every scheduled request is a tree request: a GPU backend that writes the KV cache outside its forward
    # may skip its own (causal) attention, since every row is recomputed.
    covers_all_tokens: bool = False
    # With covers_all_tokens: FlashAttention's varlen inputs for the context pass of the split design.
    cu_seqlens_q: torch.Tensor | None = None  # [T + 1] int32, the backend's query_start_loc
    context_lens: torch.Tensor | None = None  # [T] int32, keys before each root

    @property
    def num_tree_reqs(self) -> int:
        return len(self.num_nodes_cpu)


class TreeAttentionMetadataBuilder:
    """Builds `TreeAttentionMetadata` once per step; attaches it to each target layer's backend metadata."""

    def __init__(self, target_layer_names: set[str]):
        self.target_layer_names = target_layer_names

    def build(self, step: TreeStep, backend_metadata) -> TreeAttentionMetadata | None:
        if step.tree_reqs_cpu.size == 0:
            return None
        device = step.parents.device
        all_trees = step.tree_reqs_cpu.size == step.num_nodes_cpu.size
        tree_reqs = step.tree_reqs if step.tree_reqs is not None else to_device(step.tree_reqs_cpu, device)
        seq_lens = backend_metadata.seq_lens[tree_reqs].to(torch.int64)
        max_seq_len = getattr(backend_metadata, "max_seq_len", None)
        if max_seq_len is None:  # backends without a host copy (CPU): one sync per step
            max_seq_len = int(seq_lens.max())
        return TreeAttentionMetadata(
            tree_reqs=tree_reqs,
            num_nodes_cpu=step.num_nodes_cpu[step.tree_reqs_cpu].tolist(),
            query_start=backend_metadata.query_start_loc[tree_reqs].to(torch.int64),
            seq_lens=seq_lens,
            block_table=backend_metadata.block_table[tree_reqs],
            node_mask=ancestor_mask(step.parents[tree_reqs]),
            num_nodes=step.num_nodes[tree_reqs],
            max_seq_len=int(max_seq_len),
            covers_all_tokens=all_trees,
            cu_seqlens_q=backend_metadata.query_start_loc if all_trees else None,
            context_lens=(seq_lens - step.num_nodes[tree_reqs]).to(torch.int32) if all_trees else None,
        )

    def attach(self, step: TreeStep, attn_metadata) -> None:
        """Attach tree metadata to the target layers' entries of vLLM's per-layer metadata (dict or list)."""
        per_layer_dicts = attn_metadata if isinstance(attn_metadata, list) else [attn_metadata]
        built: dict[int, TreeAttentionMetadata | None] = {}
        for per_layer in per_layer_dicts:
            for name, backend_metadata in per_layer.items():
                if name not in self.target_layer_names:
                    continue
                key = id(backend_metadata)
                if key not in built:
                    built[key] = self.build(step, backend_metadata)
                setattr(backend_metadata, ATTRIBUTE, built[key])

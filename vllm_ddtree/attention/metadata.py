"""Tree-aware verification attention metadata.

vLLM's own metadata builder still builds the backend's metadata for the whole batch (prefills, plain decodes and
the tree requests, with causal masks). `TreeAttentionMetadataBuilder` adds what the tree requests need on top:
which requests are trees, where their nodes are, and each node's ancestor mask. It is attached to the backend's
metadata as the attribute `ddtree`, so it reaches the attention layers through vLLM's forward context.

FULL CUDA graphs (the default; `VLLM_DDTREE_FULL_CUDA_GRAPHS=0` turns them off): a graph replays the kernel launches
of its capture, so the tree inputs must live at fixed addresses. With `PersistentTreeBuffers`, a step whose requests are all trees
writes its masks, node counts and context lengths into preallocated buffers and points everything else at vLLM's
own persistent tensors (query_start_loc, seq_lens, block table), padded to the backend's (padded) request count with
0-node requests; the capture's dummy batch is laid out the same way (`dummy_tree_step`).

vLLM (V1 and V2 alike) replays the FULL graph of n tokens a request for every batch whose requests all have n
scheduled tokens, drafts or not: a prefill chunk of exactly n tokens, alone or beside n-node trees, replays the tree
graph too. So in a uniform batch (`uniform_nodes`) every request without drafts is laid out as a chain of its n
tokens (a chain's ancestor mask is the causal mask), and the persistent buffers are written for it as well.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_ddtree.env import env_choice
from vllm_ddtree.tree import ancestor_mask
from vllm_ddtree.tree.dispatch import use_triton
from vllm_ddtree.verify.step import TreeStep, build_tree_step, to_device

ATTRIBUTE = "ddtree"
FULL_CUDA_GRAPHS_ENV = "VLLM_DDTREE_FULL_CUDA_GRAPHS"
BACKEND_ROWS_ENV = "VLLM_DDTREE_BACKEND_ROWS"


def full_cuda_graphs_requested() -> bool:
    """Keep vLLM's FULL_AND_PIECEWISE cudagraph mode for DDTree (default); `VLLM_DDTREE_FULL_CUDA_GRAPHS=0` makes
    it PIECEWISE, with tree attention eager between the graph pieces (measured ~1.5-2.5x slower per step)."""
    fix = "is not 1 (FULL CUDA graphs, the default) or 0 (PIECEWISE)"
    return env_choice(FULL_CUDA_GRAPHS_ENV, ("1", "0"), fix) == "1"


def backend_rows_requested() -> bool:
    """Experimental, off by default (`VLLM_DDTREE_BACKEND_ROWS=1`): the attention backend also runs its causal pass
    over all-tree batches, and the rows whose ancestors are exactly the nodes before them (the root and the
    tree's leading chain) keep its output; the tree kernel's output stands for the other rows. On the GPU those rows
    then round like vLLM's chain verification and plain decoding (FlashAttention-3), which the tree kernel does not
    (bf16 greedy drift, docs/benchmarks.md session 17). It costs the backend's pass, which all-tree batches skip
    otherwise."""
    return env_choice(BACKEND_ROWS_ENV, ("0", "1"), "is not 0 (off, the default) or 1 (on)") == "1"


def backend_rows(
    node_mask: torch.Tensor,  # [T, N, N] ancestor masks
    num_nodes: torch.Tensor,  # [T] valid nodes (0: a padding request)
    query_start: torch.Tensor,  # [T] scheduled-token index of each request's root
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [T, N] int64, keep [T, N] bool): the scheduled-token row of every node and whether it keeps the
    backend's causal output (its mask row is causal: node i sees nodes 0..i, so causal attention is tree
    attention). Entries are aliased as in `node_aliases`, with the aliased entry's `keep`: duplicate rows then always
    carry equal values through a gather and a scatter."""
    width = node_mask.shape[1]
    node = torch.arange(width, device=node_mask.device)
    causal = node[None, :] <= node[:, None]  # [N, N]
    keep = (node_mask.bool() == causal).all(dim=-1) & (node[None, :] < num_nodes[:, None])  # [T, N]
    alias_req, alias_node = node_aliases(num_nodes, width)
    rows = query_start.to(torch.int64)[alias_req] + alias_node
    return rows, keep[alias_req, alias_node]


def node_aliases(num_nodes: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(request [T, N], node [T, N]) int64: the node each entry of a [T, N] grid of tree nodes stands for. Entries
    past a request's last node stand for that node, and requests without nodes (padding) for request 0's root: an
    entry computed from its alias's inputs equals the alias's output, so a scatter of every entry is well defined."""
    num_trees = num_nodes.shape[0]
    node = torch.arange(width, device=num_nodes.device)  # [N]
    real = (num_nodes > 0)[:, None]  # [T, 1]
    alias_node = torch.where(real, torch.minimum(node[None, :], (num_nodes[:, None] - 1).clamp(min=0)), 0)
    alias_req = torch.where(real, torch.arange(num_trees, device=num_nodes.device)[:, None], 0).expand(-1, width)
    return alias_req, alias_node


@dataclass
class PersistentTreeBuffers:
    """Fixed-address tree inputs for FULL CUDA graphs, one row per request slot of the batch."""

    node_mask: torch.Tensor  # [max_reqs, N, N] uint8
    num_nodes: torch.Tensor  # [max_reqs] int32
    context_lens: torch.Tensor  # [max_reqs] int32
    backend_rows: torch.Tensor  # [max_reqs, N] int64 (`backend_rows`, with VLLM_DDTREE_BACKEND_ROWS=1)
    backend_keep: torch.Tensor  # [max_reqs, N] bool

    @classmethod
    def allocate(cls, max_reqs: int, width: int, device: torch.device) -> "PersistentTreeBuffers":
        return cls(
            node_mask=torch.zeros((max_reqs, width, width), dtype=torch.uint8, device=device),
            num_nodes=torch.zeros(max_reqs, dtype=torch.int32, device=device),
            context_lens=torch.zeros(max_reqs, dtype=torch.int32, device=device),
            backend_rows=torch.zeros((max_reqs, width), dtype=torch.int64, device=device),
            backend_keep=torch.zeros((max_reqs, width), dtype=torch.bool, device=device),
        )


def uniform_nodes(num_reqs: int, num_tokens: int, max_query_len: int, width: int) -> int | None:
    """n when every one of the batch's requests has n scheduled tokens, 2 <= n <= width (B + 1): the batches vLLM
    may run in the FULL graph of n-node trees, whether or not their requests have drafts; None otherwise."""
    uniform = num_reqs > 0 and num_tokens == num_reqs * max_query_len
    return max_query_len if uniform and 2 <= max_query_len <= width else None


def dummy_tree_step(num_reqs: int, num_nodes: int, width: int, device: torch.device) -> TreeStep:
    """Every request a chain of `num_nodes` <= `width` nodes, padded to `width`: the layout of a uniform verification
    batch (graph capture)."""
    logits_indices = torch.arange(num_reqs * num_nodes, device=device)
    return build_tree_step([num_nodes - 1] * num_reqs, logits_indices, None, None, [-1] * num_reqs, width)


def tree_attention_builder(layer_names, cudagraph_mode, max_reqs: int, width: int, depth: int, device, logger):
    """The step's metadata builder; with FULL CUDA graphs (left so by the runner hooks unless opted out) it writes
    the tree inputs into persistent buffers, the addresses the graphs were captured with."""
    persistent = None
    if cudagraph_mode is not None and cudagraph_mode.has_full_cudagraphs():
        persistent = PersistentTreeBuffers.allocate(max_reqs, width, device)
        logger.info("DDTree: FULL CUDA graphs for uniform tree-verification batches (%s)", cudagraph_mode.name)
    from vllm_ddtree.attention.per_path import PER_PATH_CALLS, PER_PATH_ENV, per_path_mode

    mode = per_path_mode()
    if mode != "0":
        logger.info("DDTree: %s=%s: tree nodes verified by FA3 over their context and path (%s), where the backend "
                    "is FlashAttention-3 and the dtype 16-bit (else the tree kernels)", PER_PATH_ENV, mode,
                    PER_PATH_CALLS[mode])
    return TreeAttentionMetadataBuilder(set(layer_names), persistent, depth)


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
    # With VLLM_DDTREE_BACKEND_ROWS=1: (rows, keep) of `backend_rows`; the backend's pass runs and its output
    # stays in the kept rows.
    backend_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    # The trees' depth bound (the drafter's block size - 1, or max_depth; None: unknown, at most N - 1).
    depth: int | None = None

    @property
    def num_tree_reqs(self) -> int:
        return len(self.num_nodes_cpu)


class TreeAttentionMetadataBuilder:
    """Builds `TreeAttentionMetadata` once per step; attaches it to each target layer's backend metadata."""

    def __init__(
        self, target_layer_names: set[str], persistent: PersistentTreeBuffers | None = None, depth: int | None = None
    ):
        self.target_layer_names = target_layer_names
        self.persistent = persistent
        self.depth = depth

    def build(self, step: TreeStep, backend_metadata, uniform: int | None = None) -> TreeAttentionMetadata | None:
        """`uniform`: n if every request of the batch has n scheduled tokens (`uniform_nodes`), else None."""
        if step.tree_reqs_cpu.size == 0:
            return None
        device = step.parents.device
        all_trees = step.tree_reqs_cpu.size == step.num_nodes_cpu.size
        if self.persistent is not None and (all_trees or uniform is not None):
            return self._build_persistent(step, backend_metadata, None if all_trees else uniform)
        tree_reqs = step.tree_reqs if step.tree_reqs is not None else to_device(step.tree_reqs_cpu, device)
        seq_lens = backend_metadata.seq_lens[tree_reqs].to(torch.int64)
        max_seq_len = getattr(backend_metadata, "max_seq_len", None)
        if max_seq_len is None:  # backends without a host copy (CPU): one sync per step
            max_seq_len = int(seq_lens.max())
        query_start = backend_metadata.query_start_loc[tree_reqs].to(torch.int64)
        node_mask = ancestor_mask(step.parents[tree_reqs])
        num_nodes = step.num_nodes[tree_reqs]
        return TreeAttentionMetadata(
            tree_reqs=tree_reqs,
            num_nodes_cpu=step.num_nodes_cpu[step.tree_reqs_cpu].tolist(),
            query_start=query_start,
            seq_lens=seq_lens,
            block_table=backend_metadata.block_table[tree_reqs],
            node_mask=node_mask,
            num_nodes=num_nodes,
            max_seq_len=int(max_seq_len),
            covers_all_tokens=all_trees,
            cu_seqlens_q=backend_metadata.query_start_loc if all_trees else None,
            context_lens=(seq_lens - num_nodes).to(torch.int32) if all_trees else None,
            backend_rows=backend_rows(node_mask, num_nodes, query_start) if backend_rows_requested() else None,
            depth=self.depth,
        )

    def _build_persistent(self, step: TreeStep, backend_metadata, chain_nodes: int | None) -> TreeAttentionMetadata:
        """All-tree steps with FULL CUDA graphs: fixed-address tensors only, rows padded to the backend's request
        count (padding requests have 0 nodes, so the kernels skip them). `chain_nodes` n: a uniform batch with
        requests that have no drafts (prefill chunks of n tokens): each of them is a chain of n nodes."""
        buffers = self.persistent
        num_reqs, padded = step.num_nodes.shape[0], backend_metadata.seq_lens.shape[0]
        node_mask, num_nodes = buffers.node_mask[:padded], buffers.num_nodes[:padded]
        context_lens = buffers.context_lens[:padded]
        parents, step_num_nodes = step.parents, step.num_nodes
        if chain_nodes is not None:
            chain = torch.arange(step.width, device=parents.device) - 1  # [N]
            parents = torch.where((step_num_nodes > 1)[:, None], parents, chain)  # [R, N]
            step_num_nodes = torch.full_like(step_num_nodes, chain_nodes)
        if use_triton(parents):  # one launch
            from vllm_ddtree.tree.triton_layout import padded_tree_inputs_triton_

            padded_tree_inputs_triton_(parents, step_num_nodes, backend_metadata.seq_lens, node_mask,
                                       num_nodes, context_lens)  # fmt: skip
        else:
            node_mask[:num_reqs].copy_(ancestor_mask(parents))
            node_mask[num_reqs:].zero_()
            num_nodes[:num_reqs].copy_(step_num_nodes)
            num_nodes[num_reqs:].zero_()
            torch.sub(backend_metadata.seq_lens, num_nodes, out=context_lens)
        kept_backend_rows = None
        if backend_rows_requested():
            kept_backend_rows = (buffers.backend_rows[:padded], buffers.backend_keep[:padded])
            fresh = backend_rows(node_mask, num_nodes, backend_metadata.query_start_loc[:padded])
            for buffer, values in zip(kept_backend_rows, fresh):
                buffer.copy_(values)
        if chain_nodes is None:
            num_nodes_cpu = step.num_nodes_cpu.tolist()
            tree_reqs = step.tree_reqs if step.tree_reqs is not None else to_device(step.tree_reqs_cpu, parents.device)
        else:
            num_nodes_cpu = [chain_nodes] * num_reqs
            tree_reqs = torch.arange(num_reqs, device=parents.device)
        return TreeAttentionMetadata(
            tree_reqs=tree_reqs,
            num_nodes_cpu=num_nodes_cpu + [0] * (padded - num_reqs),
            query_start=backend_metadata.query_start_loc[:padded],
            seq_lens=backend_metadata.seq_lens,
            block_table=backend_metadata.block_table,
            node_mask=node_mask,
            num_nodes=num_nodes,
            max_seq_len=int(backend_metadata.max_seq_len),
            covers_all_tokens=True,
            cu_seqlens_q=backend_metadata.query_start_loc,
            context_lens=context_lens,
            backend_rows=kept_backend_rows,
            depth=self.depth,
        )

    def backend_metadata_of(self, attn_metadata):
        """The backend metadata of the first target layer in vLLM's per-layer metadata (dict or list of dicts),
        None if none is there. Every target layer's metadata has the step's request count (seq_lens)."""
        for per_layer in attn_metadata if isinstance(attn_metadata, list) else [attn_metadata]:
            for name, backend_metadata in per_layer.items():
                if name in self.target_layer_names:
                    return backend_metadata
        return None

    def attach(self, step: TreeStep, attn_metadata, uniform: int | None = None) -> None:
        """Attach tree metadata to the target layers' entries of vLLM's per-layer metadata (dict or list).
        `uniform`: as in `build`."""
        per_layer_dicts = attn_metadata if isinstance(attn_metadata, list) else [attn_metadata]
        built: dict[int, TreeAttentionMetadata | None] = {}
        for per_layer in per_layer_dicts:
            for name, backend_metadata in per_layer.items():
                if name not in self.target_layer_names:
                    continue
                key = id(backend_metadata)
                if key not in built:
                    built[key] = self.build(step, backend_metadata, uniform)
                setattr(backend_metadata, ATTRIBUTE, built[key])

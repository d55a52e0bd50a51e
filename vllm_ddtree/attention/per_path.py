"""Per-path tree verification: every node attends as (part of) a sequence of its own, through FlashAttention-3.

A node's tree attention is causal attention over its request's context and its own root-to-node path. FA3
verifying a chain of up to 17 nodes is bitwise one-token decoding (session 49, docs/benchmarks.md), while DDTree's
Triton kernels round differently, which is all it takes for bf16 greedy answers to leave plain decoding's (issue 3).
So here the keys of a node's context and path are named in place by a table of key slots over the KV cache viewed
as one-token pages (no KV is copied), and FA3 attends over them. Opt-in (`VLLM_DDTREE_PER_PATH_ATTENTION`, FA3 and
16-bit dtypes only), three ways (`PER_PATH_CALLS`):

- `1`: every node one sequence with one query, all in one call;
- `decode`: one call per node index, each with one query per request, the batch of a plain decoding step of the
  same requests (FA3 splits a sequence's keys among thread blocks by a heuristic over the whole call's batch, and
  the split sets the rounding);
- `chains`: each tree split into chains (a chain starts at the root or at a node that is not its parent's first
  child, and runs through first children), one call per chain index with one causal sequence per request over the
  context and the path of the chain's last node: the shape of vLLM's own chain verification, and each context is
  read once per chain instead of once per node.

Every node reads its whole context once (per node, or per chain), so attention work grows with the tree: an
exactness mode, not a speed mode. Shapes are fixed by the tree buffers and the block table (CUDA graphs), and
nothing here waits for the device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from vllm_ddtree.attention.metadata import node_aliases
from vllm_ddtree.env import env_choice
from vllm_ddtree.kv.paged import PagedKV

PER_PATH_ENV = "VLLM_DDTREE_PER_PATH_ATTENTION"
SPLITS_ENV = "VLLM_DDTREE_PER_PATH_SPLITS"

PER_PATH_CALLS = {
    "0": "off",
    "1": "every node one query, all in one call",
    "decode": "one call per node index, one query per request",
    "chains": "one call per chain index, one causal chain per request",
}


def per_path_mode() -> str:
    """`VLLM_DDTREE_PER_PATH_ATTENTION`, one of `PER_PATH_CALLS` ("0", off, by default)."""
    ways = "; ".join(f"{value}: {meaning}" for value, meaning in PER_PATH_CALLS.items())
    return env_choice(PER_PATH_ENV, tuple(PER_PATH_CALLS), f"is not one of 0, 1, decode or chains ({ways})")


def per_path_requested() -> bool:
    """Whether `per_path_mode` is on (CUDA, FA3, 16-bit dtypes; the CPU build runs the torch stand-in)."""
    return per_path_mode() != "0"


def node_key_slots(
    block_table: torch.Tensor,  # [T, max_blocks] int32
    seq_lens: torch.Tensor,  # [T] context + nodes
    num_nodes: torch.Tensor,  # [T] (0: a padding request)
    node_mask: torch.Tensor,  # [T, N, N] node i may attend node j
    page: int,
    entries: tuple[torch.Tensor, torch.Tensor] | None = None,  # (request [A, B], node [A, B]) int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots [A * B, max_blocks * page] int32, lengths [A * B] int32): for each entry (a request's node; by default
    the node grid [T, N] aliased as in `node_aliases`), the KV slots of its keys in order, context positions 0..C-1
    and then the positions C + j of its path's nodes j (ancestors and itself, root first), and how many there are.
    Columns past the length repeat valid slots (never read)."""
    width = node_mask.shape[1]
    max_keys = block_table.shape[1] * page
    device = node_mask.device
    req, node = entries if entries is not None else node_aliases(num_nodes, width)  # [A, B]
    context = (seq_lens - num_nodes).to(torch.int64)[req]  # [A, B]
    on_path = node_mask[req, node].bool() & (torch.arange(width, device=device) < num_nodes[req][..., None])
    # on_path [A, B, N]: node j is on the entry's path
    rank = on_path.cumsum(-1) - 1  # [A, B, N] j's place along the path
    # int32 from here: [A, B, K] is the big one (under CUDA graphs K is the block table's width, max_model_len)
    positions = torch.arange(max_keys + 1, dtype=torch.int32, device=device).expand(*req.shape, -1).clone()
    column = torch.where(on_path, context[..., None] + rank, max_keys)  # off-path j: the spare column K
    path_positions = (context[..., None] + torch.arange(width, device=device)).to(torch.int32)  # [A, B, N]
    positions.scatter_(2, column, path_positions)  # [A, B, K + 1]
    positions = positions[..., :max_keys].clamp_(max=max_keys - 1)  # [A, B, K]
    lengths = (context + on_path.sum(-1)).clamp(min=1)  # [A, B]; >= 1: padding entries read one valid key
    slots = block_table[req[..., None], positions // page] * page + positions % page  # [A, B, K]
    return slots.view(req.numel(), max_keys).to(torch.int32), lengths.view(-1).to(torch.int32)


def one_token_pages(cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, page, H, D] -> [num_blocks * page, 1, H, D], the same memory (slot s is page s)."""
    try:
        return cache.view(cache.shape[0] * cache.shape[1], 1, *cache.shape[2:])
    except RuntimeError as error:
        raise NotImplementedError(
            f"{PER_PATH_ENV} needs a KV cache whose blocks are contiguous runs of slots (got strides "
            f"{tuple(cache.stride())} for shape {tuple(cache.shape)}); unset it for this attention backend"
        ) from error


def node_chains(
    node_mask: torch.Tensor,  # [T, N, N] node i may attend node j (ancestors have lower indices)
    num_nodes: torch.Tensor,  # [T]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each tree split into chains: a chain starts at the root or at a node that is not its parent's first (lowest
    index) child and runs through first children, so it is the tail of its last node's path. Returns
    (chain [T, N]: each node's chain, numbered by their first nodes' order; place [T, N]: its place along the chain;
    length [T, C = N]: each chain's number of nodes, 0 past the request's last chain; last [T, C]: each chain's last
    node, 0 past the last chain). Entries past a request's last node are in chain 0 at place 0 (never read)."""
    num_trees, width = node_mask.shape[:2]
    device = node_mask.device
    index = torch.arange(width, device=device)
    valid = index[None, :] < num_nodes[:, None]  # [T, N]
    mask = node_mask.bool() & valid[:, :, None] & valid[:, None, :]
    strict = mask & (index[None, None, :] < index[None, :, None])  # [T, N, N] strict ancestors
    parent = (strict * (index + 1)).amax(-1) - 1  # [T, N] the deepest strict ancestor, -1 for the root
    is_child = (parent[:, :, None] == index) & valid[:, :, None]  # [T, N(child), N(parent)]
    first_child = torch.where(is_child, index[None, :, None], width).amin(1)  # [T, N(parent)]
    continues = (parent >= 0) & (first_child.gather(1, parent.clamp(min=0)) == index)  # [T, N]
    head = valid & ~continues  # [T, N] nodes that start a chain
    head_rank = head.cumsum(-1) - 1  # [T, N]
    chain_head = ((mask & head[:, None, :]) * (index + 1)).amax(-1).clamp(min=1) - 1  # [T, N] nearest head on the path
    chain = torch.where(valid, head_rank.gather(1, chain_head), 0)
    depth = mask.sum(-1)  # [T, N] depth + 1 (0 for entries past the last node)
    place = torch.where(valid, depth - depth.gather(1, chain_head), 0)
    member = (chain[:, :, None] == index) & valid[:, :, None]  # [T, N(node), C]
    length = member.sum(1)  # [T, C]
    last = (member * (index + 1)[None, :, None]).amax(1).clamp(min=1) - 1  # [T, C] (ancestors before descendants)
    return chain, place, length, last


@dataclass
class PerPathCalls:
    """A step's FA3 calls (built once per step, on the device), for the KV page size and mode they were built for."""

    page: int
    mode: str
    rows: torch.Tensor  # [T * N] scheduled-token row of each entry of the node grid (aliased as in `node_aliases`)
    gather: torch.Tensor  # [C, Q] per call, the query rows of its packed sequences
    cu_seqlens: torch.Tensor | None  # [C, S + 1] per call, its sequences' query starts (None: one query each)
    slots: torch.Tensor  # [C, S, K] per call, its sequences' key slots
    lengths: torch.Tensor  # [C, S] per call, its sequences' key counts
    owner: torch.Tensor  # [T * N] each entry's row among the calls' stacked outputs [C * Q]
    max_seqlen_q: int


def _calls(tree, mode: str, page: int, width: int, fixed_shapes: bool) -> PerPathCalls:
    """The step's calls in `mode`. K is the block table's width in keys under CUDA-graph capture (`fixed_shapes`),
    else only what the step's longest sequence needs."""
    num_trees = tree.num_nodes.shape[0]
    req, node = node_aliases(tree.num_nodes, width)  # [T, N]
    rows = tree.query_start.to(torch.int64)[req] + node  # [T, N]
    block_table = tree.block_table if fixed_shapes else tree.block_table[:, : -(-tree.max_seq_len // page)]

    def key_slots(entries):  # [A * B, K], [A * B] for entries [A, B]
        return node_key_slots(block_table, tree.seq_lens, tree.num_nodes, tree.node_mask, page, entries)

    if mode == "1":  # one call, every entry a sequence of one query (aliased entries: equal inputs, equal outputs)
        slots, lengths = key_slots((req, node))
        owner = torch.arange(num_trees * width, device=rows.device)
        return PerPathCalls(page, mode, rows.view(-1), rows.view(1, -1), None, slots[None], lengths[None], owner, 1)
    if mode == "decode":  # call k: node k of every request (its alias past the last node), one query each
        slots, lengths = key_slots((req.t(), node.t()))  # call-major: [N * T, K]
        owner = node * num_trees + req  # [T, N] an alias's own call: calls may round differently
        return PerPathCalls(page, mode, rows.view(-1), rows.t().contiguous(), None, slots.view(width, num_trees, -1),
                            lengths.view(width, num_trees), owner.view(-1), 1)  # fmt: skip
    # chains: call c holds chain c of every request, packed one after another, each at most `max_len` nodes, over
    # the keys of the chain's last node
    depth = tree.depth if getattr(tree, "depth", None) is not None else width - 1
    max_len = min(width, depth + 1)
    chain, place, length, last = node_chains(tree.node_mask, tree.num_nodes)
    per_call = num_trees * max_len
    ends = length.t().cumsum(-1)  # [C, T]
    cu_seqlens = torch.cat([ends.new_zeros(width, 1), ends], -1).to(torch.int32)  # [C, T + 1]
    packed = (ends - length.t()).t().gather(1, chain) + place  # [T, N] each node's row within its call
    entry_chain, entry_packed = chain[req, node], packed[req, node]  # aliases: the alias's place
    owner = entry_chain * per_call + entry_packed  # [T, N]
    gather = rows[0, 0].expand(width * per_call).clone()  # unused rows past a call's last sequence: a valid row
    gather.scatter_(0, owner.view(-1), rows.view(-1))
    requests = torch.arange(num_trees, device=rows.device)[None, :].expand(width, -1)  # [C, T]
    slots, lengths = key_slots((requests, last.t()))  # [C * T, K]: each chain's last node
    return PerPathCalls(page, mode, rows.view(-1), gather.view(width, per_call), cu_seqlens,
                        slots.view(width, num_trees, -1), lengths.view(width, num_trees), owner.view(-1), max_len)


def per_path_attention_(query, kv: PagedKV, tree, scale: float, out: torch.Tensor, attend) -> None:
    """Overwrite the tree rows of `out` [num_tokens, Hq, D] with per-path attention, the calls of `per_path_mode`.
    `attend(q [R, Hq, D], kv, slots [S, K], lengths [S], scale, max_len, cu_seqlens_q [S + 1] or None, max_seqlen_q)`
    -> [R, Hq, D] is FA3 on CUDA (`fa3_attend`) or `reference_attend` (the CPU build, and the tests); `max_len` is
    the step's longest sequence (host)."""
    width, page, mode = tree.node_mask.shape[1], kv.block_size, per_path_mode()
    # Eager steps build the calls at their first layer and the others reuse them. Under CUDA-graph capture every
    # layer builds its own: a graph must contain the build (a cached tensor from an eager warm-up run, or from
    # another graph, would never be rewritten when this graph replays).
    capturing = query.is_cuda and torch.cuda.is_current_stream_capturing()
    calls = None if capturing else getattr(tree, "per_path_calls", None)
    if calls is None or (calls.page, calls.mode) != (page, mode):
        calls = _calls(tree, mode, page, width, fixed_shapes=capturing)
        if not capturing:
            tree.per_path_calls = calls
    num_calls, per_call = calls.gather.shape
    results = query.new_empty((num_calls * per_call, *query.shape[1:]))  # [C * Q, Hq, D] the calls' outputs
    for c in range(num_calls):
        results[c * per_call : (c + 1) * per_call] = attend(
            query[calls.gather[c]], kv, calls.slots[c], calls.lengths[c], scale, tree.max_seq_len,
            None if calls.cu_seqlens is None else calls.cu_seqlens[c], calls.max_seqlen_q,
        )  # fmt: skip
    out[calls.rows] = results[calls.owner].to(out.dtype)


def fa3_attend(query, kv: PagedKV, slots, lengths, scale: float, max_len: int, cu_seqlens_q=None,
               max_seqlen_q: int = 1) -> torch.Tensor:  # fmt: skip
    """vLLM's FA3 over one-token pages with `slots` as the block table: sequence s has the queries
    cu_seqlens_q[s]:cu_seqlens_q[s + 1] (None: one each), causal (aligned to its last keys), over the keys
    slots[s, :lengths[s]]. FA3 splits each sequence's keys among thread blocks by a heuristic over the whole batch and
    `max_len` (the backend's own calls pass the step's longest sequence too), and the split changes the rounding:
    `VLLM_DDTREE_PER_PATH_SPLITS=n` fixes it (0, the default: FA3's choice)."""
    from vllm_ddtree.compat import flash_attn_varlen

    if cu_seqlens_q is None:
        cu_seqlens_q = torch.arange(query.shape[0] + 1, dtype=torch.int32, device=query.device)
    return flash_attn_varlen()(
        query, one_token_pages(kv.keys), one_token_pages(kv.values), max_seqlen_q=max_seqlen_q,
        cu_seqlens_q=cu_seqlens_q, max_seqlen_k=max_len, seqused_k=lengths, causal=True, block_table=slots,
        softmax_scale=scale, fa_version=3, num_splits=per_path_splits(),
    )  # fmt: skip


def per_path_splits() -> int:
    value = os.environ.get(SPLITS_ENV, "0").strip() or "0"
    if not value.isdigit():
        raise ValueError(f"{SPLITS_ENV}={value!r} is not a whole number >= 0 (0: FlashAttention-3 chooses)")
    return int(value)


def reference_attend(query, kv: PagedKV, slots, lengths, scale: float, max_len: int, cu_seqlens_q=None,
                     max_seqlen_q: int = 1) -> torch.Tensor:  # fmt: skip
    """`fa3_attend` in pure torch (float32), any KV layout. Rows past the last sequence's queries are left as zeros
    (FA3 leaves them unwritten; nothing reads them)."""
    from vllm_ddtree.attention.reference import masked_attention

    num_seqs = slots.shape[0]
    if cu_seqlens_q is None:
        cu_seqlens_q = torch.arange(num_seqs + 1, device=query.device)
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    for s in range(num_seqs):
        start, end, num_keys = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1]), int(lengths[s])
        if end - start > max_seqlen_q or num_keys > max_len:  # FA3 takes these as bounds
            raise ValueError(f"sequence {s}: {end - start} queries and {num_keys} keys, above max_seqlen_q "
                             f"{max_seqlen_q} or max_seqlen_k {max_len}")  # fmt: skip
        if end == start:
            continue
        keys, values = kv.read(slots[s, :num_keys].to(torch.int64))  # [n, Hkv, D]
        last_key = num_keys - (end - start) + torch.arange(end - start, device=query.device)  # causal, end-aligned
        mask = torch.arange(num_keys, device=query.device)[None, :] <= last_key[:, None]
        out[start:end] = masked_attention(query[start:end], keys, values, mask, scale)
    return out

"""The FULL-CUDA-graph layout of the tree metadata (`PersistentTreeBuffers`): the same trees as the regular
build, at fixed addresses, padded to the backend's request count with 0-node requests."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_ddtree.attention.metadata import PersistentTreeBuffers, TreeAttentionMetadataBuilder, dummy_tree_step
from vllm_ddtree.tree import build_draft_tree
from vllm_ddtree.verify.step import build_tree_step

WIDTH, MAX_REQS = 6, 8  # budget 5


def uniform_step(num_reqs: int, seed: int, num_nodes: int = WIDTH):
    """A verification step where every request has the first `num_nodes` nodes of a tree of WIDTH nodes (a
    uniform batch; fewer than WIDTH under `num_speculative_tokens_per_batch_size`)."""
    gen = torch.Generator().manual_seed(seed)
    tree = build_draft_tree(torch.randn(num_reqs, 4, 50, generator=gen), torch.zeros(num_reqs, dtype=torch.long),
                            budget=WIDTH - 1)
    logits_indices = torch.arange(num_reqs * num_nodes)
    return build_tree_step([num_nodes - 1] * num_reqs, logits_indices, tree.parents, tree.depths,
                           list(range(num_reqs)), WIDTH)  # fmt: skip


def backend_metadata(num_reqs: int, padded: int, seed: int, num_nodes: int = WIDTH):
    """FA3-like metadata over `padded` request slots (vLLM pads seq_lens with 0 and query starts with the end)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = torch.zeros(padded, dtype=torch.int32)
    seq_lens[:num_reqs] = torch.randint(WIDTH, 100, (num_reqs,), generator=gen, dtype=torch.int32)
    query_start_loc = torch.full((padded + 1,), num_reqs * num_nodes, dtype=torch.int32)
    query_start_loc[: num_reqs + 1] = torch.arange(num_reqs + 1, dtype=torch.int32) * num_nodes
    return SimpleNamespace(seq_lens=seq_lens, query_start_loc=query_start_loc, max_seq_len=int(seq_lens.max()),
                           block_table=torch.randint(0, 50, (padded, 7), generator=gen, dtype=torch.int32))


@pytest.mark.parametrize("num_nodes", [WIDTH, 3])
def test_persistent_build_matches_the_regular_one_at_fixed_addresses(num_nodes):
    regular = TreeAttentionMetadataBuilder(set())
    persistent = TreeAttentionMetadataBuilder(set(), PersistentTreeBuffers.allocate(MAX_REQS, WIDTH, torch.device("cpu")))
    addresses = set()
    for seed, (num_reqs, padded) in enumerate([(3, 4), (5, 8), (2, 2)]):
        step, backend = uniform_step(num_reqs, seed, num_nodes), backend_metadata(num_reqs, padded, seed, num_nodes)
        want, got = regular.build(step, backend), persistent.build(step, backend)
        assert got.covers_all_tokens and got.node_mask.shape == (padded, WIDTH, WIDTH)
        assert torch.equal(got.node_mask[:num_reqs].bool(), want.node_mask)
        assert not got.node_mask[num_reqs:].any() and not got.num_nodes[num_reqs:].any()
        assert torch.equal(got.num_nodes[:num_reqs].long(), want.num_nodes)
        assert torch.equal(got.context_lens[:num_reqs], want.context_lens)
        assert not got.context_lens[num_reqs:].any()
        assert torch.equal(got.query_start[:num_reqs].long(), want.query_start)
        assert got.num_nodes_cpu == want.num_nodes_cpu + [0] * (padded - num_reqs)
        # vLLM's persistent tensors are used as they are; the tree's own inputs stay in the buffers.
        assert got.query_start.data_ptr() == backend.query_start_loc.data_ptr()
        assert got.block_table is backend.block_table and got.seq_lens is backend.seq_lens
        addresses.add((got.node_mask.data_ptr(), got.num_nodes.data_ptr(), got.context_lens.data_ptr()))
    assert len(addresses) == 1


@pytest.mark.parametrize("num_nodes", [WIDTH, 3])
def test_prefill_chunks_of_a_uniform_batch_are_chains_in_the_persistent_buffers(num_nodes):
    """vLLM replays the FULL graph of n-token requests for any batch whose requests all have n scheduled tokens,
    so a prefill chunk of n tokens beside n-node trees must be in the persistent buffers too: a chain of n nodes
    (its mask causal, its context the keys before the chunk), the trees as they are. Without `uniform` (a
    batch no FULL graph serves) the regular metadata covers the trees only."""
    from vllm_ddtree.attention.metadata import uniform_nodes

    num_reqs, padded = 3, 4
    trees = uniform_step(num_reqs, 7, num_nodes)
    logits_indices = torch.cat([torch.arange(num_nodes), torch.tensor([2 * num_nodes - 1]),
                                torch.arange(2 * num_nodes, 3 * num_nodes)])  # the chunk has one logits row
    step = build_tree_step([num_nodes - 1, 0, num_nodes - 1], logits_indices, trees.parents, trees.depths, [0, -1, 2],
                           WIDTH)  # fmt: skip
    backend = backend_metadata(num_reqs, padded, 7, num_nodes)
    assert uniform_nodes(num_reqs, num_reqs * num_nodes, num_nodes, WIDTH) == num_nodes
    assert uniform_nodes(num_reqs, num_reqs * num_nodes - 1, num_nodes, WIDTH) is None
    assert uniform_nodes(num_reqs, num_reqs * (WIDTH + 1), WIDTH + 1, WIDTH) is None  # longer than any tree
    builder = TreeAttentionMetadataBuilder(set(), PersistentTreeBuffers.allocate(MAX_REQS, WIDTH, torch.device("cpu")))
    got = builder.build(step, backend, uniform=num_nodes)
    assert got.covers_all_tokens and got.node_mask.data_ptr() == builder.persistent.node_mask.data_ptr()
    assert torch.equal(got.node_mask[1].bool(), torch.ones(WIDTH, WIDTH).tril().bool())  # the chunk: causal
    want = TreeAttentionMetadataBuilder(set()).build(trees, backend)  # the trees alone
    for req in (0, 2):
        assert torch.equal(got.node_mask[req].bool(), want.node_mask[req])
    assert got.num_nodes.tolist() == [num_nodes] * num_reqs + [0] and got.num_nodes_cpu == got.num_nodes.tolist()
    assert torch.equal(got.context_lens, backend.seq_lens - got.num_nodes)
    regular = builder.build(step, backend)  # no FULL graph for this batch
    assert not regular.covers_all_tokens and regular.num_nodes_cpu == [num_nodes, num_nodes]


@pytest.mark.parametrize("num_nodes", [WIDTH, 2])
def test_dummy_step_is_a_chain_per_request(num_nodes):
    """The capture layout of a uniform batch of `num_nodes` tokens per request, padded to WIDTH."""
    step = dummy_tree_step(3, num_nodes, WIDTH, torch.device("cpu"))
    assert step.num_nodes.tolist() == [num_nodes] * 3 and step.tree_reqs_cpu.tolist() == [0, 1, 2]
    assert step.parents.shape == (3, WIDTH)
    assert step.parents[:, :num_nodes].tolist() == [list(range(-1, num_nodes - 1))] * 3
    assert step.node_token_index.tolist() == [[r * num_nodes + min(i, num_nodes - 1) for i in range(WIDTH)]
                                              for r in range(3)]  # fmt: skip


def test_backend_rows_option_fills_its_persistent_buffers(monkeypatch):
    """VLLM_DDTREE_BACKEND_ROWS=1: the kept rows come from fixed-address buffers in FULL-graph steps, equal to the
    regular build's for the real requests; padding requests alias request 0's root."""
    monkeypatch.setenv("VLLM_DDTREE_BACKEND_ROWS", "1")
    regular = TreeAttentionMetadataBuilder(set())
    buffers = PersistentTreeBuffers.allocate(MAX_REQS, WIDTH, torch.device("cpu"))
    persistent = TreeAttentionMetadataBuilder(set(), buffers)
    for seed, (num_reqs, padded) in enumerate([(3, 4), (5, 8)]):
        step, backend = uniform_step(num_reqs, seed), backend_metadata(num_reqs, padded, seed)
        want_rows, want_keep = regular.build(step, backend).backend_rows
        rows, keep = persistent.build(step, backend).backend_rows
        assert rows.data_ptr() == buffers.backend_rows.data_ptr()
        assert keep.data_ptr() == buffers.backend_keep.data_ptr()
        assert torch.equal(rows[:num_reqs], want_rows) and torch.equal(keep[:num_reqs], want_keep)
        assert (rows[num_reqs:] == 0).all()
        assert torch.equal(keep[num_reqs:], keep[:1, :1].expand(padded - num_reqs, WIDTH))
        assert keep[:num_reqs, 0].all()  # every root row keeps the backend's output
    monkeypatch.delenv("VLLM_DDTREE_BACKEND_ROWS")
    assert persistent.build(step, backend).backend_rows is None  # off by default

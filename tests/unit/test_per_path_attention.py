"""Per-path tree verification (`attention/per_path.py`, VLLM_DDTREE_PER_PATH_ATTENTION=1): every node's key slots
against brute force, and the whole path with a pure-torch stand-in for FA3 against the tree attention reference,
on random trees whose budgets differ from the KV page size (1, 7, 20 and 33 drafts with pages of 16 and 4)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.gpu.cases import as_persistent_layout, make_case, tree_depth
from vllm_ddtree.attention.per_path import (
    PER_PATH_ENV,
    SPLITS_ENV,
    node_chains,
    node_key_slots,
    one_token_pages,
    per_path_attention_,
    per_path_requested,
    per_path_splits,
    reference_attend,
)
from vllm_ddtree.attention.reference import tree_attention_reference_

CASES = [(3, 1, 20, 16), (4, 7, 40, 16), (2, 20, 35, 16), (3, 33, 10, 4), (1, 7, 0, 4)]  # (trees, B, context, page)


def path_of(node_mask: torch.Tensor, i: int) -> list[int]:
    return [j for j in range(node_mask.shape[-1]) if node_mask[i, j]]


@pytest.mark.parametrize("padding", [0, 2], ids=["eager_layout", "graph_layout"])
@pytest.mark.parametrize("num_trees,budget,context,page", CASES)
def test_every_node_names_its_context_and_its_path_in_order(num_trees, budget, context, page, padding):
    case = make_case(num_trees, budget, context, 4, 2, 8, torch.float32, "cpu", page=page, seed=budget + page)
    tree = as_persistent_layout(case.tree, padding) if padding else case.tree
    slots, lengths = node_key_slots(tree.block_table, tree.seq_lens, tree.num_nodes, tree.node_mask, page)
    width = budget + 1
    assert slots.shape == (len(tree.num_nodes_cpu) * width, tree.block_table.shape[1] * page)
    grid_slots, grid_lengths = slots.view(-1, width, slots.shape[1]), lengths.view(-1, width)
    for t, num_nodes in enumerate(tree.num_nodes_cpu):
        context_len = int(tree.seq_lens[t]) - num_nodes
        for i in range(width):
            if i >= num_nodes:  # an alias of the request's last node, or of request 0's root for padding requests
                alias = (t, num_nodes - 1) if num_nodes else (0, 0)
                n = int(grid_lengths[alias])
                assert int(grid_lengths[t, i]) == n and torch.equal(grid_slots[t, i, :n], grid_slots[alias][:n])
                continue
            positions = list(range(context_len)) + [context_len + j for j in path_of(tree.node_mask[t], i)]
            expected = [int(tree.block_table[t, p // page]) * page + p % page for p in positions]
            assert int(grid_lengths[t, i]) == len(expected)
            assert grid_slots[t, i, : len(expected)].tolist() == expected, (t, i)


def case_with_reference(num_trees: int, budget: int, context: int, page: int, padding: int, seed: int):
    """(case, its trees with their own depth bound in the eager or the CUDA-graph layout, the reference output)."""
    import dataclasses

    case = make_case(num_trees, budget, context, 4, 2, 8, torch.float32, "cpu", page=page, seed=seed)
    expected = torch.full_like(case.query, float("nan"))
    tree_attention_reference_(case.query, case.kv, case.tree, case.scale, expected)
    tree = dataclasses.replace(case.tree, depth=tree_depth(case.tree))  # chains of at most depth + 1 nodes
    return case, as_persistent_layout(tree, padding) if padding else tree, expected


@pytest.mark.parametrize("mode", ["1", "decode", "chains"])
@pytest.mark.parametrize("padding", [0, 2], ids=["eager_layout", "graph_layout"])
@pytest.mark.parametrize("num_trees,budget,context,page", CASES)
def test_per_path_attention_is_tree_attention(num_trees, budget, context, page, padding, mode, monkeypatch):
    """With the pure-torch stand-in for FA3, every tree row equals the reference's and no other row is written, in
    each way of making the calls; chains with the trees' own depth bound (chains of at most depth + 1 nodes)."""
    monkeypatch.setenv(PER_PATH_ENV, mode)
    case, tree, expected = case_with_reference(num_trees, budget, context, page, padding, seed=3 * budget + page)
    out = torch.full_like(case.query, float("nan"))  # poisoned: every tree row must be written, no other row
    per_path_attention_(case.query, case.kv, tree, case.scale, out, reference_attend)
    rows = case.tree_rows
    assert torch.isnan(out[~rows]).all()
    torch.testing.assert_close(out[rows], expected[rows], rtol=1e-5, atol=1e-6)
    cached = tree.per_path_calls  # the next layer of the step reuses the calls
    per_path_attention_(case.query, case.kv, tree, case.scale, out, reference_attend)
    assert tree.per_path_calls is cached


@pytest.mark.parametrize("mode", ["1", "decode", "chains"])
def test_key_slots_cover_the_steps_longest_sequence_not_the_block_tables_width(mode, monkeypatch):
    """vLLM's block table is max_model_len wide; an eager step's key slots need only its longest sequence (the
    table per step is [T x (B + 1), K] int32), while a CUDA graph keeps the table's width (fixed shapes)."""
    import dataclasses

    monkeypatch.setenv(PER_PATH_ENV, mode)
    case, tree, expected = case_with_reference(3, 20, 40, 16, 0, seed=11)
    wide = torch.cat([tree.block_table, tree.block_table.new_zeros(tree.block_table.shape[0], 30)], dim=1)
    tree = dataclasses.replace(tree, block_table=wide)
    out = torch.full_like(case.query, float("nan"))
    per_path_attention_(case.query, case.kv, tree, case.scale, out, reference_attend)
    torch.testing.assert_close(out[case.tree_rows], expected[case.tree_rows], rtol=1e-5, atol=1e-6)
    slots = tree.per_path_calls.slots  # [C, S, K]
    assert slots.shape[-1] == -(-tree.max_seq_len // 16) * 16 < wide.shape[1] * 16


def brute_force_chains(node_mask: torch.Tensor, num_nodes: int) -> list[list[int]]:
    """A tree's chains, each a list of nodes, in the order of their first nodes."""
    parent = {i: max((j for j in range(i) if node_mask[i, j]), default=-1) for i in range(num_nodes)}
    children = {p: sorted(i for i in range(num_nodes) if parent[i] == p) for p in range(num_nodes)}
    chains = []
    for head in range(num_nodes):
        if parent[head] >= 0 and children[parent[head]][0] == head:
            continue  # its parent's first child: on its parent's chain
        chain = [head]
        while children[chain[-1]]:
            chain.append(children[chain[-1]][0])
        chains.append(chain)
    return chains


@pytest.mark.parametrize("num_trees,budget", [(4, 1), (3, 7), (5, 20), (2, 64)])
def test_node_chains_against_brute_force(num_trees, budget):
    case = make_case(num_trees, budget, 0, 2, 1, 8, torch.float32, "cpu", seed=budget)
    tree = as_persistent_layout(case.tree, 2)
    chain, place, length, last = node_chains(tree.node_mask, tree.num_nodes)
    width = budget + 1
    for t, num_nodes in enumerate(tree.num_nodes_cpu):
        chains = brute_force_chains(tree.node_mask[t].bool(), num_nodes)
        assert length[t].tolist() == [len(c) for c in chains] + [0] * (width - len(chains))
        assert last[t].tolist() == [c[-1] for c in chains] + [0] * (width - len(chains))
        for c, nodes in enumerate(chains):
            path = path_of(tree.node_mask[t], nodes[-1])
            assert path[len(path) - len(nodes) :] == nodes  # the tail of its last node's path
            for k, i in enumerate(nodes):
                assert (int(chain[t, i]), int(place[t, i])) == (c, k)
        assert chain[t, num_nodes:].eq(0).all() and place[t, num_nodes:].eq(0).all()


@pytest.mark.parametrize("mode", ["decode", "chains"])
@pytest.mark.parametrize("padding", [0, 2], ids=["eager_layout", "graph_layout"])
@pytest.mark.parametrize("num_trees,budget,context,page", CASES)
def test_every_row_keeps_its_own_call(num_trees, budget, context, page, padding, mode, monkeypatch):
    """decode and chains make one call per node or chain index, each a batch of one sequence per request (as a
    decoding step or vLLM's chain verification), and a node's row holds the result of its own call, never an
    alias's from another call (a stand-in adds its call's index: calls may round differently on the GPU)."""
    monkeypatch.setenv(PER_PATH_ENV, mode)
    case, tree, expected = case_with_reference(num_trees, budget, context, page, padding, seed=5 * budget + page)
    sequences = []

    def call_marked(query, kv, slots, lengths, scale, max_len, cu_seqlens_q, max_seqlen_q):
        sequences.append(slots.shape[0])
        out = reference_attend(query, kv, slots, lengths, scale, max_len, cu_seqlens_q, max_seqlen_q)
        return out + len(sequences) - 1

    out = torch.full_like(case.query, float("nan"))
    per_path_attention_(case.query, case.kv, tree, case.scale, out, call_marked)
    assert sequences == [len(tree.num_nodes_cpu)] * (budget + 1)
    chain = node_chains(tree.node_mask, tree.num_nodes)[0]
    for t, num_nodes in enumerate(case.tree.num_nodes_cpu):
        start = int(case.tree.query_start[t])
        for k in range(num_nodes):
            call = k if mode == "decode" else int(chain[t, k])
            torch.testing.assert_close(out[start + k], expected[start + k] + call, rtol=1e-5, atol=1e-5)


def test_one_token_pages_share_the_cache_and_refuse_other_layouts():
    cache = torch.randn(5, 16, 2, 2 * 8)[..., :8]  # [blocks, page, H, D], a slice as vLLM's packed layout gives
    pages = one_token_pages(cache)
    assert pages.shape == (80, 1, 2, 8) and pages.data_ptr() == cache.data_ptr()
    assert torch.equal(pages[3 * 16 + 5, 0], cache[3, 5])
    with pytest.raises(NotImplementedError, match=PER_PATH_ENV):
        one_token_pages(torch.randn(16, 5, 2, 8).transpose(0, 1))  # slots of a block are not one run


def test_the_switch_is_validated_and_applies_to_fa3_in_16_bit_only(monkeypatch):
    from vllm_ddtree.attention.layers import _per_path_applies

    fa3, other = SimpleNamespace(vllm_flash_attn_version=3), SimpleNamespace()
    bf16, fp32 = torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1)
    monkeypatch.delenv(PER_PATH_ENV, raising=False)
    assert not per_path_requested() and not _per_path_applies(fa3, bf16)
    monkeypatch.setenv(PER_PATH_ENV, "1")
    assert _per_path_applies(fa3, bf16) and _per_path_applies(other, fp32)  # on the CPU: the torch stand-in
    if torch.cuda.is_available():
        cuda = dict(device="cuda")
        assert not _per_path_applies(fa3, fp32.to(**cuda)) and not _per_path_applies(other, bf16.to(**cuda))
    for mode in ("decode", "chains"):
        monkeypatch.setenv(PER_PATH_ENV, mode)
        assert per_path_requested() and _per_path_applies(fa3, bf16)
    monkeypatch.setenv(PER_PATH_ENV, "yes")
    with pytest.raises(ValueError, match=f"{PER_PATH_ENV}='yes'"):
        per_path_requested()
    monkeypatch.delenv(SPLITS_ENV, raising=False)
    assert per_path_splits() == 0
    monkeypatch.setenv(SPLITS_ENV, "4")
    assert per_path_splits() == 4
    monkeypatch.setenv(SPLITS_ENV, "-1")
    with pytest.raises(ValueError, match=f"{SPLITS_ENV}='-1'"):
        per_path_splits()

"""Per-path tree verification (`attention/per_path.py`, VLLM_DDTREE_PER_PATH_ATTENTION=1): every node's key slots
against brute force, and the whole path with a pure-torch stand-in for FA3 against the tree attention reference,
on random trees whose budgets differ from the KV page size (1, 7, 20 and 33 drafts with pages of 16 and 4)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.gpu.cases import as_persistent_layout, make_case
from vllm_ddtree.attention.per_path import (
    PER_PATH_ENV,
    SPLITS_ENV,
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


@pytest.mark.parametrize("mode", ["1", "decode"])
@pytest.mark.parametrize("padding", [0, 2], ids=["eager_layout", "graph_layout"])
@pytest.mark.parametrize("num_trees,budget,context,page", CASES)
def test_per_path_attention_is_tree_attention(num_trees, budget, context, page, padding, mode, monkeypatch):
    """With the pure-torch stand-in for FA3, every tree row equals the reference's and no other row is written,
    with all nodes in one call (1) or one call per node index (decode)."""
    monkeypatch.setenv(PER_PATH_ENV, mode)
    case = make_case(num_trees, budget, context, 4, 2, 8, torch.float32, "cpu", page=page, seed=3 * budget + page)
    expected = torch.full_like(case.query, float("nan"))
    tree_attention_reference_(case.query, case.kv, case.tree, case.scale, expected)
    tree = as_persistent_layout(case.tree, padding) if padding else case.tree
    out = torch.full_like(case.query, float("nan"))  # poisoned: every tree row must be written, no other row
    per_path_attention_(case.query, case.kv, tree, case.scale, out, reference_attend)
    rows = case.tree_rows
    assert torch.isnan(out[~rows]).all()
    torch.testing.assert_close(out[rows], expected[rows], rtol=1e-5, atol=1e-6)
    cached = tree.per_path_slots  # the next layer of the step reuses the slots
    per_path_attention_(case.query, case.kv, tree, case.scale, out, reference_attend)
    assert tree.per_path_slots is cached


@pytest.mark.parametrize("padding", [0, 2], ids=["eager_layout", "graph_layout"])
@pytest.mark.parametrize("num_trees,budget,context,page", CASES)
def test_decode_mode_calls_once_per_node_index_and_rows_keep_their_own_call(num_trees, budget, context, page,
                                                                          padding, monkeypatch):  # fmt: skip
    """decode: call k is a batch of one query per request (as a decoding step), and a node's row holds the result
    of its own call, never an alias's from another call (a stand-in adds its call's index: calls may round
    differently on the GPU)."""
    monkeypatch.setenv(PER_PATH_ENV, "decode")
    case = make_case(num_trees, budget, context, 4, 2, 8, torch.float32, "cpu", page=page, seed=5 * budget + page)
    expected = torch.full_like(case.query, float("nan"))
    tree_attention_reference_(case.query, case.kv, case.tree, case.scale, expected)
    tree = as_persistent_layout(case.tree, padding) if padding else case.tree
    batches = []

    def call_marked(query, kv, slots, lengths, scale, max_len):
        batches.append(query.shape[0])
        return reference_attend(query, kv, slots, lengths, scale, max_len) + len(batches) - 1

    out = torch.full_like(case.query, float("nan"))
    per_path_attention_(case.query, case.kv, tree, case.scale, out, call_marked)
    assert batches == [len(tree.num_nodes_cpu)] * (budget + 1)
    for t, num_nodes in enumerate(case.tree.num_nodes_cpu):
        start = int(case.tree.query_start[t])
        for k in range(num_nodes):
            torch.testing.assert_close(out[start + k], expected[start + k] + k, rtol=1e-5, atol=1e-5)


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
    monkeypatch.setenv(PER_PATH_ENV, "decode")
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

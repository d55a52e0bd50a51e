"""`attention.metadata.backend_rows` (VLLM_DDTREE_BACKEND_ROWS=1): which tree rows may keep the attention backend's
causal output, and where each row lives among the scheduled tokens; checked against brute force on random trees."""

import random

import torch

from vllm_ddtree.attention.metadata import backend_rows
from vllm_ddtree.attention.reference import masked_attention, tree_attention_mask
from vllm_ddtree.tree import ancestor_mask


def random_trees(rng: random.Random, num_trees: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """parents [T, N] (parents[i] < i, with a leading chain of random length) and num_nodes [T] (0: padding)."""
    parents = torch.full((num_trees, width), -1, dtype=torch.int64)
    num_nodes = torch.zeros(num_trees, dtype=torch.int64)
    for t in range(num_trees):
        num_nodes[t] = 0 if t > 0 and rng.random() < 0.25 else rng.randint(1, width)
        chain = rng.randint(1, width)
        for i in range(1, width):
            parents[t, i] = i - 1 if i < chain else rng.randrange(i)
    return parents, num_nodes


def ancestors(parents: torch.Tensor, t: int, i: int) -> set[int]:
    seen = {i}
    while parents[t, i] >= 0:
        i = int(parents[t, i])
        seen.add(i)
    return seen


def test_kept_rows_are_exactly_the_nodes_whose_ancestors_are_the_nodes_before_them():
    rng = random.Random(0)
    for _ in range(50):
        num_trees, width = rng.randint(1, 5), rng.randint(1, 12)
        parents, num_nodes = random_trees(rng, num_trees, width)
        query_start = torch.tensor([rng.randrange(100) for _ in range(num_trees)])
        rows, keep = backend_rows(ancestor_mask(parents), num_nodes, query_start)
        assert rows.shape == keep.shape == (num_trees, width)
        for t in range(num_trees):
            n = int(num_nodes[t])
            for i in range(width):
                if i < n:
                    assert bool(keep[t, i]) == (ancestors(parents, t, i) == set(range(i + 1))), (t, i)
                    assert int(rows[t, i]) == int(query_start[t]) + i
                else:  # aliases a real entry: the same row with the same keep
                    alias = (t, n - 1) if n else (0, 0)
                    assert int(rows[t, i]) == int(query_start[alias[0]]) + alias[1]
                    assert bool(keep[t, i]) == bool(keep[alias])
        assert bool(keep[0, 0]) == (int(num_nodes[0]) > 0)  # the root row is always kept


def test_gather_scatter_with_kept_rows_gives_backend_rows_and_tree_rows():
    """The attention wrapper's sequence (layers.wrap_tree_attention): save the backend's rows, run tree attention,
    put the kept rows back. Kept rows equal causal attention, which equals tree attention there."""
    rng = random.Random(1)
    heads, kv_heads, dim, context = 4, 2, 8, 5
    parents, num_nodes = random_trees(rng, 3, 6)
    num_nodes[num_nodes == 0] = 6
    mask = ancestor_mask(parents)
    starts = torch.cumsum(num_nodes, 0) - num_nodes
    total = int(num_nodes.sum())
    query = torch.randn(total, heads, dim, dtype=torch.float64)
    keys = [torch.randn(context + int(n), kv_heads, dim, dtype=torch.float64) for n in num_nodes]
    values = [torch.randn_like(k) for k in keys]
    causal_out = torch.empty(total, heads, dim, dtype=torch.float64)
    tree_out = torch.empty_like(causal_out)
    for t, n in enumerate(num_nodes.tolist()):
        s = int(starts[t])
        causal = tree_attention_mask(torch.ones(n, n).tril().bool(), context)
        tree = tree_attention_mask(mask[t, :n, :n], context)
        causal_out[s : s + n] = masked_attention(query[s : s + n], keys[t], values[t], causal, 1.0).double()
        tree_out[s : s + n] = masked_attention(query[s : s + n], keys[t], values[t], tree, 1.0).double()
    rows, keep = backend_rows(mask, num_nodes, starts)
    out = causal_out.clone()  # what the backend wrote
    saved = out[rows]
    out.copy_(tree_out)  # what the tree attention wrote over it
    out[rows] = torch.where(keep[:, :, None, None], saved, out[rows])
    assert torch.allclose(out, tree_out, rtol=0, atol=1e-12)  # kept rows: causal == tree attention there
    kept = rows[keep]
    assert torch.equal(out[kept], causal_out[kept])  # and they hold the backend's values themselves
    assert kept.numel() >= 3  # every root at least

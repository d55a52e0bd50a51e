"""walk_tree against the plain sequential walk, on random trees and on trees from build_draft_tree."""

import random

import pytest
import torch

import tree_oracle as oracle
from vllm_ddtree.tree import WalkResult, build_draft_tree, depths_from_parents, walk_tree


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def random_tree(rng: random.Random, n: int, max_depth: int, vocab: int) -> tuple[list[int], list[int]]:
    """Topologically ordered random tree with distinct sibling tokens: (token_ids, parents)."""
    tokens, parents, depth, child_tokens = [rng.randrange(vocab)], [-1], [0], {0: set()}
    for i in range(1, n):
        candidates = [u for u in range(i) if depth[u] < max_depth and len(child_tokens[u]) < vocab]
        u = rng.choice(candidates)
        tok = rng.choice([t for t in range(vocab) if t not in child_tokens[u]])
        child_tokens[u].add(tok)
        child_tokens[i] = set()
        tokens.append(tok), parents.append(u), depth.append(depth[u] + 1)
    return tokens, parents


def biased_targets(rng: random.Random, tokens: list[int], parents: list[int], vocab: int, p_hit: float) -> list[int]:
    """Target choice per node: with probability p_hit the token of one of its children, else a random token."""
    children = {u: [tokens[j] for j in range(len(parents)) if parents[j] == u] for u in range(len(parents))}
    return [
        rng.choice(children[u]) if children[u] and rng.random() < p_hit else rng.randrange(vocab)
        for u in range(len(parents))
    ]


def check_walk(
    token_ids: torch.Tensor, parents: torch.Tensor, target: torch.Tensor, num_nodes: torch.Tensor, max_depth: int
) -> WalkResult:
    depths = depths_from_parents(parents)
    got = walk_tree(token_ids, parents, depths, target, num_nodes, max_depth)
    num_req = token_ids.shape[0]
    assert got.path_nodes.shape == got.output_token_ids.shape == (num_req, max_depth + 1)
    assert got.num_accepted.shape == (num_req,)
    for t in (got.path_nodes, got.num_accepted, got.output_token_ids):
        assert t.dtype == torch.int64
    for r in range(num_req):
        want = oracle.sequential_walk(token_ids[r].tolist(), parents[r].tolist(), target[r].tolist(), int(num_nodes[r]))
        pad = max_depth + 1 - len(want.path_nodes)
        assert got.path_nodes[r].tolist() == want.path_nodes + [-1] * pad
        assert got.num_accepted[r].item() == len(want.path_nodes) - 1
        assert got.output_token_ids[r].tolist() == want.output_token_ids + [-1] * pad
    return got


def stack(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


@pytest.mark.parametrize("num_req", [1, 3, 8])
@pytest.mark.parametrize("n", [1, 2, 3, 17, 64, 257])
@pytest.mark.parametrize("max_depth", [1, 2, 5, 16])
def test_random_trees_match_sequential_walk(num_req, n, max_depth):
    rng = random.Random(f"{num_req}-{n}-{max_depth}")
    vocab = 300  # >= n, so even a star tree has distinct sibling tokens
    trees = [random_tree(rng, n, max_depth, vocab) for _ in range(num_req)]
    tokens, parents = stack([t for t, _ in trees]), stack([p for _, p in trees])
    for p_hit in (0.0, 0.6, 0.95, 1.0):
        target = stack([biased_targets(rng, t, p, vocab, p_hit) for t, p in trees])
        full = torch.full((num_req,), n, dtype=torch.int64)
        truncated = torch.tensor([rng.randint(1, n) for _ in range(num_req)])
        for num_nodes in (full, truncated):
            check_walk(tokens, parents, target, num_nodes, max_depth)


def test_full_hit_chain_is_accepted_to_the_end():
    tokens, parents = stack([[9, 1, 2, 3]]), stack([[-1, 0, 1, 2]])
    target = stack([[1, 2, 3, 7]])
    got = check_walk(tokens, parents, target, torch.tensor([4]), 3)
    assert got.output_token_ids.tolist() == [[1, 2, 3, 7]]
    assert got.path_nodes.tolist() == [[0, 1, 2, 3]]
    got = check_walk(tokens, parents, target, torch.tensor([3]), 3)  # truncated: node 3 invalid
    assert got.output_token_ids.tolist() == [[1, 2, 3, -1]] and got.num_accepted.tolist() == [2]


def test_root_only():
    rng = random.Random(0)
    trees = [random_tree(rng, 9, 4, 20) for _ in range(3)]
    tokens, parents = stack([t for t, _ in trees]), stack([p for _, p in trees])
    target = stack([biased_targets(rng, t, p, 20, 1.0) for t, p in trees])
    got = check_walk(tokens, parents, target, torch.ones(3, dtype=torch.int64), 4)
    assert got.num_accepted.tolist() == [0, 0, 0]
    assert got.output_token_ids[:, 0].tolist() == target[:, 0].tolist()
    assert (got.output_token_ids[:, 1:] == -1).all() and (got.path_nodes[:, 1:] == -1).all()
    # a tree that is only its root
    got = check_walk(tokens[:, :1], parents[:, :1], target[:, :1], torch.ones(3, dtype=torch.int64), 4)
    assert got.output_token_ids[:, 0].tolist() == target[:, 0].tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_req", range(1, 9))
def test_walk_on_built_trees(dtype, num_req):
    """Builder + walk end to end, with different logits per request."""
    depth, vocab, budget = 6, 30, 48
    g = torch.Generator().manual_seed(num_req)
    logits = (torch.randn(num_req, depth, vocab, generator=g) * 3).to(dtype)
    tree = build_draft_tree(logits, torch.arange(num_req), budget)
    rng = random.Random(num_req)
    target = stack(
        [biased_targets(rng, tree.token_ids[r].tolist(), tree.parents[r].tolist(), vocab, 0.8) for r in range(num_req)]
    )
    num_nodes = torch.tensor([rng.randint(1, budget + 1) for _ in range(num_req)])
    for nn in (num_nodes, torch.full((num_req,), budget + 1)):
        got = walk_tree(tree.token_ids, tree.parents, tree.depths, target, nn, depth)
        check_walk(tree.token_ids, tree.parents, target, nn, depth)
        assert (got.num_accepted <= depth).all()
    # the target agreeing with the drafter's greedy chain accepts the whole depth
    greedy = logits.float().argmax(-1)  # [R, D]
    chain = build_draft_tree(logits, torch.arange(num_req), depth, max_topk=1)
    target = torch.cat([greedy, torch.full((num_req, 1), 5)], dim=1)
    got = check_walk(chain.token_ids, chain.parents, target, torch.full((num_req,), depth + 1), depth)
    assert (got.num_accepted == depth).all()

"""build_draft_tree and the layout helpers against brute-force enumeration and DDTree's sequential heap."""

import pytest
import torch

import tree_oracle as oracle
from vllm_ddtree.tree import DraftTree, ancestor_mask, build_draft_tree, depths_from_parents, max_tree_nodes


pytestmark = pytest.mark.usefixtures("one_cpu_thread")

BUDGETS = [1, 2, 3, 7, 8, 15, 16, 17, 31, 64, 255, 256]
MAX_ENUMERATED = 2000  # prefixes per request above which only the heap oracle runs


def random_logits(seed: int, shape: tuple[int, ...], scale: float = 3.0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def check_tree_shape(tree: DraftTree, root_ids: torch.Tensor, budget: int, depth: int) -> None:
    """Topological order, consistent depths, distinct siblings, root conventions."""
    num_req = root_ids.shape[0]
    for t in (tree.token_ids, tree.parents, tree.depths, tree.log_probs):
        assert t.shape == (num_req, budget + 1)
    assert tree.token_ids.dtype == tree.parents.dtype == tree.depths.dtype == torch.int64
    assert tree.log_probs.dtype == torch.float32
    assert torch.equal(tree.token_ids[:, 0], root_ids)
    assert (tree.parents[:, 0] == -1).all() and (tree.depths[:, 0] == 0).all() and (tree.log_probs[:, 0] == 0).all()
    idx = torch.arange(1, budget + 1)
    assert ((tree.parents[:, 1:] >= 0) & (tree.parents[:, 1:] < idx)).all(), "parents must precede children"
    assert torch.equal(tree.depths[:, 1:], tree.depths.gather(1, tree.parents[:, 1:]) + 1)
    assert ((tree.depths[:, 1:] >= 1) & (tree.depths[:, 1:] <= depth)).all()
    assert torch.equal(depths_from_parents(tree.parents), tree.depths)
    assert (tree.log_probs[:, 1:] <= tree.log_probs.gather(1, tree.parents[:, 1:])[:, :]).all()
    for r in range(num_req):
        pairs = list(zip(tree.parents[r, 1:].tolist(), tree.token_ids[r, 1:].tolist()))
        assert len(set(pairs)) == budget, "siblings must carry distinct tokens"


def tree_nodes(tree: DraftTree, r: int) -> list[oracle.OracleNode]:
    prefixes = oracle.tree_prefixes(tree.token_ids[r].tolist(), tree.parents[r].tolist())
    return [oracle.OracleNode(p, s) for p, s in zip(prefixes[1:], tree.log_probs[r, 1:].tolist())]


def check_against_oracles(logits: torch.Tensor, budget: int, max_topk: int | None = None) -> DraftTree:
    num_req, depth, vocab = logits.shape
    root_ids = torch.arange(num_req, dtype=torch.int64) + 11
    tree = build_draft_tree(logits, root_ids, budget, max_topk)
    check_tree_shape(tree, root_ids, budget, depth)
    k = min(budget, vocab, max_topk or budget)
    enumerable = max_tree_nodes(depth, vocab, max_topk, budget) <= MAX_ENUMERATED
    for r, ranked in enumerate(oracle.rank_vocab(logits)):
        got = tree_nodes(tree, r)
        # Same ordered list: the same node set, the same float32 scores, the same tie-break.
        assert got == oracle.heap_best(ranked, depth, k, budget), (r, budget, depth, vocab)
        if enumerable:
            assert got == oracle.enumerate_best(ranked, depth, k, budget)
    if budget <= 64:  # request 0 only; the layout tests below cover masks in depth
        assert ancestor_mask(tree.parents[:1])[0].tolist() == oracle.ancestors_mask(tree.parents[0].tolist())
    return tree


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("vocab", [2, 3, 4, 5, 6])
def test_small_vocab_matches_enumeration_and_heap(budget, vocab):
    smaller = BUDGETS[max(BUDGETS.index(budget) - 1, 0)]
    for depth in range(1, 17):
        available = max_tree_nodes(depth, vocab, None, budget)
        b = min(budget, available)
        if smaller < budget and min(smaller, available) == b:
            continue  # the cap makes this the same case as the next smaller budget
        logits = random_logits(1000 * budget + 100 * vocab + depth, (2, depth, vocab), scale=1.0 + depth % 3)
        check_against_oracles(logits, b)


@pytest.mark.parametrize("budget", BUDGETS)
def test_large_vocab_matches_heap(budget):
    for depth in [1, 2, 5, 16]:
        logits = random_logits(7 * budget + depth, (2, depth, 32000), scale=2.0 + depth % 4)
        check_against_oracles(logits, budget)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_top_k_restriction_loses_nothing(depth):
    """Enumerating over the whole vocabulary gives the same best prefixes as over the top-K (K = budget < V)."""
    vocab = 9
    logits = random_logits(depth, (3, depth, vocab))
    for budget in range(1, min(40, max_tree_nodes(depth, vocab, None, 10**9)) + 1):
        if budget >= vocab:
            break
        tree = build_draft_tree(logits, torch.zeros(3, dtype=torch.int64), budget)
        for r, ranked in enumerate(oracle.rank_vocab(logits)):
            assert tree_nodes(tree, r) == oracle.enumerate_best(ranked, depth, vocab, budget)


@pytest.mark.parametrize("max_topk", [1, 2, 3])
def test_max_topk(max_topk):
    for depth in [1, 2, 4, 6]:
        logits = random_logits(50 + depth, (3, depth, 6))
        available = max_tree_nodes(depth, 6, max_topk, 10**9)
        for budget in sorted({min(b, available) for b in (1, 2, 5, 17, 40)}):
            tree = check_against_oracles(logits, budget, max_topk)
            assert tree.token_ids.shape[1] == budget + 1


def test_batch_sizes_and_requests_independent():
    logits = random_logits(3, (8, 5, 40))
    full = build_draft_tree(logits, torch.arange(8), 31)
    for r in range(8):
        one = build_draft_tree(logits[r : r + 1], torch.tensor([r]), 31)
        for a, b in zip(vars(one).values(), vars(full).values()):
            assert torch.equal(a[0], b[r])


def assert_same_tree(a: DraftTree, b: DraftTree) -> None:
    for x, y in zip(vars(a).values(), vars(b).values()):
        assert torch.equal(x, y)


@pytest.mark.parametrize("budget, max_topk", [(40, None), (4, None), (30, 2), (12, 3)])
def test_all_equal_logits_are_deterministic(budget, max_topk):
    """Every logit equal: the order is fixed by the tie-break alone, lowest token ids first."""
    logits = torch.zeros(3, 4, 5)
    root = torch.tensor([1, 2, 3])
    first = build_draft_tree(logits, root, budget, max_topk)
    assert_same_tree(first, build_draft_tree(logits.clone(), root, budget, max_topk))
    check_against_oracles(logits, budget, max_topk)
    k = min(budget, 5, max_topk or budget)
    # score desc then depth asc: all K depth-1 nodes first, in token-id order
    assert first.token_ids[0, 1 : k + 1].tolist() == list(range(k))
    assert first.depths[0, 1:].tolist() == sorted(first.depths[0, 1:].tolist())


@pytest.mark.parametrize(
    "budget, max_topk", [(4, None), (5, None), (17, None), (100, None), (340, None), (30, 2), (50, 3), (7, None)]
)
def test_tied_logits_are_deterministic_and_match_oracles(budget, max_topk):
    g = torch.Generator().manual_seed(budget)
    logits = torch.randint(0, 3, (4, 4, 4), generator=g).float()  # many exact ties, also at the K-th place
    root = torch.zeros(4, dtype=torch.int64)
    tree = check_against_oracles(logits, budget, max_topk)
    assert_same_tree(tree, build_draft_tree(logits.clone(), root + 11 + torch.arange(4), budget, max_topk))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_req", range(1, 9))
def test_half_precision_logits(dtype, num_req):
    # Distinct values k/8 (exact in fp16 and bf16), shuffled differently per request and depth.
    vocab, depth = 50, 6
    g = torch.Generator().manual_seed(num_req)
    perm = torch.argsort(torch.rand(num_req, depth, vocab, generator=g), dim=-1)
    logits = (perm.float() / 8).to(dtype)
    tree = check_against_oracles(logits, 40)
    assert_same_tree(tree, build_draft_tree(logits.float(), torch.arange(num_req) + 11, 40))
    # Plain random half logits: ties are frequent, the tie-break still matches the oracle exactly.
    check_against_oracles(random_logits(num_req, (num_req, depth, 300), dtype=dtype), 64)


def test_max_tree_nodes():
    assert max_tree_nodes(3, 5, None, 100) == 5 + 25 + 125
    assert max_tree_nodes(3, 5, 2, 100) == 2 + 4 + 8
    assert max_tree_nodes(4, 32000, None, 3) == 3 + 9 + 27 + 81
    assert max_tree_nodes(16, 32000, None, 256) == sum(256**d for d in range(1, 17))
    for args in [(0, 5, None, 3), (2, 0, None, 3), (2, 5, 0, 3), (2, 5, None, 0)]:
        with pytest.raises(ValueError):
            max_tree_nodes(*args)


def test_value_errors():
    logits = torch.zeros(2, 3, 4)
    root = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="budget"):
        build_draft_tree(logits, root, 0)
    with pytest.raises(ValueError, match="budget=85 exceeds the 84"):
        build_draft_tree(logits, root, 85)
    build_draft_tree(logits, root, 84)
    with pytest.raises(ValueError, match="budget=15 exceeds the 14"):
        build_draft_tree(logits, root, 15, max_topk=2)
    with pytest.raises(ValueError, match="max_topk"):
        build_draft_tree(logits, root, 3, max_topk=0)
    with pytest.raises(ValueError, match="root_token_ids"):
        build_draft_tree(logits, torch.zeros(3, dtype=torch.int64), 3)
    with pytest.raises(ValueError, match=r"\[R, D, V\]"):
        build_draft_tree(logits[0], root, 3)
    with pytest.raises(ValueError, match="float"):
        build_draft_tree(logits.long(), root, 3)
    with pytest.raises(ValueError, match="depth"):
        build_draft_tree(torch.zeros(2, 0, 4), root, 3)


def random_parents(seed: int, num_req: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    parents = (torch.rand(num_req, n, generator=g) * torch.arange(n)).long()  # parents[i] in [0, i)
    parents[:, 0] = -1
    return parents


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 9, 33, 129])
def test_layout_on_random_trees_and_chains(n):
    chain = (torch.arange(n) - 1).expand(2, n)  # depth n - 1: the longest possible
    star = torch.zeros(1, n, dtype=torch.int64)
    star[0, 0] = -1
    for parents in (random_parents(n, 5, n), chain, star):
        mask = ancestor_mask(parents)
        got_depths = depths_from_parents(parents)
        for r in range(parents.shape[0]):
            p = parents[r].tolist()
            assert mask[r].tolist() == oracle.ancestors_mask(p)
            assert got_depths[r].tolist() == oracle.depths(p)


def test_layout_accepts_non_topological_order():
    parents = torch.tensor([[-1, 3, 0, 2, 1]])  # 0 <- 2 <- 3 <- 1 <- 4
    assert depths_from_parents(parents).tolist() == [[0, 3, 1, 2, 4]]
    assert ancestor_mask(parents)[0].tolist() == oracle.ancestors_mask(parents[0].tolist())

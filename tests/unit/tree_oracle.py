"""Slow, obviously-correct Python references for the tree package: prefix enumeration, DDTree's sequential
best-first heap, the sequential walk, and parent-chain ancestors/depths.

Scores are accumulated in float32 one depth at a time, exactly like the batched builder, so results compare
bit for bit. A prefix is a tuple of per-depth token ranks (rank 0 = highest logit; equal logits: lower id first).
Total order (see vllm_ddtree/tree/build.py): score desc, depth asc, then within one depth the parent's order
and the token rank, i.e. key (-s_d, d, -s_{d-1}, ..., -s_1, r_1, ..., r_d).
"""

import heapq
import itertools
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class RankedVocab:
    """Per-depth token ranking of one request."""

    token_ids: np.ndarray  # [D, V] int64 tokens, best first
    log_probs: np.ndarray  # [D, V] float32 their log-probabilities


def log_probs_f32(draft_logits: torch.Tensor) -> torch.Tensor:
    """[R, D, V] float32 log-probabilities (same formula as the builder)."""
    return torch.log_softmax(draft_logits, dim=-1, dtype=torch.float32)


def rank_vocab(draft_logits: torch.Tensor) -> list[RankedVocab]:
    """Full stable ranking of every depth of every request: logit descending, lower id first on ties."""
    lp = log_probs_f32(draft_logits)
    order = torch.sort(draft_logits, dim=-1, descending=True, stable=True).indices
    lp_sorted = lp.gather(-1, order)
    return [
        RankedVocab(token_ids=order[r].numpy(), log_probs=lp_sorted[r].numpy())
        for r in range(draft_logits.shape[0])
    ]


def prefix_scores(vocab: RankedVocab, ranks: tuple[int, ...]) -> list[np.float32]:
    """Cumulative float32 scores s_1..s_d of a rank prefix."""
    scores, s = [], None
    for d, r in enumerate(ranks):
        s = vocab.log_probs[d, r] if s is None else np.float32(s + vocab.log_probs[d, r])
        scores.append(s)
    return scores


def order_key(ranks: tuple[int, ...], scores: list[np.float32]) -> tuple:
    d = len(ranks)
    return (-float(scores[-1]), d) + tuple(-float(s) for s in reversed(scores[:-1])) + ranks


@dataclass
class OracleNode:
    tokens: tuple[int, ...]  # token prefix t_1..t_d
    score: float


def _to_nodes(vocab: RankedVocab, picked: list[tuple[int, ...]]) -> list[OracleNode]:
    return [
        OracleNode(
            tokens=tuple(int(vocab.token_ids[d, r]) for d, r in enumerate(ranks)),
            score=float(prefix_scores(vocab, ranks)[-1]),
        )
        for ranks in picked
    ]


def enumerate_best(vocab: RankedVocab, depth: int, k: int, budget: int) -> list[OracleNode]:
    """All prefixes of length 1..depth over the top-k ranks (itertools.product), sorted, best `budget`."""
    keyed = []
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(k), repeat=d):
            keyed.append((order_key(ranks, prefix_scores(vocab, ranks)), ranks))
    keyed.sort()
    return _to_nodes(vocab, [ranks for _, ranks in keyed[:budget]])


def heap_best(vocab: RankedVocab, depth: int, k: int, budget: int) -> list[OracleNode]:
    """DDTree's sequential best-first heap: pop the best prefix, push its first child and next sibling."""

    def entry(ranks, parent_scores):
        lp = vocab.log_probs[len(ranks) - 1, ranks[-1]]
        scores = parent_scores + [lp if not parent_scores else np.float32(parent_scores[-1] + lp)]
        return (order_key(ranks, scores), ranks, scores)

    heap, popped = [entry((0,), [])], []
    while len(popped) < budget:
        _, ranks, scores = heapq.heappop(heap)
        popped.append(ranks)
        if len(ranks) < depth:
            heapq.heappush(heap, entry(ranks + (0,), scores))
        if ranks[-1] + 1 < k:
            heapq.heappush(heap, entry(ranks[:-1] + (ranks[-1] + 1,), scores[:-1]))
    return _to_nodes(vocab, popped)


def tree_prefixes(token_ids: list[int], parents: list[int]) -> list[tuple[int, ...]]:
    """Token prefix (root excluded) of every node of one tree given as lists."""
    out = []
    for i in range(len(parents)):
        path, u = [], i
        while parents[u] >= 0:
            path.append(token_ids[u])
            u = parents[u]
        out.append(tuple(reversed(path)))
    return out


def ancestors_mask(parents: list[int]) -> list[list[bool]]:
    n = len(parents)
    mask = [[False] * n for _ in range(n)]
    for i in range(n):
        u = i
        while u >= 0:
            mask[i][u] = True
            u = parents[u]
    return mask


def depths(parents: list[int]) -> list[int]:
    return [sum(row) - 1 for row in ancestors_mask(parents)]


@dataclass
class OracleWalk:
    path_nodes: list[int]  # root first
    output_token_ids: list[int]  # accepted tokens then the bonus


def sequential_walk(token_ids: list[int], parents: list[int], target: list[int], num_nodes: int) -> OracleWalk:
    """The reference walk: follow the valid child whose token the target chose, until none does."""
    path, u = [0], 0
    while True:
        nxt = [j for j in range(1, num_nodes) if parents[j] == u and token_ids[j] == target[u]]
        assert len(nxt) <= 1, "siblings must carry distinct tokens"
        if not nxt:
            break
        u = nxt[0]
        path.append(u)
    return OracleWalk(path_nodes=path, output_token_ids=[token_ids[j] for j in path[1:]] + [target[u]])

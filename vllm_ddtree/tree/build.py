"""Building the DDTree draft tree from the drafter's per-depth marginals (pure torch, batched).

The drafter (DFlash) predicts one block of D future positions in a single pass, so it gives independent
marginals: depth d uses row d-1 of `draft_logits`. A node of the tree is a token prefix t_1..t_d and its score
is the sum of the per-depth log-probabilities of its tokens. DDTree (Ringel & Romano 2026) keeps the `budget`
highest-scoring prefixes, found with a best-first heap (pop the best prefix, push its first child and its next
sibling). `build_draft_tree` finds the same set with tensor ops: a depth-by-depth beam, then one global top-k.

Why the beam gives the heap's set
---------------------------------
Fix the total order on prefixes used everywhere below:
  * at one depth: score descending, then the parent's place in this order, then the token's rank at this depth;
  * across depths: score descending, then depth ascending, then the order at that depth.
Per-depth token ranks are non-increasing in log-probability, and float32 rounding is monotone, so
score(child) <= score(parent) and score(next sibling) <= score(sibling); on equal scores the tie-break puts the
parent (shallower) and the earlier sibling first. Every prefix's heap predecessor (previous sibling if its last
rank is > 0, else its parent) therefore comes before it, so the heap pops prefixes in exactly this order and
its first `budget` pops are the `budget` first prefixes of the order: a set closed under taking parents.

Beam: at depth d keep the first min(budget, K^d) prefixes of length d (in the per-depth order). Claim: if y of
length d+1 is among the first `budget` prefixes of length d+1, its parent p is in the depth-d beam. Otherwise
`budget` prefixes q_i of length d come before p; each q_i extended by the depth-(d+1) top token comes before y
(score(q_i) + lp_0 >= score(p) + lp(y), and on equality q_i's place breaks the tie), giving `budget` prefixes of
length d+1 before y, a contradiction. So each beam is exact, and the global first `budget` (whose members of
length d are a head of the depth-d order, at most `budget` long) lie inside the union of the beams.

Only the per-depth top K = min(budget, V, max_topk or budget) tokens are considered: a token ranked >= budget
at some depth has `budget` better-or-equal alternatives there, so it can never be among the best `budget`.

Node order and tie-break (deterministic)
----------------------------------------
Node 0 is the root; nodes 1..budget follow the total order above: score descending, then depth ascending,
then (same depth) the parent's order, then the token's rank. Tokens of one depth are ranked by logit
descending, equal logits by lower token id first (also at the K-th place: the top-K of a depth is the first
K tokens of that ranking, as with a stable sort; K = 1 gives torch.argmax's token). Parents always precede
their children, so every prefix of the node list is a valid subtree (vLLM may truncate the draft to its first
n tokens).

Devices: on CUDA one torch.topk picks the K tokens of a depth and ranks them by logit; among tokens tied at the
K-th place it keeps some, and it orders equal logits its own (deterministic) way, not by token id. The exact rule
above costs a second top-k over the vocabulary and two sorts (~0.5 ms of host time per step, and several passes
over [R, D, V] on the GPU), and a tree is lossless whichever tied token it holds, so it is kept for the CPU path
(the reference the oracles check). The log-softmax may also differ by ~1 ulp between devices, which can shift
`log_probs` by that much and reorder nodes whose scores are within that distance.
"""

import functools
from dataclasses import dataclass

import torch

from vllm_ddtree.tree.dispatch import use_triton, use_triton_top_k

__all__ = ["DraftTree", "build_draft_tree", "max_tree_nodes", "top_tokens", "tree_from_top_tokens", "trees_into_slots_"]


@dataclass
class DraftTree:
    """A batch of draft trees, one per request, each with `budget + 1` nodes in topological order."""

    token_ids: torch.Tensor  # [R, N] int64; N = budget + 1; node 0 is the root (token = root_token_ids)
    parents: torch.Tensor  # [R, N] int64; parent node index, -1 for the root
    depths: torch.Tensor  # [R, N] int64; 0 for the root, 1..D for the others
    log_probs: torch.Tensor  # [R, N] float32; cumulative path log-probability (0 for the root)


@dataclass
class _DepthBeam:
    """The best prefixes of one length, in the per-depth order."""

    scores: torch.Tensor  # [R, W] float32 cumulative log-probability
    token_ids: torch.Tensor  # [R, W] int64 last token of the prefix
    parent_slots: torch.Tensor  # [R, W] int64 slot of the parent in the previous depth's beam (0 at depth 1)


def topk_per_depth(vocab_size: int, max_topk: int | None, budget: int) -> int:
    """K: the tokens a depth contributes, min(budget, vocab_size, max_topk or budget)."""
    return min(budget, vocab_size, budget if max_topk is None else max_topk)


def max_tree_nodes(depth: int, vocab_size: int, max_topk: int | None, budget: int) -> int:
    """Number of distinct prefixes of length 1..depth over the per-depth top-K tokens: sum_{d=1..depth} K^d.

    K = min(budget, vocab_size, max_topk or budget). `budget` may not exceed this value. Exact (a Python
    int, possibly huge); costs `depth` integer multiplications.
    """
    for name, value in (("depth", depth), ("vocab_size", vocab_size), ("budget", budget)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if max_topk is not None and max_topk < 1:
        raise ValueError(f"max_topk must be >= 1 or None (no cap), got {max_topk}")
    k = topk_per_depth(vocab_size, max_topk, budget)
    return sum(k**d for d in range(1, depth + 1))


def _sortable_key(scores: torch.Tensor) -> torch.Tensor:
    """Map float32 values to int64 keys with the same order (so ties can be broken by an index)."""
    bits = (scores + 0.0).view(torch.int32).to(torch.int64)  # + 0.0 folds -0.0 into +0.0
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


def _stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest along the last dim, largest first, equal values by lower index first."""
    n = scores.shape[-1]
    position = torch.arange(n, device=scores.device, dtype=torch.int64)
    key = _sortable_key(scores) * 2**32 + (n - 1 - position)  # [..., n]; unique, so topk order is total
    return torch.topk(key, k, dim=-1, sorted=True).indices


# From this many [R * D] rows on, CUDA takes the log-probabilities from Model Runner V2's `compute_token_logprobs`
# kernel (max + log-sum-exp per row, written at the K ids only) instead of a float32 log-softmax over [R, D, V].
# Session 32's bench_tree at vocab 151,936: 0.84 vs 1.19 ms at batch 32 (480 rows), 1.37 vs 2.13 ms at batch 64,
# but 0.32 vs 0.16 ms at batch 1 (15 rows): one program per row leaves the GPU idle on few rows.
TOKEN_LOGPROBS_KERNEL_MIN_ROWS = 128


def top_tokens(draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-depth top-k tokens ranked by logit descending and their float32 log-probabilities, non-increasing
    along the last dim. Equal logits: lower id first on the CPU, torch.topk's choice on CUDA (module docstring).

    The log-probabilities are a float32 log-softmax taken at the chosen ids: on CUDA with at least
    TOKEN_LOGPROBS_KERNEL_MIN_ROWS rows, by vLLM's kernel (no [R, D, V] float32 tensor); otherwise by one fused
    log-softmax. It is monotone in the logit, so ranking either gives the same order."""
    if not draft_logits.is_cuda:
        token_ids, _ = _top_tokens_lowest_ids_first(draft_logits, k)  # [R, D, K]
        return token_ids, _log_softmax_at(draft_logits, token_ids)
    if use_triton_top_k(draft_logits, k):
        from vllm_ddtree.tree.triton_topk import top_tokens_triton  # the CPU's tie rule, in three launches

        return top_tokens_triton(draft_logits, k)
    token_ids = torch.topk(draft_logits, k, dim=-1, sorted=True).indices  # [R, D, K] (16-bit reads)
    vocab = draft_logits.shape[-1]
    many_rows = draft_logits.numel() >= TOKEN_LOGPROBS_KERNEL_MIN_ROWS * vocab
    token_logprobs = _token_logprobs_kernel() if many_rows else None
    if token_logprobs is None:
        return token_ids, _log_softmax_at(draft_logits, token_ids)
    rows = draft_logits.reshape(-1, vocab)  # [R * D, V]
    log_probs = token_logprobs(rows, token_ids.reshape(-1, k))  # [R * D, K] float32
    return token_ids, log_probs.view(token_ids.shape)


def _log_softmax_at(draft_logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """[R, D, K] float32 log-probabilities of `token_ids` under a log-softmax of [R, D, V] `draft_logits`."""
    return torch.log_softmax(draft_logits, dim=-1, dtype=torch.float32).gather(-1, token_ids)


@functools.cache
def _token_logprobs_kernel():
    """vLLM's `compute_token_logprobs`, or None where vLLM or its Model Runner V2 sampler does not import (the tree
    package itself needs torch only)."""
    try:
        from vllm_ddtree import compat

        return compat.v2_token_logprobs()
    except ImportError:
        return None


def _top_tokens_lowest_ids_first(draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([R, D, K] token ids, [R, D, K] their logits): the exact tie rule of the module docstring.

    torch.topk alone picks arbitrarily among tokens tied at the k-th place, so a second top-k over an int32
    key takes every token strictly above the k-th logit, then the lowest ids among those equal to it.
    """
    vocab = draft_logits.shape[-1]
    kth = torch.topk(draft_logits, k, dim=-1, sorted=True).values[..., k - 1 :]  # [R, D, 1]
    reverse_id = torch.arange(vocab, 0, -1, device=draft_logits.device, dtype=torch.int32)  # [V] = V - id
    key = torch.where(draft_logits > kth, reverse_id + vocab, torch.where(draft_logits == kth, reverse_id, 0))
    token_ids = torch.topk(key, k, dim=-1, sorted=False).indices  # [R, D, K] the selected set
    token_ids = torch.sort(token_ids, dim=-1).values  # [R, D, K] ascending ids
    logits = draft_logits.gather(-1, token_ids)
    logits, by_logit = torch.sort(logits, dim=-1, descending=True, stable=True)
    return token_ids.gather(-1, by_logit), logits


@functools.lru_cache(maxsize=1024)
def _num_candidates(num_slots: int, k: int, width: int) -> int:
    return sum(min(k, width // (b + 1)) for b in range(num_slots))


def _candidate_pairs(prev_width: int, k: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(beam slot b, token rank r) pairs that can be among the best `width` extensions, slot-major.

    Beam scores fall with b and log-probs with r, so the (b+1)(r+1) - 1 pairs (b', r') <= (b, r) all come first
    (higher score, or equal score and lower b*K + r): only pairs with (b+1)(r+1) <= width can make the cut,
    about width * ln(width) of them instead of prev_width * k. Sizes depend on ints only: no sync.
    """
    num_slots = min(prev_width, width)
    total = _num_candidates(num_slots, k, width)  # C
    counts = (width // torch.arange(1, num_slots + 1, device=device)).clamp(max=k)  # [W'] candidates per slot
    slots = torch.repeat_interleave(counts, output_size=total)  # [C] slot of each candidate
    first = torch.cumsum(counts, dim=0) - counts  # [W'] first candidate of each slot
    ranks = torch.arange(slots.shape[0], device=device) - first[slots]  # [C]
    return slots, ranks


def _extend_beam(beam: _DepthBeam, lp: torch.Tensor, tok: torch.Tensor, width: int) -> _DepthBeam:
    """Best `width` one-token extensions of `beam` by this depth's top tokens (lp, tok: [R, K])."""
    slots, ranks = _candidate_pairs(beam.scores.shape[1], lp.shape[1], width, lp.device)  # [C]
    cand = beam.scores[:, slots] + lp[:, ranks]  # [R, C]
    pick = _stable_topk(cand, width)  # [R, width] index into the candidates
    return _DepthBeam(
        scores=cand.gather(1, pick),
        token_ids=tok.gather(1, ranks[pick]),
        parent_slots=slots[pick],
    )


def _depth_beams(lp: torch.Tensor, tok: torch.Tensor, budget: int) -> list[_DepthBeam]:
    """Beams for depths 1..D; lp, tok: [R, D, K]. Depth d keeps min(budget, K^d) prefixes."""
    depth, k = lp.shape[1], lp.shape[2]
    first = _DepthBeam(scores=lp[:, 0], token_ids=tok[:, 0], parent_slots=torch.zeros_like(tok[:, 0]))
    beams, width = [first], k
    for d in range(1, depth):
        width = min(budget, width * k)
        beams.append(_extend_beam(beams[-1], lp[:, d], tok[:, d], width))
    return beams


@dataclass
class _Slots:
    """The root and every beam prefix, flattened: slot 0 is the root, then depth 1, depth 2, ..."""

    scores: torch.Tensor  # [R, M] float32 (0 for the root)
    token_ids: torch.Tensor  # [R, M] int64
    parent_slots: torch.Tensor  # [R, M] int64 slot of the parent, -1 for the root
    depths: torch.Tensor  # [M] int64


def _flatten_beams(beams: list[_DepthBeam], root_token_ids: torch.Tensor) -> _Slots:
    """Concatenate the root and the beams depth-major, turning per-beam parent slots into global ones."""
    num_req, device = root_token_ids.shape[0], beams[0].scores.device
    widths = [1] + [b.scores.shape[1] for b in beams]
    offsets = [sum(widths[:d]) for d in range(len(widths))]  # first slot of depth d (depth 0 = root)
    root = torch.zeros(num_req, 1, dtype=torch.int64, device=device)
    return _Slots(
        scores=torch.cat([root.float()] + [b.scores for b in beams], dim=1),
        token_ids=torch.cat([root_token_ids.to(device, torch.int64)[:, None]] + [b.token_ids for b in beams], dim=1),
        parent_slots=torch.cat([root - 1] + [b.parent_slots + offsets[d] for d, b in enumerate(beams)], dim=1),
        depths=torch.cat([torch.full((w,), d, dtype=torch.int64, device=device) for d, w in enumerate(widths)]),
    )


def _pick_nodes(slots: _Slots, num_nodes: int) -> DraftTree:
    """The first `num_nodes` slots in the global order (score desc, then slot = depth, beam order), as a tree.

    The root (score 0 >= every prefix, slot 0) always comes first; the picked set is parent-closed.
    """
    num_req = slots.scores.shape[0]
    chosen = _stable_topk(slots.scores, num_nodes)  # [R, N] slots in node order
    node_of_slot = torch.full_like(slots.token_ids, -1)  # [R, M] node index, -1 if not chosen
    node_ids = torch.arange(num_nodes, device=chosen.device).expand(num_req, num_nodes)
    node_of_slot.scatter_(1, chosen, node_ids)
    parent_slots = slots.parent_slots.gather(1, chosen)  # [R, N]
    parents = torch.where(parent_slots < 0, -1, node_of_slot.gather(1, parent_slots.clamp(min=0)))  # [R, N]
    return DraftTree(
        token_ids=slots.token_ids.gather(1, chosen),
        parents=parents,
        depths=slots.depths[chosen],
        log_probs=slots.scores.gather(1, chosen),
    )


def _check_args(draft_logits: torch.Tensor, root_token_ids: torch.Tensor, budget: int, max_topk: int | None) -> None:
    if draft_logits.dim() != 3:
        raise ValueError(f"draft_logits must be [R, D, V], got shape {tuple(draft_logits.shape)}")
    if not draft_logits.is_floating_point():
        raise ValueError(f"draft_logits must be float16/bfloat16/float32, got {draft_logits.dtype}")
    num_req, depth, vocab = draft_logits.shape
    if root_token_ids.shape != (num_req,):
        raise ValueError(
            f"root_token_ids must be [R] = [{num_req}] to match draft_logits {tuple(draft_logits.shape)}, "
            f"got shape {tuple(root_token_ids.shape)}"
        )
    if depth < 1 or vocab < 1:
        raise ValueError(f"draft_logits needs depth D >= 1 and vocab V >= 1, got shape {tuple(draft_logits.shape)}")
    if budget < 1:
        raise ValueError(f"budget must be >= 1 draft node, got {budget}; set the tree budget to a positive integer")
    available = max_tree_nodes(depth, vocab, max_topk, budget)
    if budget > available:
        raise ValueError(
            f"budget={budget} exceeds the {available} distinct prefixes available with depth={depth}, "
            f"vocab_size={vocab}, max_topk={max_topk}; lower the budget to <= {available} or raise max_topk/depth"
        )


def build_draft_tree(
    draft_logits: torch.Tensor,
    root_token_ids: torch.Tensor,
    budget: int,
    max_topk: int | None = None,
) -> DraftTree:
    """Best-`budget` draft tree per request from independent per-depth drafter logits.

    Args:
        draft_logits: [R, D, V] float16/bfloat16/float32; row d-1 is the drafter's logits for depth d.
        root_token_ids: [R] integer; the last verified token (the tree's root), on the same device.
        budget: number of draft nodes (the root excluded); N = budget + 1.
        max_topk: optional cap on the tokens considered per depth.

    Returns a `DraftTree` on draft_logits' device; see the module docstring for the node order.
    On CUDA the selection after the top-k is one Triton launch (tree/triton_build.py, the same tree;
    VLLM_DDTREE_TREE_KERNELS=torch forces the tensor-op beam below).
    No host-device synchronisation; the Python loop runs over depth only. Cost: one top-k pass over V per
    depth on CUDA (two on the CPU, the second makes ties exact) and a transient float32 copy of the logits for the
    log-normaliser, then about budget * ln(budget) candidates per depth. Requires V < 2^30.
    """
    _check_args(draft_logits, root_token_ids, budget, max_topk)
    vocab = draft_logits.shape[2]
    tok, lp = top_tokens(draft_logits, topk_per_depth(vocab, max_topk, budget))  # [R, D, K]
    return tree_from_top_tokens(tok, lp, root_token_ids, budget)


def tree_from_top_tokens(
    token_ids: torch.Tensor,  # [R, D, K] per-depth top tokens, best first (`top_tokens`)
    log_probs: torch.Tensor,  # [R, D, K] float32, non-increasing along K
    root_token_ids: torch.Tensor,  # [R]
    budget: int,
) -> DraftTree:
    """The best-`budget` tree from per-depth top tokens already picked (`build_draft_tree` after its top-k;
    Model Runner V2's drafter picks them inside its CUDA graph). One Triton launch on CUDA."""
    if use_triton(log_probs):
        from vllm_ddtree.tree.triton_build import best_first_tree  # the same tree in one launch

        return DraftTree(*best_first_tree(log_probs, token_ids, root_token_ids, budget + 1))
    slots = _flatten_beams(_depth_beams(log_probs, token_ids, budget), root_token_ids)
    return _pick_nodes(slots, budget + 1)


def trees_into_slots_(
    token_ids: torch.Tensor,  # [R, D, K] per-depth top tokens, best first
    log_probs: torch.Tensor,  # [R, D, K] float32, non-increasing along K
    last_tokens: torch.Tensor,  # [S] the last verified token of every request slot (the roots)
    slots: torch.Tensor,  # [R] request slot of each request
    budget: int,
    parents: torch.Tensor,  # [S, B + 1] int64, the trees kept by request slot (rows `slots` overwritten)
    depths: torch.Tensor,  # [S, B + 1] int64
) -> torch.Tensor:
    """`tree_from_top_tokens` for requests kept by slot (Model Runner V2): the roots are read and the parents and
    depths written by slot. Returns the [R, B + 1] node tokens. One Triton launch on CUDA, nothing around it."""
    if use_triton(log_probs):
        from vllm_ddtree.tree.triton_build import best_first_tree

        return best_first_tree(log_probs, token_ids, last_tokens, budget + 1, slots=slots, parents=parents,
                               depths=depths)[0]  # fmt: skip
    rows = slots.to(torch.int64)
    tree = tree_from_top_tokens(token_ids, log_probs, last_tokens[rows], budget)
    parents[rows] = tree.parents
    depths[rows] = tree.depths
    return tree.token_ids

"""DDTree sampling is lossless: the first K output tokens are distributed exactly as the target's.

A synthetic target gives logits for every context over a small vocabulary (V = 5), so the distribution of the
first K = 3 output tokens is known exactly: the product of the target's processed conditionals (penalties,
temperature, top-k, top-p, computed here in float64 by an independent reference), enumerated over all V^K
sequences. DDTree verification runs as in vLLM's model runner: a tree per request from drafter logits
(`build_draft_tree`), the step layout (`build_tree_step`, with drafts truncated the way vLLM's scheduler may),
the target's choice per node (`node_choices`) and the walk (`walk_step`), step after step until every request has
K tokens; 50,000 requests run as one batch. A chi-square test with fixed seeds compares the two.
The drafters are arbitrary, adversarial ones included: they change how many tokens a step accepts, never what
the tokens are.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.chi_square import ChiSquare, goodness_of_fit, two_sample
from vllm_ddtree.tree import build_draft_tree
from vllm_ddtree.verify import sampling
from vllm_ddtree.verify.sampling import node_choices
from vllm_ddtree.verify.scorer import node_tokens, walk_step
from vllm_ddtree.verify.step import build_tree_step

V = 5  # vocabulary
K = 3  # output tokens whose joint distribution is checked
DEPTH = 3  # tree depth (the drafter's block size - 1)
PROMPT = [1, 3]  # the last prompt token is the first tree's root
NUM_SAMPLES = 50_000
P_MIN = 1e-3  # the tests pass when the chi-square p-value is above this (fixed seeds: deterministic)


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


# --- the synthetic target ---------------------------------------------------------------------------------------


def context_code(tokens: list[int]) -> int:
    """Index of an output prefix: bijective base-V numbering (() -> 0, (t,) -> t + 1, ...)."""
    code = 0
    for t in tokens:
        code = code * V + t + 1
    return code


NUM_CODES = context_code([V - 1] * (K - 1)) + 1  # every output prefix shorter than K


def target_table(seed: int = 0, scale: float = 1.5) -> torch.Tensor:
    """[NUM_CODES, V] float32 raw target logits for each output prefix (the prompt is fixed)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(NUM_CODES, V, generator=g) * scale


@dataclass
class Params:
    """One request's sampling parameters (vLLM's meaning; temperature 0 = greedy)."""

    temperature: float = 1.0
    top_k: int = V  # V = off
    top_p: float = 1.0
    repetition: float = 1.0
    frequency: float = 0.0
    presence: float = 0.0
    allowed: list[int] | None = None
    bad_words: tuple[tuple[int, ...], ...] = ()  # token ids of each banned word

    @property
    def penalized(self) -> bool:
        return self.repetition != 1.0 or self.frequency != 0.0 or self.presence != 0.0


def reference_probs(raw: np.ndarray, outputs: list[int], p: Params) -> np.ndarray:
    """[V] float64 processed next-token distribution after `outputs` (vLLM's order of operations)."""
    x = raw.astype(np.float64).copy()
    if p.allowed is not None:
        x[[t for t in range(V) if t not in p.allowed]] = -np.inf
    for word in p.bad_words:  # vLLM's rule: the word's last token after the rest of it (output tokens only)
        if len(word) - 1 <= len(outputs) and tuple(outputs[len(outputs) - len(word) + 1 :]) == word[:-1]:
            x[word[-1]] = -np.inf
    counts = np.bincount(np.asarray(outputs, dtype=np.int64), minlength=V).astype(np.float64)
    seen = (counts > 0) | np.isin(np.arange(V), PROMPT)
    x = np.where(seen, np.where(x > 0, x / p.repetition, x * p.repetition), x)
    x = x - p.frequency * counts - p.presence * (counts > 0)
    if p.temperature == 0.0:
        out = np.zeros(V)
        out[int(np.argmax(x))] = 1.0
        return out
    x = x / p.temperature
    if p.top_k < V:
        x[x < np.sort(x)[::-1][p.top_k - 1]] = -np.inf
    if p.top_p < 1.0:
        order = np.argsort(x, kind="stable")  # ascending, as vLLM's top-p
        probs = np.exp(x[order] - x.max())
        cum = np.cumsum(probs / probs.sum())
        margin = np.abs(cum - (1 - p.top_p)).min()
        assert margin > 1e-4, "top-p boundary too close to a cumulative sum: choose other test logits"
        drop = cum <= 1 - p.top_p
        drop[-1] = False
        x[order[drop]] = -np.inf
    probs = np.exp(x - x.max())
    return probs / probs.sum()


def exact_joint(table: torch.Tensor, p: Params) -> np.ndarray:
    """[V ** K] probability of every K-token output sequence (index t_0 * V^(K-1) + ... + t_{K-1})."""
    raw = table.double().numpy()
    joint = np.zeros(V**K)
    for seq in itertools.product(range(V), repeat=K):
        prob = 1.0
        for j in range(K):
            prob *= reference_probs(raw[context_code(list(seq[:j]))], list(seq[:j]), p)[seq[j]]
        joint[np.ravel_multi_index(seq, (V,) * K)] = prob
    return joint


# --- drafters: [R, DEPTH, V] logits from what each request has generated so far ----------------------------------


def drafter_logits(kind: str, table: torch.Tensor, codes: torch.Tensor, seed: int) -> torch.Tensor:
    num_reqs = codes.shape[0]
    g = torch.Generator().manual_seed(seed)
    here = table[codes.clamp(max=NUM_CODES - 1)]  # [R, V] the target's logits at the root's context
    if kind == "random":  # a fresh random opinion per request and step
        return torch.randn(num_reqs, DEPTH, V, generator=g) * 3.0
    if kind == "target_like":  # agrees with the target's first choice, sharp
        return (here * 4.0)[:, None, :].expand(num_reqs, DEPTH, V).contiguous()
    if kind == "adversarial":  # ranks the target's least likely tokens first
        return (-here * 4.0)[:, None, :].expand(num_reqs, DEPTH, V).contiguous()
    if kind == "constant":  # every token tied: the tree is decided by the tie-break alone
        return torch.zeros(num_reqs, DEPTH, V)
    raise ValueError(kind)


# --- DDTree verification, step after step ------------------------------------------------------------------------


@dataclass
class Batch:
    params: list[Params]
    generators: dict[int, torch.Generator] = field(default_factory=dict)

    def metadata(self, outputs: list[list[int]]) -> SimpleNamespace:
        """The SamplingMetadata fields `node_choices` reads, as vLLM's InputBatch fills them."""
        ps = self.params
        temperature = torch.tensor([p.temperature for p in ps], dtype=torch.float32)
        top_k = torch.tensor([p.top_k for p in ps], dtype=torch.int32)
        top_p = torch.tensor([p.top_p for p in ps], dtype=torch.float32)
        allowed = None
        if any(p.allowed is not None for p in ps):
            allowed = torch.zeros(len(ps), V, dtype=torch.bool)
            for r, p in enumerate(ps):
                if p.allowed is not None:
                    allowed[r] = True
                    allowed[r, p.allowed] = False  # True = masked out, as vLLM's mask
        no_penalties = not any(p.penalized for p in ps)
        return SimpleNamespace(
            all_greedy=bool((temperature < 1e-5).all()),
            all_random=bool((temperature >= 1e-5).all()),
            no_penalties=no_penalties,
            temperature=temperature,
            top_k=None if (top_k == V).all() else top_k,
            top_p=None if (top_p == 1.0).all() else top_p,
            generators=self.generators,
            allowed_token_ids_mask=allowed,
            output_token_ids=outputs,
            prompt_token_ids=None if no_penalties else torch.tensor([PROMPT] * len(ps), dtype=torch.int64),
            frequency_penalties=torch.tensor([p.frequency for p in ps], dtype=torch.float32),
            presence_penalties=torch.tensor([p.presence for p in ps], dtype=torch.float32),
            repetition_penalties=torch.tensor([p.repetition for p in ps], dtype=torch.float32),
            bad_words_token_ids={r: [list(w) for w in p.bad_words] for r, p in enumerate(ps) if p.bad_words},
        )


def node_context_codes(root_codes: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """[R, N] output-prefix code seen by every node (root: the request's outputs; child: parent's + its token).

    Contexts of K or more output tokens predict tokens past the K checked ones; they get code NUM_CODES (any
    logits will do there).
    """
    codes = torch.empty_like(tokens)
    codes[:, 0] = root_codes
    for i in range(1, tokens.shape[1]):
        parent = codes.gather(1, parents[:, i : i + 1].clamp(min=0))[:, 0]
        child = parent * V + tokens[:, i] + 1
        codes[:, i] = torch.where((parent >= NUM_CODES) | (child >= NUM_CODES), NUM_CODES, child)
    return codes


def ddtree_samples(
    table: torch.Tensor,
    batch: Batch,
    budget: int,
    drafter: str = "random",
    truncate: bool = True,
    seed: int = 0,
    noise_seed: int | None = None,
) -> np.ndarray:
    """[R, K] the first K output tokens of every request under DDTree verification.

    `seed` fixes the drafters and the truncation, `noise_seed` (default: `seed`) the unseeded requests' noise.
    """
    num_reqs = len(batch.params)
    torch.manual_seed(seed if noise_seed is None else noise_seed)
    rng = torch.Generator().manual_seed(seed + 1)
    padded_table = torch.cat([table, torch.zeros(1, V)])  # row NUM_CODES: contexts past K tokens
    outputs: list[list[int]] = [[] for _ in range(num_reqs)]
    out = torch.full((num_reqs, K * (DEPTH + 1) + 1), -1, dtype=torch.int64)  # last column: a sink
    lengths = torch.zeros(num_reqs, dtype=torch.int64)
    codes = torch.zeros(num_reqs, dtype=torch.int64)  # context code of the outputs so far
    roots = torch.full((num_reqs,), PROMPT[-1], dtype=torch.int64)
    for step_index in range(K):
        tree = build_draft_tree(drafter_logits(drafter, table, codes, seed + 2 + step_index), roots, budget)
        if truncate:  # vLLM's scheduler may verify any prefix of the proposed nodes
            num_drafts = torch.randint(0, budget + 1, (num_reqs,), generator=rng)
        else:
            num_drafts = torch.full((num_reqs,), budget)
        valid = torch.arange(budget + 1)[None, :] <= num_drafts[:, None]  # [R, N]
        input_ids = tree.token_ids[valid]  # the scheduled tokens, request after request
        step = build_tree_step(
            num_drafts.tolist(), torch.arange(input_ids.shape[0]), tree.parents, tree.depths,
            list(range(num_reqs)), budget + 1,
        )  # fmt: skip
        tokens = node_tokens(step, input_ids)  # [R, N]
        logits = padded_table[node_context_codes(codes, tokens, step.parents)[valid]]  # [rows, V]
        choices = node_choices(logits, step, batch.metadata(outputs), tokens)
        walk = walk_step(step, choices, tokens, DEPTH)
        for j in range(DEPTH + 1):
            produced = j <= walk.num_accepted  # [R]
            token = walk.output_token_ids[:, j]
            out[torch.arange(num_reqs), torch.where(produced, lengths + j, -1)] = torch.where(produced, token, -1)
            grow = produced & (lengths + j < K - 1)
            codes = torch.where(grow, codes * V + token + 1, torch.where(produced, NUM_CODES, codes))
        lengths = lengths + walk.num_accepted + 1
        roots = out.gather(1, (lengths - 1)[:, None])[:, 0]
        new = out.tolist()
        for r in range(num_reqs):
            outputs[r] = new[r][: int(lengths[r])]
        if int(lengths.min()) >= K:
            break
    assert int(lengths.min()) >= K
    return out[:, :K].numpy()


# --- statistics ---------------------------------------------------------------------------------------------------


def cell_index(samples: np.ndarray) -> np.ndarray:
    return np.ravel_multi_index(tuple(samples.T), (V,) * K)


def chi_square(samples: np.ndarray, joint: np.ndarray) -> ChiSquare:
    """The samples' K-token sequences against the exact joint distribution."""
    return goodness_of_fit(np.bincount(cell_index(samples), minlength=V**K), joint)


def two_sample_chi_square(a: np.ndarray, b: np.ndarray) -> ChiSquare:
    return two_sample(np.bincount(cell_index(a), minlength=V**K), np.bincount(cell_index(b), minlength=V**K))


# --- tests --------------------------------------------------------------------------------------------------------

VARIANTS = {
    "t1.0": Params(),
    "t0.6_topk3": Params(temperature=0.6, top_k=3),
    "t1.3_topp0.8": Params(temperature=1.3, top_p=0.8),
    "t0.9_topk4_topp0.9": Params(temperature=0.9, top_k=4, top_p=0.9),
    "penalties": Params(temperature=0.9, repetition=1.4, frequency=0.5, presence=0.3),
    "penalties_topp": Params(temperature=1.1, repetition=0.8, frequency=-0.3, presence=0.4, top_p=0.85),
    "allowed_tokens": Params(temperature=1.0, allowed=[0, 2, 3]),
    "bad_words": Params(temperature=1.0, bad_words=((2,), (1, 3), (0, 1), (4, 0, 1))),
}


@pytest.mark.parametrize(
    "name, budget, drafter",
    [
        ("t1.0", 7, "random"),
        ("t0.6_topk3", 3, "target_like"),
        ("t1.3_topp0.8", 15, "adversarial"),
        ("t0.9_topk4_topp0.9", 1, "random"),
        ("penalties", 7, "target_like"),
        ("penalties_topp", 15, "random"),
        ("allowed_tokens", 4, "adversarial"),
        ("bad_words", 7, "target_like"),
    ],
)
def test_first_tokens_match_exact_distribution(name, budget, drafter):
    table = target_table()
    params = VARIANTS[name]
    samples = ddtree_samples(table, Batch([params] * NUM_SAMPLES), budget, drafter)
    result = chi_square(samples, exact_joint(table, params))
    print(f"{name} B={budget} {drafter}: {result}")
    assert result.p_value > P_MIN, result


def test_drafter_does_not_change_distribution():
    """Very different drafters (sharp agreement, sharp disagreement, all ties): the same output distribution."""
    table = target_table(seed=3)
    params = Params(temperature=1.0, top_p=0.95)
    joint = exact_joint(table, params)
    runs = {}
    for i, drafter in enumerate(("target_like", "adversarial", "constant")):
        runs[drafter] = ddtree_samples(table, Batch([params] * NUM_SAMPLES), 7, drafter, seed=11 + 10 * i)
        result = chi_square(runs[drafter], joint)
        print(f"{drafter}: {result}")
        assert result.p_value > P_MIN, (drafter, result)
    result = two_sample_chi_square(runs["target_like"], runs["adversarial"])
    print(f"target_like vs adversarial: {result}")
    assert result.p_value > P_MIN, result


def test_mixed_greedy_and_sampled_batch():
    """Greedy rows give the target's greedy sequence; sampled rows in the same batch keep their distribution."""
    table = target_table(seed=5)
    greedy, sampled = Params(temperature=0.0, repetition=1.2), Params(temperature=0.8, top_k=4, repetition=1.2)
    params = [greedy if r % 4 == 0 else sampled for r in range(NUM_SAMPLES)]
    samples = ddtree_samples(table, Batch(params), 7, "random")
    is_greedy = np.array([p is greedy for p in params])
    greedy_joint = exact_joint(table, greedy)
    want = np.unravel_index(int(np.argmax(greedy_joint)), (V,) * K)
    assert greedy_joint.max() == 1.0
    assert (samples[is_greedy] == np.array(want)).all()
    result = chi_square(samples[~is_greedy], exact_joint(table, sampled))
    print(f"mixed batch, sampled rows: {result}")
    assert result.p_value > P_MIN, result


def test_seeded_requests_reproducible_and_exact():
    """Requests with their own generator: same seeds, same tokens (whatever the rest of the batch draws)."""
    table = target_table(seed=7)
    params = Params(temperature=1.0, top_k=4)
    num_reqs = 20_000

    def run(noise_seed: int) -> np.ndarray:
        generators = {r: torch.Generator().manual_seed(1000 + r) for r in range(0, num_reqs, 2)}
        return ddtree_samples(table, Batch([params] * num_reqs, generators), 7, "random", noise_seed=noise_seed)

    first, second = run(0), run(1)
    assert (first[::2] == second[::2]).all()  # seeded rows: identical
    assert (first[1::2] != second[1::2]).any(axis=1).mean() > 0.3  # unseeded rows: fresh noise
    result = chi_square(first, exact_joint(table, params))
    print(f"seeded: {result}")
    assert result.p_value > P_MIN, result


def test_chi_square_detects_a_biased_verifier(monkeypatch):
    """The test has power: penalties that ignore the tokens on a node's own path are rejected."""
    table = target_table()
    params = VARIANTS["penalties"]
    monkeypatch.setattr(sampling, "path_token_counts", lambda step, tokens, vocab: torch.zeros(
        int(step.num_nodes_cpu.sum()), vocab))  # fmt: skip
    samples = ddtree_samples(table, Batch([params] * NUM_SAMPLES), 7, "target_like", truncate=False)
    result = chi_square(samples, exact_joint(table, params))
    print(f"biased verifier: {result}")
    assert result.p_value < 1e-6, result


def test_greedy_respects_allowed_token_ids():
    """All-greedy batch without penalties: the allowed-token mask still applies (vLLM's sampler applies it)."""
    logits = torch.tensor([[5.0, 1.0, 0.0, 2.0, 0.0], [0.0, 4.0, 3.0, 0.0, 0.0]])
    step = build_tree_step([0, 0], torch.arange(2), None, None, [-1, -1], 2)
    mask = torch.tensor([[True, False, True, False, True], [False, True, False, False, False]])
    batch = Batch([Params(temperature=0.0)] * 2)
    metadata = batch.metadata([[], []])
    metadata.allowed_token_ids_mask = mask
    choices = node_choices(logits, step, metadata, torch.tensor([[1, 1], [1, 1]]))
    assert choices.tolist() == [3, 2]


def test_min_tokens_masks_stop_tokens_of_nodes_by_depth():
    """Against brute force: a node's stop tokens are -inf iff len(output) + its depth (walked up its parents) is below
    min_tokens; every other logit is kept, and requests that reached min_tokens (absent from the state) are untouched."""
    from tests.gpu.cases import random_parents

    gen = torch.Generator().manual_seed(5)
    width, vocab = 9, 11
    num_nodes = [9, 6, 4]  # valid nodes per request, root included
    parents = torch.stack([random_parents(n, width, gen) for n in num_nodes])  # [R, N]
    depths = torch.zeros_like(parents)
    for r in range(len(num_nodes)):
        for i in range(1, width):
            depths[r, i] = depths[r, parents[r, i]] + 1
    step = build_tree_step([n - 1 for n in num_nodes], torch.arange(sum(num_nodes)), parents, depths, [0, 1, 2],
                           width)  # fmt: skip
    below_min = {0: (6, [4, 4, 4], {2, 7}, False), 2: (3, [1, 1], {0}, False)}  # request 1 reached its min_tokens
    logits = torch.randn(sum(num_nodes), vocab)
    masked = sampling.mask_stop_tokens_below_min_tokens(logits, sampling.node_requests(step), step, below_min)

    expected, row = logits.clone(), 0
    for r, n in enumerate(num_nodes):
        for node in range(n):
            depth, up = 0, node
            while up != 0:
                up, depth = int(parents[r, up]), depth + 1
            if r in below_min and len(below_min[r][1]) + depth < below_min[r][0]:
                expected[row, sorted(below_min[r][2])] = float("-inf")
            row += 1
    assert torch.equal(masked, expected)
    assert torch.isinf(masked).sum() == torch.isinf(expected).sum() > 0
    assert not torch.isinf(logits).any()  # the input is left alone

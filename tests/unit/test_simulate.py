"""drafter/simulate.py's acceptance rules against brute force: the chain's matching prefix, and the deepest tree node
whose root path is a prefix of the answer."""

import random

import pytest
import torch

from vllm_ddtree.drafter.simulate import chain_policy, tree_policy
from vllm_ddtree.tree import build_draft_tree


def node_paths(tree) -> list[list[int]]:
    """Each node's tokens from the root's child down to it (brute force over parents)."""
    tokens, parents = tree.token_ids[0].tolist(), tree.parents[0].tolist()
    paths = []
    for node in range(len(tokens)):
        path = []
        while node > 0:
            path.append(tokens[node])
            node = parents[node]
        paths.append(path[::-1])
    return paths


def test_chain_policy_counts_the_matching_prefix():
    logits = torch.full((15, 20), -5.0)
    logits[torch.arange(15), torch.arange(15) % 20] = 5.0  # argmax at offset k: token k
    assert chain_policy(logits, 0, list(range(15))) == 15
    assert chain_policy(logits, 0, [0, 1, 2, 9, 4]) == 3
    assert chain_policy(logits, 0, [7]) == 0


def test_tree_policy_is_the_deepest_node_on_the_answer_path():
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    for budget in (1, 5, 16, 40):
        for _ in range(20):
            logits = torch.randn(15, 12, generator=gen) * 2
            root = rng.randrange(12)
            for temperature in (1.0, 0.5, torch.linspace(0.8, 1.6, 15)[:, None]):  # one per depth too
                tree = build_draft_tree((logits / temperature)[None], torch.tensor([root]), budget)
                paths = node_paths(tree)
                # an answer that follows a random node's path, then leaves the tree or goes on at random
                answer = rng.choice(paths) + [rng.randrange(12) for _ in range(15)]
                answer = answer[:15]
                expected = max(len(p) for p in paths if answer[: len(p)] == p)
                assert tree_policy(budget, temperature)(logits, root, answer) == expected


def test_a_one_token_per_depth_tree_accepts_as_the_chain():
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        logits = torch.randn(15, 30, generator=gen)
        answer = logits.argmax(-1).tolist()
        answer[int(torch.randint(0, 15, (1,), generator=gen))] = -1  # a miss somewhere
        assert tree_policy(15, max_topk=1)(logits, 3, answer) == chain_policy(logits, 3, answer)


def test_replaying_sampled_answers_gives_the_expected_acceptance_at_temperature():
    """At T > 0 the engine's walk follows the target's own sample at each node, so its expected accepted depth in a
    step is the sum over draft nodes of the target's probability of the node's path. Replaying answers sampled from
    the target (the deepest node on the sampled answer's path) must average to that sum: brute force over the tree
    against a toy Markov target, for DDTree trees and for the chain (a tree of one token per depth)."""
    vocab, depth, samples = 6, 5, 1500
    gen = torch.Generator().manual_seed(2)
    for temperature in (0.7, 1.0):
        transition = torch.softmax(torch.randn(vocab, vocab, generator=gen) * 2 / temperature, -1)  # p(next | last)
        logits = torch.randn(depth, vocab, generator=gen) * 2  # the drafter's block
        root = 1
        for budget, max_topk in ((4, None), (12, None), (depth, 1)):
            tree = build_draft_tree(logits[None], torch.tensor([root]), budget, max_topk)
            exact = 0.0  # sum over non-root nodes of the target's probability of the node's path
            for path in node_paths(tree)[1:]:
                prob, last = 1.0, root
                for token in path:
                    prob, last = prob * transition[last, token].item(), token
                exact += prob
            policy = tree_policy(budget, max_topk=max_topk)
            draws = []
            for _ in range(samples):  # answers sampled from the target, one token after another
                answer, last = [], root
                for _ in range(depth):
                    last = int(torch.multinomial(transition[last], 1, generator=gen))
                    answer.append(last)
                draws.append(policy(logits, root, answer))
            mean = sum(draws) / samples
            spread = (sum((d - mean) ** 2 for d in draws) / samples) ** 0.5 / samples**0.5
            assert abs(mean - exact) <= 4 * spread + 1e-9, (temperature, budget, mean, exact, spread)


def test_the_simulation_scripts_interval_resamples_prompts():
    """simulate_tree_acceptance.py's bootstrap interval: degenerate when every prompt accepts alike, around the
    pooled acceptance length otherwise, and wider for fewer prompts; per-prompt counts add up to the totals."""
    from tests.unit.test_benchmark_script import load_script

    script = load_script("simulate_tree_acceptance.py")
    assert script.bootstrap_interval([(10, 15)] * 8) == [2.5, 2.5]
    varied = [(10, 5), (10, 25), (20, 30), (5, 10)] * 4  # pooled: 1 + 70 / 45
    low, high = script.bootstrap_interval(varied)
    assert low < 1 + 70 / 45 < high
    few_low, few_high = script.bootstrap_interval(varied[:4])
    assert few_high - few_low > high - low
    counts = [{"chain": (10, 5), "B16": (8, 9)}, {"chain": (4, 1), "B16": (3, 2)}]
    assert script.summed(counts, ["chain", "B16"]) == {"chain": (14, 6), "B16": (11, 11)}
    assert script.summed([], ["chain"]) == {"chain": (0, 0)}


def test_the_simulation_scripts_comparison_of_two_runs(tmp_path, capsys):
    """`--compare A B`: A - B per draft with a bootstrap interval that excludes 0 for a clear gap and holds it for
    two samples of the same prompts; printed as a table row per draft both runs have."""
    import json

    from tests.unit.test_benchmark_script import load_script

    script = load_script("simulate_tree_acceptance.py")
    low = [(10, 5), (10, 8), (12, 6), (9, 5)] * 8  # ~1.6
    high = [(10, 15), (10, 18), (12, 16), (9, 14)] * 8  # ~2.5
    (interval, share) = script.bootstrap_difference(high, low)
    assert 0 < interval[0] < interval[1] and share == 0.0
    (same, same_share) = script.bootstrap_difference(low, list(reversed(low)))
    assert same[0] < 0 < same[1] and 0.2 < same_share < 0.8
    for name, counts in (("a", high), ("b", low)):
        run = {"0": {"per_prompt": {"chain": counts, "B32 T1": counts}}}
        (tmp_path / f"{name}.json").write_text(json.dumps({"by_answer_temperature": run}))
    script.compare_runs(str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| T = 0")]
    assert [row.split(" | ")[1] for row in rows] == ["chain", "B32 T1"]
    assert "| 0.000 |" in rows[0]


def test_the_simulation_scripts_per_source_counts():
    import argparse

    from tests.unit.test_benchmark_script import load_script

    script = load_script("simulate_tree_acceptance.py")
    parser = argparse.ArgumentParser()
    assert script.parse_per_source(parser, None) is None
    assert script.parse_per_source(parser, ["sharegpt=32", "humaneval=4"]) == {"sharegpt": 32, "humaneval": 4}
    for bad in (["sharegpt"], ["sharegpt=0"], ["wiki=3"], ["mtbench=2", "mtbench=3"]):
        with pytest.raises(SystemExit):
            script.parse_per_source(parser, bad)

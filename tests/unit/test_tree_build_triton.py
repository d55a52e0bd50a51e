"""The Triton best-first builder (vllm_ddtree/tree/triton_build.py) gives exactly the torch builder's trees.

CI has no GPU, so the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, numpy on the CPU) in a
subprocess (the switch is read when the kernel is defined). The torch builder is itself checked against brute
force in test_tree_build.py. Cases: budgets around and far from the depth, ties (logits on a coarse grid),
-inf logits, max_topk caps, one and several requests.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest


def cases():
    for depth, vocab, budget, max_topk, grid in itertools.product(
        (1, 2, 5, 15), (3, 40), (1, 2, 3, 7, 8, 15, 16, 17, 31, 64), (None, 2), (None, 0.5)
    ):
        yield depth, vocab, budget, max_topk, grid


def compare(seed: int = 0) -> int:
    import torch

    from vllm_ddtree.tree.build import _check_args, _top_tokens, _topk_k, build_draft_tree, max_tree_nodes
    from vllm_ddtree.tree.triton_build import best_first_tree

    gen = torch.Generator().manual_seed(seed)
    checked = 0
    for depth, vocab, budget, max_topk, grid in cases():
        if budget > max_tree_nodes(depth, vocab, max_topk, budget):
            continue
        for num_req in (3,):  # several programs; one request alone adds nothing the kernel would do differently
            logits = torch.randn(num_req, depth, vocab, generator=gen) * 3
            if grid:
                logits = (logits / grid).round() * grid  # many equal logits, hence equal scores
            logits[torch.rand(logits.shape, generator=gen) < 0.1] = float("-inf")
            logits[..., 0] = logits[..., 0].clamp(min=-5.0)  # keep a finite token per depth
            roots = torch.randint(0, vocab, (num_req,), generator=gen)
            expected = build_draft_tree(logits, roots, budget, max_topk)
            _check_args(logits, roots, budget, max_topk)
            tok, lp = _top_tokens(logits, _topk_k(vocab, max_topk, budget))
            got = best_first_tree(lp, tok, roots, budget + 1)
            case = dict(depth=depth, vocab=vocab, budget=budget, max_topk=max_topk, grid=grid, num_req=num_req)
            for name, value in zip(("token_ids", "parents", "depths", "log_probs"), got):
                assert torch.equal(value, getattr(expected, name)), (case, name, value, getattr(expected, name))
            checked += 1
    return checked


@pytest.mark.slow
def test_triton_builder_matches_torch_builder_in_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert int(run.stdout.split()[-1]) > 100  # cases checked


if __name__ == "__main__":
    print("cases checked:", compare())

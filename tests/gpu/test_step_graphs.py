"""graphs.StepGraphs on CUDA: a block of per-step ops replayed from a CUDA graph per shape gives what running it
eagerly gives, step after step with new inputs, in-place writes to persistent buffers included."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def test_replays_equal_eager_runs_with_new_inputs_and_in_place_writes():
    from vllm_ddtree.graphs import StepGraphs
    from vllm_ddtree.tree import build_draft_tree
    from vllm_ddtree.tree.triton_walk import walk_and_moves_triton_

    device = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(0)
    num_reqs, depth, budget = 3, 4, 9
    width = budget + 1
    positions_graphed = torch.zeros(num_reqs * width, dtype=torch.int64, device=device)  # a persistent buffer
    positions_eager = positions_graphed.clone()
    node_index = torch.arange(num_reqs * width, device=device).view(num_reqs, width)
    num_nodes = torch.full((num_reqs,), width, device=device)

    def block(tokens, parents, target, positions):
        return walk_and_moves_triton_(tokens, parents, target, num_nodes, depth, node_index, num_nodes, positions)

    graphs = StepGraphs()
    for step in range(5):
        tree = build_draft_tree(torch.randn(num_reqs, depth, 30, generator=gen).to(device) * 3,
                                torch.arange(num_reqs, device=device), budget)  # fmt: skip
        target = torch.where(torch.rand(num_reqs, width, generator=gen).to(device) < 0.7, tree.token_ids, 0)
        target = target.gather(1, torch.randperm(width, generator=gen).to(device).expand(num_reqs, -1))
        positions_graphed.copy_(torch.randint(0, 1000, (num_reqs * width,), generator=gen))  # the walk rewrites them
        positions_eager.copy_(positions_graphed)
        inputs = dict(tokens=tree.token_ids, parents=tree.parents, target=target)
        got = graphs.run("walk", lambda **kw: block(**kw, positions=positions_graphed), inputs)
        want = block(**inputs, positions=positions_eager)
        for a, b in zip(got, want):
            assert torch.equal(a, b), step
        assert torch.equal(positions_graphed, positions_eager), step
        assert len(graphs) == (1 if step >= 1 else 0)  # eager first, captured at the second call

"""The Triton tree kernels give exactly the tensor-op versions' results: the best-first builder
(tree/triton_build.py) the torch builder's trees (also written by request slot, Model Runner V2's form), the
ancestor mask (tree/triton_layout.py) and the walk
(tree/triton_walk.py) the pointer-doubling versions' masks and paths, and its fused form (walk + accepted-path
moves + sampler output) the verify.scorer functions' results, and the step layout (verify/triton_step.py)
`build_tree_step`'s torch path, and the FULL-graph tree inputs (tree/triton_layout.py) the persistent builder's
torch ops, and the in-graph uniform step layout (`uniform_step_inputs_triton_`) its torch version, on every tree
built here (the torch version is checked against the host path in test_runner_v2_contract.py).

CI has no GPU, so the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, numpy on the CPU) in a
subprocess (the switch is read when the kernel is defined). The torch builder is itself checked against brute
force in test_tree_build.py. Cases: budgets around and far from the depth, ties (logits on a coarse grid),
-inf logits, max_topk caps (1: the chain), one and several requests.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
from unittest import mock

import pytest


def cases():
    for depth, vocab, budget, max_topk, grid in itertools.product(
        (1, 2, 5, 15), (3, 40), (1, 2, 3, 7, 8, 15, 16, 17, 31, 64), (None, 1, 2), (None, 0.5)
    ):
        yield depth, vocab, budget, max_topk, grid


def compare(seed: int = 0) -> int:
    import torch

    from vllm_ddtree.tree.build import _check_args, build_draft_tree, max_tree_nodes, top_tokens, topk_per_depth
    from vllm_ddtree.tree.layout import ancestor_mask
    from vllm_ddtree.tree.triton_build import best_first_tree
    from vllm_ddtree.tree.triton_layout import ancestor_mask_triton
    from vllm_ddtree.tree.triton_walk import walk_tree_triton
    from vllm_ddtree.tree.walk import walk_tree

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
            tok, lp = top_tokens(logits, topk_per_depth(vocab, max_topk, budget))
            got = best_first_tree(lp, tok, roots, budget + 1)
            case = dict(depth=depth, vocab=vocab, budget=budget, max_topk=max_topk, grid=grid, num_req=num_req)
            for name, value in zip(("token_ids", "parents", "depths", "log_probs"), got):
                assert torch.equal(value, getattr(expected, name)), (case, name, value, getattr(expected, name))
            assert torch.equal(ancestor_mask_triton(expected.parents), ancestor_mask(expected.parents)), case
            if checked % 5 == 0:  # a fifth of the cases (the interpreter is slow): the slot form only moves rows
                check_trees_by_slot(lp, tok, roots, expected, gen, case)
            check_walk(expected, depth, gen, walk_tree, walk_tree_triton, case, with_kv=vocab == 40 and grid is None)
            check_step_layout(expected, gen, case)
            check_padded_tree_inputs(expected, gen, case)
            if checked % 3 == 0:
                check_uniform_step_inputs(expected, gen, case)
            checked += 1
    return checked


def check_trees_by_slot(lp, tok, roots, expected, gen, case) -> None:
    """Model Runner V2's form: roots read and parents/depths written by request slot (int32 slots, as V2's
    idx_mapping), other slots' rows untouched."""
    import torch

    from vllm_ddtree.tree.triton_build import best_first_tree

    num_req, n = expected.parents.shape
    num_slots = num_req + 3
    slots = torch.randperm(num_slots, generator=gen)[:num_req]
    last_tokens = torch.full((num_slots,), -5, dtype=torch.int64)
    last_tokens[slots] = roots
    parents = torch.full((num_slots, n), -9, dtype=torch.int64)
    depths = parents.clone()
    token_ids, *_ = best_first_tree(lp, tok, last_tokens, n, slots=slots.to(torch.int32), parents=parents,
                                    depths=depths)  # fmt: skip
    assert torch.equal(token_ids, expected.token_ids), case
    assert torch.equal(parents[slots], expected.parents) and torch.equal(depths[slots], expected.depths), case
    others = torch.ones(num_slots, dtype=torch.bool)
    others[slots] = False
    assert (parents[others] == -9).all() and (depths[others] == -9).all(), case


def check_walk(tree, depth: int, gen, walk_tree, walk_tree_triton, case, with_kv: bool) -> None:
    """Targets that mostly follow the tree (long paths), on a random prefix of the node list; `with_kv`: the
    fused launch compacts paged KV too (`check_walk_and_moves`)."""
    import torch

    num_req, n = tree.token_ids.shape
    device = tree.token_ids.device  # random draws on the CPU generator `gen`, then moved
    # The target's choice at node u: the token of a random node whose parent is u (when one exists), or noise.
    follow = torch.full((num_req, n), -7, dtype=torch.int64, device=device)
    for j in torch.randperm(n, generator=gen).tolist():
        if j:
            follow.scatter_(1, tree.parents[:, j : j + 1], tree.token_ids[:, j : j + 1])
    noise = torch.randint(0, 50, (num_req, n), generator=gen).to(device)
    target = torch.where((follow >= 0) & (torch.rand(num_req, n, generator=gen).to(device) < 0.85), follow, noise)
    num_nodes = torch.randint(1, n + 1, (num_req,), generator=gen).to(device)
    expected = walk_tree(tree.token_ids, tree.parents, tree.depths, target, num_nodes, depth)
    got = walk_tree_triton(tree.token_ids, tree.parents, target, num_nodes, depth)
    for name, value in zip(("path_nodes", "num_accepted", "output_token_ids"), got):
        assert torch.equal(value, getattr(expected, name)), (case, name, value, getattr(expected, name))
    check_walk_and_moves(tree, depth, gen, target, num_nodes, expected, case, with_kv)


def check_step_layout(tree, gen, case) -> None:
    """verify/triton_step.py's layout kernel against `build_tree_step`'s torch path (+ `tree_positions_`): a
    batch mixing kept trees (drafts truncated the way vLLM's scheduler may), placeholder drafts without a kept
    tree, and requests without drafts, laid out among other scheduled tokens (int32 logits indices)."""
    import torch

    from vllm_ddtree.verify.step import build_tree_step
    from vllm_ddtree.verify.triton_step import tree_step_layout_triton_

    kept_trees, width = tree.parents.shape
    device = tree.parents.device  # random draws on the CPU generator `gen`, then moved
    num_reqs = 6
    kind = torch.randint(0, 3, (num_reqs,), generator=gen).tolist()  # 0 kept tree, 1 placeholders, 2 no drafts
    prev_rows = [int(torch.randint(0, kept_trees, (1,), generator=gen)) if k == 0 else -1 for k in kind]
    num_draft = [int(torch.randint(1, width, (1,), generator=gen)) if k < 2 else 0 for k in kind]
    num_logits = sum(num_draft) + num_reqs
    num_tokens = num_logits + 7  # prefill tokens without logits sit among them
    logits_indices = torch.randperm(num_tokens, generator=gen)[:num_logits].sort().values.to(torch.int32).to(device)
    positions = torch.randint(0, 500, (num_tokens,), generator=gen).to(device)
    expected_positions = positions.clone()
    with torch_tree_kernels():
        step = build_tree_step(num_draft, logits_indices, tree.parents, tree.depths, prev_rows, width,
                               positions=expected_positions)  # fmt: skip
    kept_rows = torch.tensor([r if n else -1 for r, n in zip(prev_rows, num_draft)], device=device)
    for with_positions, rows_dtype in ((True, torch.int64), (False, torch.int32)):  # int32: V2's idx_mapping
        got_positions = positions.clone()
        got = tree_step_layout_triton_(step.num_nodes, step.node_rows, kept_rows.to(rows_dtype), tree.parents,
                                       tree.depths, logits_indices, got_positions if with_positions else None)  # fmt: skip
        for name, value in zip(("parents", "depths", "node_token_index"), got):
            assert torch.equal(value, getattr(step, name)), (case, kind, name, value, getattr(step, name))
        assert torch.equal(got_positions, expected_positions if with_positions else positions), (case, kind)


def check_padded_tree_inputs(tree, gen, case) -> None:
    """tree/triton_layout.py's FULL-graph inputs kernel against the torch ops of `_build_persistent`: masks, node
    counts and context lengths of the requests, zeros for the padding requests after them."""
    import torch

    from vllm_ddtree.tree.layout import ancestor_mask
    from vllm_ddtree.tree.triton_layout import padded_tree_inputs_triton_

    num_reqs, width = tree.parents.shape
    device = tree.parents.device
    padded = num_reqs + int(torch.randint(0, 3, (1,), generator=gen))
    num_nodes = torch.randint(1, width + 1, (num_reqs,), generator=gen)
    seq_lens = torch.zeros(padded, dtype=torch.int32)
    seq_lens[:num_reqs] = num_nodes.to(torch.int32) + torch.randint(0, 300, (num_reqs,), generator=gen, dtype=torch.int32)
    num_nodes, seq_lens = num_nodes.to(device), seq_lens.to(device)
    node_mask = torch.full((padded, width, width), 7, dtype=torch.uint8, device=device)  # poisoned: all written
    got_num_nodes = torch.full((padded,), -9, dtype=torch.int32, device=device)
    context_lens = torch.full((padded,), -9, dtype=torch.int32, device=device)
    padded_tree_inputs_triton_(tree.parents, num_nodes, seq_lens, node_mask, got_num_nodes, context_lens)
    with torch_tree_kernels():
        want_mask = ancestor_mask(tree.parents)
    assert torch.equal(node_mask[:num_reqs].bool(), want_mask), case
    assert not node_mask[num_reqs:].any() and node_mask.max() <= 1, case
    want_num_nodes = torch.cat([num_nodes, num_nodes.new_zeros(padded - num_reqs)]).to(torch.int32)
    assert torch.equal(got_num_nodes, want_num_nodes), case
    assert torch.equal(context_lens, seq_lens - want_num_nodes), case


def check_uniform_step_inputs(tree, gen, case) -> None:
    """tree/triton_layout.py's in-graph uniform step kernel against `verify.step.uniform_step_inputs_`'s torch ops:
    requests reading the kept trees of random slots, chains (slot -2), padding requests (slot -1) after them,
    n <= N nodes each; outputs poisoned beforehand."""
    import torch

    from vllm_ddtree.tree.triton_layout import uniform_step_inputs_triton_
    from vllm_ddtree.verify.step import uniform_step_inputs_

    num_slots, width = tree.parents.shape
    device = tree.parents.device
    num_reqs = int(torch.randint(1, num_slots + 1, (1,), generator=gen))
    padded = num_reqs + int(torch.randint(0, 3, (1,), generator=gen))
    num_nodes = int(torch.randint(1, width + 1, (1,), generator=gen))
    slots = torch.full((padded,), -1, dtype=torch.int64)
    slots[:num_reqs] = torch.randperm(num_slots, generator=gen)[:num_reqs]
    slots[:num_reqs][torch.rand(num_reqs, generator=gen) < 0.3] = -2  # prefill chunks of n tokens: chains
    seq_lens = torch.zeros(padded, dtype=torch.int32)
    seq_lens[:num_reqs] = num_nodes + torch.randint(0, 300, (num_reqs,), generator=gen, dtype=torch.int32)
    positions = torch.randint(0, 500, (padded * num_nodes,), generator=gen)
    slots, seq_lens, positions = slots.to(device), seq_lens.to(device), positions.to(device)
    outputs = {}
    for name, run in (("triton", uniform_step_inputs_triton_), ("torch", uniform_step_inputs_)):
        got = dict(
            positions=positions.clone(),
            parents=torch.full((padded, width), -9, dtype=torch.int64, device=device),
            depths=torch.full((padded, width), -9, dtype=torch.int64, device=device),
            node_mask=torch.full((padded, width, width), 7, dtype=torch.uint8, device=device),
            num_nodes=torch.full((padded,), -9, dtype=torch.int32, device=device),
            context_lens=torch.full((padded,), -9, dtype=torch.int32, device=device),
        )
        with torch_tree_kernels() if name == "torch" else contextlib.nullcontext():
            run(slots, tree.parents, tree.depths, seq_lens, got["positions"], got["parents"], got["depths"],
                got["node_mask"], got["num_nodes"], got["context_lens"], num_nodes)  # fmt: skip
        outputs[name] = got
    triton_out, torch_out = outputs["triton"], outputs["torch"]
    for name in ("positions", "node_mask", "num_nodes", "context_lens"):
        assert torch.equal(triton_out[name], torch_out[name]), (case, name, triton_out[name], torch_out[name])
    for name in ("parents", "depths"):  # rows of padding requests are unspecified
        assert torch.equal(triton_out[name][:num_reqs], torch_out[name][:num_reqs]), (case, name)
    assert not triton_out["node_mask"][num_reqs:].any() and triton_out["node_mask"].max() <= 1, case


def torch_tree_kernels():
    """A context running the tensor-op versions also on CUDA (the references; on the CPU they run anyway)."""
    return mock.patch.dict(os.environ, {"VLLM_DDTREE_TREE_KERNELS": "torch"})


def check_walk_and_moves(tree, depth: int, gen, target, num_nodes, expected_walk, case, with_kv: bool) -> None:
    """The fused launch (walk + accepted-path moves + sampler output + chain positions) against
    `accepted_path_moves`, `sampled_token_ids` and `chain_positions_` on the torch walk. Requests lay out at least
    the walked nodes (more: a placeholder request walks its root only), consecutively, padding aliasing the last
    laid-out node as in `TreeStep`. `with_kv`: the launch also compacts two layers' paged KV, against the torch
    compaction (`PagedKV.copy_slots`) of the expected moves."""
    import numpy as np
    import torch

    from vllm_ddtree.tree.triton_walk import walk_and_moves_triton_
    from vllm_ddtree.verify.scorer import accepted_path_moves, sampled_token_ids
    from vllm_ddtree.verify.step import TreeStep, chain_positions_

    num_req, n = tree.token_ids.shape
    device = tree.token_ids.device
    laid_out = torch.maximum(num_nodes, torch.randint(1, n + 1, (num_req,), generator=gen).to(device))  # [R]
    start = torch.cumsum(laid_out, 0) - laid_out
    node = torch.arange(n, device=device)[None, :]
    node_index = start[:, None] + torch.minimum(node, laid_out[:, None] - 1)  # [R, N]
    step = TreeStep(num_nodes=laid_out, parents=tree.parents, depths=tree.depths, node_rows=node_index,
                    node_token_index=node_index, num_nodes_cpu=laid_out.cpu().numpy(),
                    tree_reqs_cpu=np.arange(num_req))
    # Tree positions as the step laid them out: root position + depth (a padded entry repeats its alias).
    root_positions = torch.randint(0, 1000, (num_req,), generator=gen).to(device)
    positions = torch.full((int(laid_out.sum()) + 3,), -5, dtype=torch.int64, device=device)  # 3 tokens of no request
    local_node = node_index - start[:, None]  # [R, N]
    positions[node_index.flatten()] = (root_positions[:, None] + tree.depths.gather(1, local_node)).flatten()
    expected_positions = positions.clone()
    chain_positions_(expected_positions, step)
    # The kernel reads node tokens and choices through the step's indices: scatter them to token / logits rows
    # (only laid-out nodes: a padded entry aliases the last one). Logits rows in reverse order of the tokens.
    num_tokens = positions.shape[0]
    laid = node < laid_out[:, None]  # [R, N]
    input_ids = torch.full((num_tokens,), -7, dtype=torch.int32, device=device)
    input_ids[node_index[laid]] = tree.token_ids[laid].to(torch.int32)
    node_rows = num_tokens - 1 - node_index  # [R, N]
    choices = torch.full((num_tokens,), -9, dtype=torch.int64, device=device)
    choices[node_rows[laid]] = target[laid]
    caches, kv = paged_caches(num_tokens, gen, device) if with_kv else ([], None)
    expected_caches = [c.clone() for c in caches]
    *walk, src, dst, sampled = walk_and_moves_triton_(
        input_ids, tree.parents, choices, num_nodes, depth, node_index, node_rows, laid_out, positions, kv
    )
    assert torch.equal(positions, expected_positions), (case, positions, expected_positions)
    for name, value in zip(("path_nodes", "num_accepted", "output_token_ids"), walk):
        assert torch.equal(value, getattr(expected_walk, name)), (case, name)
    expected_src, expected_dst = accepted_path_moves(step, expected_walk)
    assert torch.equal(src.flatten(), expected_src), (case, src, expected_src)
    assert torch.equal(dst.flatten(), expected_dst), (case, dst, expected_dst)
    expected_sampled = sampled_token_ids(expected_walk, n).to(torch.int32)
    assert torch.equal(sampled, expected_sampled), (case, sampled, expected_sampled)
    for got, want in zip(caches, expected_caches):
        from vllm_ddtree.kv.paged import PagedKV

        slots = kv[1].to(torch.int64)
        PagedKV.for_packed(want, HEAD_DIM).copy_slots(slots[expected_src], slots[expected_dst])
        assert torch.equal(got, want), case


HEAD_DIM = 8


def paged_caches(num_tokens: int, gen, device):
    """Two layers' paged KV caches (float32, page 4, 2 heads, `HEAD_DIM`, keys and values packed as
    in vLLM 0.26's GPU caches) and the walk's `kv` for them: (LayerTable, [num_tokens] slot mapping, a random slot per token)."""
    import torch

    from vllm_ddtree.kv.paged import PagedKV
    from vllm_ddtree.kv.triton_compact import LayerTable

    page, heads = 4, 2
    num_blocks = (num_tokens + 5) // page + 1
    caches = [torch.randn((num_blocks, page, heads, 2 * HEAD_DIM), generator=gen).to(device).permute(0, 2, 1, 3)
              for _ in range(2)]  # fmt: skip
    views = [PagedKV.for_packed(c, HEAD_DIM) for c in caches]
    slot_mapping = torch.randperm(num_blocks * page, generator=gen)[:num_tokens].to(device, torch.int32)
    return caches, (LayerTable([v.keys for v in views], [v.values for v in views]), slot_mapping)


@pytest.mark.slow
def test_triton_builder_matches_torch_builder_in_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert int(run.stdout.split()[-1]) > 100  # cases checked


if __name__ == "__main__":
    print("cases checked:", compare())

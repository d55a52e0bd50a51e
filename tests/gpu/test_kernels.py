"""GPU kernels against the pure-torch reference on random inputs: tree attention and KV compaction.

Skipped without CUDA. `TRITON_INTERPRET=1` runs a few small cases on the CPU through Triton's interpreter
(useful to check a kernel's logic without a GPU; slow, so the big grid needs CUDA).
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from tests.gpu.cases import make_case

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else ("cpu" if INTERPRET else None)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEVICE is None, reason="needs CUDA (or TRITON_INTERPRET=1)")]

# Relative error bounds ||out - ref|| / ||ref|| (METHOD.md): float32 exact-path arithmetic; bf16 operands.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1.5e-2, torch.float16: 5e-3}

if INTERPRET:
    # (the interpreter mishandles bf16 dot products: float16 stands in for the 16-bit path)
    GRID = [(2, 3, 40, (4, 2), 32, torch.float32), (1, 7, 70, (2, 2), 32, torch.float16)]
else:
    # (batch, B, context) sweep with the head shape rotating, then every head shape at one size.
    HEADS = [((32, 8), 128, torch.bfloat16), ((8, 8), 64, torch.float32), ((16, 2), 128, torch.float32),
             ((8, 1), 64, torch.bfloat16), ((28, 4), 128, torch.bfloat16), ((32, 8), 64, torch.float32)]
    GRID = [
        (b, budget, ctx, *HEADS[i % len(HEADS)])
        for i, (b, budget, ctx) in enumerate(itertools.product([1, 8, 64], [1, 15, 128], [1, 1000, 8192]))
    ] + [
        (8, 15, 1000, gqa, hd, dt)
        for gqa, hd, dt in itertools.product([(32, 8), (8, 8), (8, 1), (12, 4)], [64, 128], [torch.bfloat16,
                                                                                             torch.float32])
    ]  # fmt: skip


def _ids(case) -> str:
    b, budget, ctx, (hq, hkv), hd, dt = case
    return f"b{b}-B{budget}-ctx{ctx}-h{hq}x{hkv}-d{hd}-{str(dt).split('.')[-1]}"


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def _check_tree_attention(case_args, seed: int, num_splits: int | None = None) -> float:
    from vllm_ddtree.attention.reference import tree_attention_reference_
    from vllm_ddtree.attention.triton_tree import tree_attention_triton_

    b, budget, ctx, (hq, hkv), hd, dtype = case_args
    case = make_case(b, budget, ctx, hq, hkv, hd, dtype, DEVICE, seed=seed)
    ref = torch.full_like(case.query, float("nan"))
    tree_attention_reference_(case.query, case.kv, case.tree, case.scale, ref)
    out = torch.full_like(case.query, float("nan"))  # poisoned: every tree row must be written
    t = case.tree
    tree_attention_triton_(
        case.query, case.kv.keys, case.kv.values, t.block_table, t.query_start, t.seq_lens, t.num_nodes,
        t.node_mask, t.max_seq_len, case.scale, out, num_splits=num_splits,
    )  # fmt: skip
    rows = case.tree_rows
    assert torch.isfinite(out[rows]).all(), "tree rows left unwritten or NaN"
    assert torch.isnan(out[~rows]).all(), "rows outside the trees were written"
    err = _relative_error(out[rows], ref[rows])
    assert err < TOLERANCE[dtype], f"relative error {err:.2e} for {_ids(case_args)}"
    return err


@pytest.mark.parametrize("case_args", GRID, ids=_ids)
def test_tree_attention_matches_reference(case_args):
    _check_tree_attention(case_args, seed=hash(_ids(case_args)) % 1000)


@pytest.mark.parametrize("num_splits", [1, 2, 7] if not INTERPRET else [1, 3])
def test_tree_attention_forced_splits(num_splits):
    case = (3, 15, 900, (8, 2), 64, torch.float32) if not INTERPRET else (2, 4, 50, (4, 2), 32, torch.float32)
    _check_tree_attention(case, seed=11 + num_splits, num_splits=num_splits)


# Split-path cases besides the grid's: no context; more tree keys (21) than a 16-key block.
SPLIT_EXTRA = [(3, 5, 0, (4, 2), 32, torch.float32), (2, 20, 30, (4, 2), 32, torch.float32)]


@pytest.mark.parametrize("launch", [None, (16, 16), (32, 16), (16, 16, 2, 1), (32, 16, 4, 2, 1)],
                         ids=["default", "m16n16", "m32n16", "m16n16w2s1", "early_context"])
@pytest.mark.parametrize("case_args", GRID[:: max(1, len(GRID) // 8)] + SPLIT_EXTRA, ids=_ids)
def test_split_tree_attention_matches_reference(case_args, launch):
    """The split design: context attention with LSE (pure torch here, FA3 in the layer) + tree part + merge.
    Requests without context get what FlashAttention may return there (NaN output, +inf LSE): weight 0."""
    from tests.gpu.cases import context_attention_with_lse
    from vllm_ddtree.attention.reference import tree_attention_reference_
    from vllm_ddtree.attention.triton_tree import tree_attention_split_

    b, budget, ctx, (hq, hkv), hd, dtype = case_args
    case = make_case(b, budget, ctx, hq, hkv, hd, dtype, DEVICE, seed=7)
    ref = torch.full_like(case.query, float("nan"))
    tree_attention_reference_(case.query, case.kv, case.tree, case.scale, ref)
    context_out, context_lse = context_attention_with_lse(case)
    t = case.tree
    for r, num_nodes in enumerate(t.num_nodes_cpu):
        if int(t.seq_lens[r]) == num_nodes:  # no context
            rows_r = slice(int(t.query_start[r]), int(t.query_start[r]) + num_nodes)
            context_out[rows_r], context_lse[:, rows_r] = float("nan"), float("inf")
    out = torch.full_like(case.query, float("nan"))
    tree_attention_split_(
        case.query, case.kv.keys, case.kv.values, t.block_table, t.query_start, t.seq_lens, t.num_nodes,
        t.node_mask, t.max_seq_len, case.scale, context_out, context_lse, out, launch=launch,
    )  # fmt: skip
    rows = case.tree_rows
    assert torch.isfinite(out[rows]).all() and torch.isnan(out[~rows]).all()
    err = _relative_error(out[rows], ref[rows])
    assert err < TOLERANCE[dtype], f"relative error {err:.2e} for {_ids(case_args)}"


@pytest.mark.parametrize("split", [False, True], ids=["one_pass", "split"])
def test_tree_attention_persistent_layout(split):
    """The FULL-CUDA-graph layout: int32 metadata, uint8 masks and padding requests with 0 nodes (nothing written
    for them), same result as the reference."""
    from tests.gpu.cases import as_persistent_layout, context_attention_with_lse
    from vllm_ddtree.attention.reference import tree_attention_reference_
    from vllm_ddtree.attention.triton_tree import tree_attention_split_, tree_attention_triton_

    b, budget, ctx, (hq, hkv), hd, dtype = GRID[0]
    case = make_case(b, budget, ctx, hq, hkv, hd, dtype, DEVICE, seed=5)
    ref = torch.full_like(case.query, float("nan"))
    tree_attention_reference_(case.query, case.kv, case.tree, case.scale, ref)
    t = as_persistent_layout(case.tree, padding=3)
    out = torch.full_like(case.query, float("nan"))
    args = (case.query, case.kv.keys, case.kv.values, t.block_table, t.query_start, t.seq_lens, t.num_nodes,
            t.node_mask, t.max_seq_len, case.scale)  # fmt: skip
    if split:
        tree_attention_split_(*args, *context_attention_with_lse(case), out)
    else:
        tree_attention_triton_(*args, out)
    rows = case.tree_rows
    assert torch.isfinite(out[rows]).all() and torch.isnan(out[~rows]).all()
    assert _relative_error(out[rows], ref[rows]) < TOLERANCE[dtype]


def _random_moves(num_reqs: int, moves: int, slots_per_req: int, gen: torch.Generator):
    """Per request: nodes 1..moves+... get slots; the accepted path p_1 < p_2 < ... with p_d >= d moves to d."""
    src, dst = [], []
    perm = torch.randperm(num_reqs * slots_per_req, generator=gen)
    for r in range(num_reqs):
        node_slot = perm[r * slots_per_req : (r + 1) * slots_per_req]  # slot of node i
        accepted = int(torch.randint(0, moves + 1, (), generator=gen))
        path = sorted(torch.randperm(slots_per_req - 1, generator=gen)[:accepted].add(1).tolist())
        path = [max(p, d + 1) for d, p in enumerate(path)]
        for d in range(1, len(path)):  # keep it strictly increasing after the clamp
            path[d] = max(path[d], path[d - 1] + 1)
        path = [p for p in path if p < slots_per_req]
        for m in range(moves):
            target = node_slot[m + 1]
            source = node_slot[path[m]] if m < len(path) else target
            src.append(int(source))
            dst.append(int(target))
    return torch.tensor(src).view(num_reqs, moves), torch.tensor(dst).view(num_reqs, moves)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32] if not INTERPRET else [torch.float16, torch.float32])
@pytest.mark.parametrize("num_reqs,moves", [(1, 1), (8, 15), (33, 63)] if not INTERPRET else [(3, 4)])
def test_compaction_matches_reference(dtype, num_reqs, moves):
    from vllm_ddtree.kv.paged import PagedKV
    from vllm_ddtree.kv.triton_compact import LayerTable, compact_kv_triton_

    gen = torch.Generator().manual_seed(num_reqs * 100 + moves)
    page, heads, hd, layers = 16, 4 if INTERPRET else 8, 32 if INTERPRET else 128, 3 if INTERPRET else 36
    slots_per_req = moves + 1 + 2
    num_blocks = (num_reqs * slots_per_req + page - 1) // page + 1
    caches = [
        torch.randn((num_blocks, page, heads, 2 * hd), generator=gen).to(dtype).to(DEVICE).permute(0, 2, 1, 3)
        for _ in range(layers)
    ]
    expected = [c.clone() for c in caches]
    src, dst = _random_moves(num_reqs, moves, slots_per_req, gen)  # [R, M] slots
    # The kernel takes scheduled-token indices and the step's slot mapping: tokens in shuffled order here.
    slot_mapping = torch.randperm(num_blocks * page, generator=gen)  # [num_tokens] token -> slot
    token_of_slot = torch.argsort(slot_mapping)
    for c in expected:
        PagedKV.for_packed(c, hd).copy_slots(src.flatten().to(DEVICE), dst.flatten().to(DEVICE))
    views = [PagedKV.for_packed(c, hd) for c in caches]
    table = LayerTable([v.keys for v in views], [v.values for v in views])
    src_token, dst_token = token_of_slot[src].to(DEVICE), token_of_slot[dst].to(DEVICE)  # [R, M]
    compact_kv_triton_(table, src_token, dst_token, slot_mapping.to(DEVICE))
    for got, want in zip(caches, expected):
        assert torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the interpreter check is tests/unit/test_tree_build_triton.py")
@pytest.mark.parametrize("num_req,depth,vocab,budget", [(1, 15, 151936, 15), (8, 15, 49152, 64), (64, 7, 1000, 128),
                                                        (3, 3, 5, 17)])
def test_triton_tree_builder_matches_torch_builder(num_req, depth, vocab, budget, monkeypatch):
    from vllm_ddtree.tree import build_draft_tree

    gen = torch.Generator(device="cuda").manual_seed(budget)
    logits = (torch.randn(num_req, depth, vocab, device="cuda", generator=gen) * 4).round()  # ties included
    roots = torch.randint(0, vocab, (num_req,), device="cuda", generator=gen)
    got = build_draft_tree(logits, roots, budget)  # Triton on CUDA
    monkeypatch.setenv("VLLM_DDTREE_TREE_KERNELS", "torch")
    expected = build_draft_tree(logits, roots, budget)
    for name in ("token_ids", "parents", "depths", "log_probs"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM's log-prob kernel is Triton on CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_req,depth,vocab,k", [(1, 15, 151936, 15), (9, 15, 49152, 16), (32, 15, 151936, 15),
                                                   (64, 7, 1000, 128)])
def test_top_tokens_log_probs_match_log_softmax(num_req, depth, vocab, k, dtype, monkeypatch):
    """torch.topk's path, on both sides of TOKEN_LOGPROBS_KERNEL_MIN_ROWS (15 and 135+ rows), from a strided view
    of wider logits."""
    from vllm_ddtree.tree.build import top_tokens

    monkeypatch.setenv("VLLM_DDTREE_TOP_K", "torch")  # the default takes the Triton top-K at some of these sizes

    gen = torch.Generator(device="cuda").manual_seed(num_req)
    wide = torch.randn(num_req, depth, vocab + 7, device="cuda", generator=gen).mul(3).to(dtype)
    logits = wide[..., 3 : vocab + 3]  # [R, D, V] strided rows
    token_ids, log_probs = top_tokens(logits, k)
    expected_ids = torch.topk(logits, k, dim=-1, sorted=True).indices
    expected = torch.log_softmax(logits.float(), dim=-1).gather(-1, expected_ids)
    assert torch.equal(token_ids, expected_ids)
    assert log_probs.dtype == torch.float32 and log_probs.shape == (num_req, depth, k)
    torch.testing.assert_close(log_probs, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the interpreter check is tests/unit/test_top_k_triton.py")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_req,depth,vocab,k", [(1, 15, 151936, 15), (32, 15, 151936, 32), (8, 15, 49152, 64),
                                                   (5, 3, 4100, 1), (2, 4, 50, 40)])
def test_triton_top_k_matches_cpu_rule(num_req, depth, vocab, k, dtype):
    """The Triton top-K on CUDA gives the CPU path's ids exactly (lower id first among ties, logits on a coarse grid)
    and its log-probs within float32 rounding."""
    from vllm_ddtree.tree.build import top_tokens
    from vllm_ddtree.tree.dispatch import triton_top_k_wanted
    from vllm_ddtree.tree.triton_topk import top_tokens_triton

    gen = torch.Generator(device="cuda").manual_seed(k)
    logits = (torch.randn(num_req, depth, vocab, device="cuda", generator=gen) * 8).round().to(dtype)  # ties
    ids, log_probs = top_tokens_triton(logits, k)
    expected_ids, expected = top_tokens(logits.cpu(), k)
    assert torch.equal(ids.cpu(), expected_ids)
    torch.testing.assert_close(log_probs.cpu(), expected, rtol=1e-5, atol=1e-4)
    if triton_top_k_wanted("auto", num_req * depth, k):  # the default's CUDA path is this kernel here
        assert torch.equal(top_tokens(logits, k)[0], ids)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the interpreter check is tests/unit/test_tree_build_triton.py")
@pytest.mark.parametrize("num_req,depth,budget", [(1, 15, 15), (8, 15, 64), (64, 7, 128), (3, 3, 256)])
def test_triton_mask_and_walk_match_torch(num_req, depth, budget, monkeypatch):
    from vllm_ddtree.tree import ancestor_mask, build_draft_tree, walk_tree

    gen = torch.Generator(device="cuda").manual_seed(budget)
    tree = build_draft_tree(torch.randn(num_req, depth, 64, device="cuda", generator=gen) * 2,
                            torch.zeros(num_req, dtype=torch.int64, device="cuda"), budget)
    n = budget + 1
    # Targets that follow the tree from every node with a child (node i's target: its last child's token).
    target = torch.randint(0, 64, (num_req, n), device="cuda", generator=gen)
    target.scatter_(1, tree.parents[:, 1:], tree.token_ids[:, 1:])
    num_nodes = torch.randint(1, n + 1, (num_req,), device="cuda", generator=gen)

    def run():
        return ancestor_mask(tree.parents), walk_tree(tree.token_ids, tree.parents, tree.depths, target, num_nodes, depth)

    mask, walk = run()  # Triton on CUDA
    monkeypatch.setenv("VLLM_DDTREE_TREE_KERNELS", "torch")
    mask_ref, walk_ref = run()
    assert torch.equal(mask, mask_ref)
    for name in ("path_nodes", "num_accepted", "output_token_ids"):
        assert torch.equal(getattr(walk, name), getattr(walk_ref, name)), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the interpreter check is tests/unit/test_tree_build_triton.py")
@pytest.mark.parametrize("num_req,depth,vocab,budget", [(1, 15, 40, 15), (8, 15, 40, 64), (64, 7, 3, 128),
                                                        (3, 3, 40, 17), (5, 1, 40, 1)])
def test_fused_walk_and_moves_match_torch(num_req, depth, vocab, budget):
    """`walk_and_moves_triton_` (walk + accepted-path moves + sampler output + chain positions, one launch; once
    without and once with the KV compaction in the launch) against the torch walk, `verify.scorer`'s moves and
    the torch compaction on CUDA, with targets that mostly follow the tree."""
    from tests.unit.test_tree_build_triton import check_walk
    from vllm_ddtree.tree import build_draft_tree
    from vllm_ddtree.tree.triton_walk import walk_tree_triton
    from vllm_ddtree.tree.walk import walk_tree

    gen = torch.Generator().manual_seed(budget)
    logits = (torch.randn(num_req, depth, vocab, generator=gen) * 3).cuda()
    tree = build_draft_tree(logits, torch.zeros(num_req, dtype=torch.int64, device="cuda"), budget)
    for with_kv in (False, True):
        case = dict(num_req=num_req, depth=depth, budget=budget, with_kv=with_kv)
        check_walk(tree, depth, gen, walk_tree, walk_tree_triton, case, with_kv)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the interpreter check is tests/unit/test_tree_build_triton.py")
@pytest.mark.parametrize("num_req,depth,budget", [(1, 15, 15), (8, 15, 64), (64, 7, 128), (3, 3, 17), (5, 1, 1)])
def test_step_layout_and_padded_tree_inputs_match_torch(num_req, depth, budget):
    """The verification step's layout kernel (verify/triton_step.py) and the FULL-graph tree inputs kernel
    (tree/triton_layout.py) against their torch versions on CUDA."""
    from tests.unit.test_tree_build_triton import check_padded_tree_inputs, check_step_layout
    from vllm_ddtree.tree import build_draft_tree

    gen = torch.Generator().manual_seed(budget)
    logits = (torch.randn(num_req, depth, 40, generator=gen) * 3).cuda()
    tree = build_draft_tree(logits, torch.zeros(num_req, dtype=torch.int64, device="cuda"), budget)
    for _ in range(4):
        check_step_layout(tree, gen, dict(num_req=num_req, depth=depth, budget=budget))
        check_padded_tree_inputs(tree, gen, dict(num_req=num_req, depth=depth, budget=budget))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs FlashAttention-3 (CUDA)")
@pytest.mark.parametrize("b,budget,ctx", [(1, 15, 1000), (8, 64, 4000), (32, 15, 8192)])
def test_split_tree_attention_with_fa3_context(b, budget, ctx):
    """The layer's split path end to end: FA3's non-causal context pass (with LSE) + tree part + merge."""
    from vllm_ddtree.attention.reference import tree_attention_reference_
    from vllm_ddtree.attention.triton_tree import tree_attention_split_
    from vllm_ddtree.compat import flash_attn_varlen

    case = make_case(b, budget, ctx, 32, 8, 128, torch.bfloat16, "cuda", seed=b, full_trees=True)
    t = case.tree
    width = t.node_mask.shape[1]
    rows = torch.cat([torch.arange(int(s), int(s) + width, device="cuda") for s in t.query_start.tolist()])
    cu_q = torch.arange(0, (b + 1) * width, width, device="cuda", dtype=torch.int32)
    packed_out, packed_lse = flash_attn_varlen()(
        case.query[rows].contiguous(), case.kv.keys, case.kv.values, max_seqlen_q=width, cu_seqlens_q=cu_q,
        max_seqlen_k=t.max_seq_len, seqused_k=(t.seq_lens - t.num_nodes).to(torch.int32), causal=False,
        block_table=t.block_table, softmax_scale=case.scale, return_softmax_lse=True, fa_version=3,
    )  # fmt: skip
    context_out = torch.zeros_like(case.query)
    context_lse = torch.full((case.query.shape[1], case.query.shape[0]), float("-inf"), device="cuda")
    context_out[rows] = packed_out
    context_lse[:, rows] = packed_lse
    ref = torch.full_like(case.query, float("nan"))
    tree_attention_reference_(case.query, case.kv, t, case.scale, ref)
    out = torch.full_like(case.query, float("nan"))
    tree_attention_split_(
        case.query, case.kv.keys, case.kv.values, t.block_table, t.query_start, t.seq_lens, t.num_nodes,
        t.node_mask, t.max_seq_len, case.scale, context_out, context_lse, out,
    )  # fmt: skip
    tree_rows = case.tree_rows
    assert torch.isfinite(out[tree_rows]).all()
    assert _relative_error(out[tree_rows], ref[tree_rows]) < TOLERANCE[torch.bfloat16]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs FlashAttention-3 (CUDA)")
@pytest.mark.parametrize("mode", ["1", "decode", "chains"])
@pytest.mark.parametrize("padding", [0, 3], ids=["eager_layout", "graph_layout"])
@pytest.mark.parametrize("b,budget,ctx,heads,dtype", [
    (1, 15, 1000, (9, 3), torch.bfloat16), (4, 7, 300, (32, 8), torch.bfloat16), (8, 64, 4000, (32, 8), torch.bfloat16),
    (3, 20, 0, (8, 1), torch.float16), (64, 1, 1, (8, 8), torch.float16), (32, 128, 8192, (28, 4), torch.bfloat16)])
def test_per_path_fa3_matches_reference(b, budget, ctx, heads, dtype, padding, mode, monkeypatch):
    """VLLM_DDTREE_PER_PATH_ATTENTION's GPU path (1: all nodes in one call; decode: one call per node index;
    chains: one call per chain index, causal chains of up to the trees' depth + 1 nodes): FA3 through one-token
    pages, every tree row within its dtype's bound of the reference, rows outside the trees untouched."""
    import dataclasses

    from tests.gpu.cases import as_persistent_layout, tree_depth
    from vllm_ddtree.attention.per_path import PER_PATH_ENV, fa3_attend, per_path_attention_
    from vllm_ddtree.attention.reference import tree_attention_reference_

    monkeypatch.setenv(PER_PATH_ENV, mode)
    case = make_case(b, budget, ctx, *heads, 64 if heads[0] in (9, 8) else 128, dtype, "cuda", seed=budget)
    ref = torch.full_like(case.query, float("nan"))
    tree_attention_reference_(case.query, case.kv, case.tree, case.scale, ref)
    tree = dataclasses.replace(case.tree, depth=tree_depth(case.tree))  # chains: the tightest bound
    tree = as_persistent_layout(tree, padding) if padding else tree
    out = torch.full_like(case.query, float("nan"))
    per_path_attention_(case.query, case.kv, tree, case.scale, out, fa3_attend)
    rows = case.tree_rows
    assert torch.isfinite(out[rows]).all() and torch.isnan(out[~rows]).all()
    assert _relative_error(out[rows], ref[rows]) < TOLERANCE[dtype]

"""The drafter's top-K kernel (tree/triton_top_tokens.py) on CUDA against the CPU rule: the same token ids (logit
descending, equal logits by lower id, also at the K-th place) and float32 log-softmax values, at the drafter
shapes (SmolLM2's and Qwen3's vocabularies), with ties, -inf logits and strided rows. Skipped without CUDA; the
interpreter check is tests/unit/test_top_tokens_triton.py. Needs torch and Triton only (runs on a bare device)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CASES = [  # (requests, depth, vocab, k, dtype, tie grid or None)
    (1, 15, 151936, 15, torch.bfloat16, None),
    (32, 15, 151936, 16, torch.bfloat16, None),
    (64, 15, 49152, 64, torch.float32, None),
    (8, 15, 49152, 128, torch.bfloat16, 0.25),
    (4, 7, 1000, 15, torch.float16, 1.0),
    (3, 3, 5, 5, torch.float32, None),
    (2, 2, 40, 1, torch.float32, 1.0),
]


@pytest.mark.parametrize("num_req,depth,vocab,k,dtype,grid", CASES)
def test_top_tokens_kernel_matches_the_cpu_rule(num_req, depth, vocab, k, dtype, grid):
    from vllm_ddtree.tree.build import _top_tokens_lowest_ids_first
    from vllm_ddtree.tree.triton_top_tokens import top_tokens_triton

    gen = torch.Generator(device="cuda").manual_seed(vocab + k)
    wide = torch.randn(num_req, depth, vocab + 3, device="cuda", generator=gen) * 4  # strided rows below
    if grid is not None:
        wide = (wide / grid).round() * grid  # many equal logits, also at the K-th place
    wide[0, 0, : min(vocab, 7)] = float("-inf")
    wide[-1, -1, :vocab].fill_(-0.0)[1::2] = 0.0  # a row of ties between -0.0 and +0.0
    logits = wide.to(dtype)[..., :vocab]  # [R, D, V], row stride V + 3

    token_ids, log_probs = top_tokens_triton(logits, k)  # [R, D, K]
    expected_ids, _ = _top_tokens_lowest_ids_first(logits.float().cpu(), k)
    assert torch.equal(token_ids.cpu(), expected_ids)
    expected_lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, token_ids)
    torch.testing.assert_close(log_probs, expected_lp, atol=2e-5, rtol=1e-6)
    assert bool((log_probs[..., 1:] <= log_probs[..., :-1]).all())

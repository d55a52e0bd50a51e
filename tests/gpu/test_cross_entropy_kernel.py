"""The training loss's row kernel (`triton_cross_entropy.row_cross_entropy_kernel`) against the pure-torch
reference (`row_cross_entropy_reference_`) on random logits, outputs poisoned beforehand.

Skipped without CUDA; `TRITON_INTERPRET=1` runs it on the CPU (tests/unit/test_kernels_interpreter.py, in CI).
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else ("cpu" if INTERPRET else None)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEVICE is None, reason="needs CUDA (or TRITON_INTERPRET=1)")]

# (rows, vocab, dtype): a vocabulary below, at and across the kernel's 4,096-wide blocks, SmolLM2's 49,152 on CUDA
# (the interpreter mishandles bf16: float16 stands in for the 16-bit path there)
CASES = [(3, 10, torch.float32), (5, 4096, torch.float16), (7, 5000, torch.float32), (4, 300, torch.float16)]
if not INTERPRET:
    CASES += [(2048, 49152, torch.bfloat16), (333, 49152, torch.float32), (64, 151936, torch.bfloat16)]


@pytest.mark.parametrize("rows, vocab, dtype", CASES, ids=lambda v: str(v).removeprefix("torch."))
def test_row_kernel_matches_the_reference(rows, vocab, dtype):
    from vllm_ddtree.drafter.lm_head_loss import row_cross_entropy_reference_, row_cross_entropy_triton_

    g = torch.Generator().manual_seed(rows * 7 + vocab)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    logits[0, vocab // 2] = 40.0  # one confident row
    labels = torch.randint(0, vocab, (rows,), generator=g)
    labels[0] = vocab // 2
    labels[1:: 3] = -100  # rows without a label
    weights = torch.rand(rows, generator=g)
    expected = logits.clone()
    expected_ce, expected_correct = row_cross_entropy_reference_(expected, labels, weights)
    got = logits.to(DEVICE).clone()  # (on the CPU `to` would alias `logits`, which the oracle below reads)
    ce, correct = row_cross_entropy_triton_(got, labels.to(DEVICE), weights.to(DEVICE))
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(ce.cpu(), expected_ce, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got.cpu().float(), expected.float(), **tolerance)
    top2 = logits.float().topk(2, -1).values
    clear = top2[:, 0] > top2[:, 1]  # rows whose argmax is not a tie
    assert torch.equal(correct.cpu()[clear], expected_correct[clear])
    assert bool(correct[0]) and not correct.cpu()[labels < 0].any()


def test_the_torch_switch_runs_the_reference_where_the_kernel_would(monkeypatch):
    """VLLM_DDTREE_LOSS_KERNEL=torch (gpu_train.sh's fallback when this file fails on the device): the reference."""
    from vllm_ddtree.drafter.lm_head_loss import KERNEL_ENV, row_cross_entropy_, row_cross_entropy_reference_

    g = torch.Generator().manual_seed(9)
    logits = torch.randn(6, 700, generator=g)
    labels, weights = torch.tensor([1, 2, -100, 4, 699, 0]), torch.rand(6, generator=g)
    labels, weights = labels.to(DEVICE), weights.to(DEVICE)
    expected = logits.to(DEVICE).clone()
    expected_ce, _ = row_cross_entropy_reference_(expected, labels, weights)  # on the same device: bitwise
    monkeypatch.setenv(KERNEL_ENV, "torch")
    got = logits.to(DEVICE).clone()
    ce, _ = row_cross_entropy_(got, labels, weights)
    assert torch.equal(got, expected) and torch.equal(ce, expected_ce)


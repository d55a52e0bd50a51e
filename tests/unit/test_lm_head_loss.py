"""The fused LM head + cross-entropy of the drafter's training loss against autograd through full float32 logits
(the oracle: what `block_loss` computed before session 48), on the CPU path (`row_cross_entropy_reference_`)."""

from __future__ import annotations

import pytest
import torch

from vllm_ddtree.drafter.lm_head_loss import (
    lm_head_cross_entropy,
    lm_head_cross_entropy_reference,
    row_cross_entropy_reference_,
)


def _oracle(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor):
    """Autograd through float32 logits (`lm_head_cross_entropy_reference`): (loss, d loss / d hidden, correct)."""
    hidden = hidden.detach().clone().requires_grad_()
    loss, correct = lm_head_cross_entropy_reference(hidden, head, labels, weights)
    loss.backward()
    return loss.detach(), hidden.grad, correct


def _case(n: int, hidden_size: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, hidden_size, generator=g)
    head = torch.randn(vocab, hidden_size, generator=g) / hidden_size**0.5
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[::5] = -100  # rows without a label (past a sequence's end)
    weights = torch.rand(n, generator=g)
    return hidden, head, labels, weights / weights.sum()


@pytest.mark.parametrize("n, vocab", [(1, 7), (37, 300), (4100, 96)])  # 4100 rows: the reference's chunks
def test_fused_loss_and_gradient_match_autograd_through_float32_logits(n, vocab):
    hidden, head, labels, weights = _case(n, 16, vocab, seed=n)
    expected_loss, expected_grad, expected_correct = _oracle(hidden, head, labels, weights)
    x = hidden.clone().requires_grad_()
    loss, correct = lm_head_cross_entropy(x, head, labels, weights)
    (2.5 * loss).backward()  # the backward scales the forward's gradient by the upstream one
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, 2.5 * expected_grad, rtol=1e-4, atol=1e-7)
    assert torch.equal(correct, expected_correct)
    assert not correct[labels < 0].any()


def test_under_bf16_autocast_the_matmuls_run_in_bf16_as_f_linear_does():
    """The training step runs under autocast: the logits are the bf16 matmul's (as `F.linear` gives them), the
    loss float32, and the gradient reaches the float32 hidden states."""
    hidden, head, labels, weights = _case(64, 32, 200, seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x = hidden.clone().requires_grad_()
        loss, _ = lm_head_cross_entropy(x, head, labels, weights)
        reference_logits = torch.nn.functional.linear(hidden, head)
    assert reference_logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    expected_loss, expected_grad, _ = _oracle(hidden.bfloat16(), head.bfloat16(), labels, weights)
    loss.backward()
    assert x.grad.dtype == torch.float32
    torch.testing.assert_close(loss, expected_loss.float(), rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(x.grad, expected_grad.float(), rtol=2e-2, atol=1e-3)


def test_without_grad_the_loss_is_the_same_and_no_gradient_is_kept():
    hidden, head, labels, weights = _case(20, 8, 50, seed=4)
    with torch.no_grad():
        loss, _ = lm_head_cross_entropy(hidden, head, labels, weights)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, _oracle(hidden, head, labels, weights)[0])


def test_the_row_pass_overwrites_logits_with_the_weighted_softmax_minus_one_hot():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(9, 33, generator=g)
    labels = torch.tensor([0, 32, 5, -100, 7, 7, 1, 2, 3])
    weights = torch.rand(9, generator=g)
    expected = (torch.softmax(logits, -1) - torch.nn.functional.one_hot(labels.clamp(min=0), 33) *
                (labels >= 0).unsqueeze(-1)) * (weights * (labels >= 0)).unsqueeze(-1)  # fmt: skip
    expected_ce = torch.where(labels >= 0, torch.nn.functional.cross_entropy(
        logits, labels.clamp(min=0), reduction="none"), 0.0)  # fmt: skip
    ce, correct = row_cross_entropy_reference_(logits, labels, weights)
    torch.testing.assert_close(logits, expected)
    torch.testing.assert_close(ce, expected_ce)
    assert correct.dtype == torch.bool and not correct[3]


def test_an_unknown_loss_kernel_is_refused_by_name(monkeypatch):
    from vllm_ddtree.drafter.lm_head_loss import KERNEL_ENV, row_cross_entropy_

    monkeypatch.setenv(KERNEL_ENV, "cuda")
    with pytest.raises(ValueError, match="VLLM_DDTREE_LOSS_KERNEL='cuda' is not a loss kernel; use triton"):
        row_cross_entropy_(torch.zeros(2, 5), torch.tensor([0, 1]), torch.ones(2))


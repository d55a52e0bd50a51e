"""The training loss's LM head and cross-entropy without float32 [N, V] logits or their gradient.

`block_loss` scores N = B * A * (S - 1) block positions (15,360 a step for gpu_train.sh's batch) against the
target's 49,152-token vocabulary. Through autograd the bf16 logits were cast to float32, read by log-sum-exp,
gather and argmax, and the backward wrote float32 gradients of the same size several times over: ~50 bytes of
memory traffic per logit, ~39 GB a step. Here one row pass (`row_cross_entropy_`) reads each bf16 logit twice
and overwrites it once with its gradient, (softmax - one-hot) * weight; the LM head is frozen, so the gradient
with respect to the hidden states (that gradient times the head) is computed in the forward and only scaled in
the backward: ~10 bytes per logit. The arithmetic is the reference's: float32 inside the row, the gradient
rounded to the logits' dtype before its matmul, as autograd rounds it.

`row_cross_entropy_reference_` is the pure-torch oracle and the CPU path; the Triton kernel runs on CUDA (and in
Triton's interpreter in CI).
"""

from __future__ import annotations

import torch

ROWS_PER_CHUNK = 2048  # the reference's rows per float32 pass (bounds its [rows, V] temporaries)


def row_cross_entropy_reference_(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
                                 ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per row of ``logits`` [N, V]: the cross-entropy against ``labels`` [N] (a label < 0 is no label: 0) and
    whether the argmax is the label; ``logits`` is overwritten with (softmax - one-hot(label)) * weights[:, None]
    (0 without a label). Returns (ce [N] float32, correct [N] bool)."""
    ce = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    correct = torch.empty(logits.shape[0], dtype=torch.bool, device=logits.device)
    for start in range(0, logits.shape[0], ROWS_PER_CHUNK):
        rows = slice(start, start + ROWS_PER_CHUNK)
        x, label, weight = logits[rows].float(), labels[rows], weights[rows].float()  # x [n, V]
        has_label = label >= 0
        lse = x.logsumexp(-1)  # [n]
        target = x.gather(-1, label.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        ce[rows] = torch.where(has_label, lse - target, 0.0)
        correct[rows] = (x.argmax(-1) == label) & has_label
        grad = torch.exp(x - lse.unsqueeze(-1))
        grad.scatter_add_(-1, label.clamp(min=0).unsqueeze(-1), -has_label.float().unsqueeze(-1))
        logits[rows] = grad * (weight * has_label).unsqueeze(-1)
    return ce, correct


KERNEL_ENV = "VLLM_DDTREE_LOSS_KERNEL"  # "triton" (default): the kernel on CUDA; "torch": the reference everywhere


def row_cross_entropy_(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`row_cross_entropy_reference_`'s contract, by the Triton kernel on CUDA (or in Triton's interpreter) unless
    VLLM_DDTREE_LOSS_KERNEL=torch (what scripts/gpu_train.sh sets when the kernel fails its test on the device)."""
    import os

    from vllm_ddtree.env import env_choice

    kernel = env_choice(KERNEL_ENV, ("triton", "torch"), "is not a loss kernel; use triton (the default) or torch")
    on_triton = logits.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    if kernel == "torch" or not on_triton:
        return row_cross_entropy_reference_(logits, labels, weights)
    return row_cross_entropy_triton_(logits, labels, weights)


def row_cross_entropy_triton_(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    from vllm_ddtree.drafter.triton_cross_entropy import row_cross_entropy_kernel

    assert logits.stride(-1) == 1, "the kernel reads rows of contiguous logits"
    N, V = logits.shape
    ce = torch.empty(N, dtype=torch.float32, device=logits.device)
    correct = torch.empty(N, dtype=torch.bool, device=logits.device)
    if N:
        row_cross_entropy_kernel[(N,)](logits, labels, weights, ce, correct, V, logits.stride(0),
                                       BLOCK_V=min(4096, _next_power_of_2(V)))  # fmt: skip
    return ce, correct


def _next_power_of_2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


class _LmHeadCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor):
        logits = hidden @ head.T  # [N, V] in the matmul's dtype
        ce, correct = row_cross_entropy_(logits, labels, weights)  # logits now hold their weighted gradient
        ctx.save_for_backward(logits @ head if ctx.needs_input_grad[0] else None)  # [N, H]
        ctx.mark_non_differentiable(correct)
        return (ce * weights).sum(), correct

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _grad_correct):
        (grad_hidden,) = ctx.saved_tensors
        return (grad_hidden * grad_loss.to(grad_hidden.dtype), None, None, None)


def lm_head_cross_entropy_reference(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor,
                                    weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`lm_head_cross_entropy`'s contract by autograd through float32 [N, V] logits, as `block_loss` computed it
    before session 48: the oracle of its tests and the baseline of scripts/bench_training_loss.py."""
    logits = torch.nn.functional.linear(hidden, head.detach()).float()  # [N, V]
    has_label = labels >= 0
    ce = logits.logsumexp(-1) - logits.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        correct = (logits.argmax(-1) == labels) & has_label
    return (ce * weights * has_label).sum(), correct


def lm_head_cross_entropy(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """sum over rows of weights * cross-entropy(hidden @ head^T, labels), and whether each row's argmax is its label.

    hidden [N, H]; head [V, H] (frozen: no gradient); labels [N] int64 (< 0: no label, contributes 0); weights [N]
    float32. The matmuls run in the autocast dtype when autocast is on for hidden's device (as `F.linear` would),
    else in hidden's dtype. Returns (loss scalar float32, correct [N] bool)."""
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    with torch.autocast(device_type, enabled=False):
        return _LmHeadCrossEntropy.apply(hidden.to(dtype), head.detach().to(dtype), labels, weights.float())

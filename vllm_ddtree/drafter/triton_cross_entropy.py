"""Triton kernel of `lm_head_loss.row_cross_entropy_`: one program per row of logits, two passes over the vocabulary
(the online log-sum-exp, target logit and argmax; then the weighted gradient written over the row)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_cross_entropy_kernel(
    logits_ptr,  # [N, V] 16- or 32-bit floats, rows at `row_stride`; overwritten with the weighted gradient
    labels_ptr,  # [N] int64, < 0: no label
    weights_ptr,  # [N] float32
    ce_ptr,  # [N] float32 out: cross-entropy (0 without a label)
    correct_ptr,  # [N] bool out: argmax == label
    V,
    row_stride,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_logits = logits_ptr + row * row_stride
    label = tl.load(labels_ptr + row)
    running_max = tl.full((), float("-inf"), tl.float32)
    running_sum = tl.full((), 0.0, tl.float32)
    best_index = tl.full((), 0, tl.int64)
    target = tl.full((), 0.0, tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_logits + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        block_max = tl.max(x, 0)
        block_index = (start + tl.argmax(x, 0)).to(tl.int64)  # the first maximum, as torch.argmax
        best_index = tl.where(block_max > running_max, block_index, best_index)
        new_max = tl.maximum(running_max, block_max)
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), 0)
        running_max = new_max
        target += tl.sum(tl.where(cols == label, x, 0.0), 0)
    lse = running_max + tl.log(running_sum)
    has_label = label >= 0
    tl.store(ce_ptr + row, tl.where(has_label, lse - target, 0.0))
    tl.store(correct_ptr + row, has_label & (best_index == label))
    weight = tl.where(has_label, tl.load(weights_ptr + row), 0.0)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_logits + cols, mask=cols < V, other=0.0).to(tl.float32)
        grad = (tl.exp(x - lse) - tl.where(cols == label, 1.0, 0.0)) * weight
        tl.store(row_logits + cols, grad.to(logits_ptr.dtype.element_ty), mask=cols < V)

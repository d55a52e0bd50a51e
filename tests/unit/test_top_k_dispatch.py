"""Which top-K `build.top_tokens` takes on CUDA (`dispatch.triton_top_k_wanted`): session 34's timing rule."""

import pytest
import torch

from vllm_ddtree.tree.dispatch import (
    AUTO_TRITON_TOP_K_MAX_K,
    AUTO_TRITON_TOP_K_MIN_ROWS,
    triton_top_k_wanted,
    use_triton_top_k,
)

triton_topk = pytest.importorskip("vllm_ddtree.tree.triton_topk")


@pytest.mark.parametrize(
    "rows, k, wanted",
    [
        (15, 15, False),  # batch 1, depth 15: torch.topk was faster (0.138 vs 0.155 ms)
        (AUTO_TRITON_TOP_K_MIN_ROWS - 1, 15, False),
        (AUTO_TRITON_TOP_K_MIN_ROWS, 15, True),
        (480, 15, True),  # batch 32: 0.43 vs 0.88 ms
        (480, AUTO_TRITON_TOP_K_MAX_K, True),
        (480, AUTO_TRITON_TOP_K_MAX_K + 1, False),  # K = 64 was slower (1.63 vs 0.89 ms)
    ],
)
def test_auto_takes_triton_only_where_it_was_faster(rows, k, wanted):
    assert triton_top_k_wanted("auto", rows, k) is wanted


def test_forced_choices():
    assert triton_top_k_wanted("triton", 1, triton_topk.MAX_K)
    assert not triton_top_k_wanted("triton", 1, triton_topk.MAX_K + 1)  # past what the kernels support
    assert not triton_top_k_wanted("torch", 480, 15)


def test_cpu_logits_never_take_triton(monkeypatch):
    monkeypatch.setenv("VLLM_DDTREE_TOP_K", "triton")
    assert not use_triton_top_k(torch.zeros(32, 15, 100), 15)

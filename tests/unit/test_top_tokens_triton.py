"""The drafter's top-K kernel (tree/triton_top_tokens.py) gives the CPU rule's token ids (logit descending, equal
logits by lower id, also at the K-th place) and the float32 log-softmax at them, in Triton's interpreter
(TRITON_INTERPRET=1, read when the kernel is defined, so in a subprocess). Cases: one chunk and several (a partial
last chunk), K a power of two and not, K = 1 and K = V, ties, -inf rows, -0.0 against +0.0, strided rows,
float16 input. The CUDA grid at the drafters' sizes is tests/gpu/test_top_tokens.py."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

CASES = [  # (rows, vocab, k, dtype, tie grid or None)
    (3, 40, 7, torch.float32, None),
    (2, 40, 1, torch.float32, 1.0),
    (2, 5, 5, torch.float32, None),
    (2, 9000, 16, torch.float32, 0.5),  # three chunks of 4096, the last partial
    (2, 300, 13, torch.float16, 0.25),
]


def compare() -> int:
    from vllm_ddtree.tree import triton_top_tokens
    from vllm_ddtree.tree.build import _top_tokens_lowest_ids_first

    gen = torch.Generator().manual_seed(0)
    for rows, vocab, k, dtype, grid in CASES:
        wide = torch.randn(rows, vocab + 3, generator=gen) * 4
        if grid is not None:
            wide = (wide / grid).round() * grid
        wide[0, : min(vocab, 3)] = float("-inf")
        wide[-1, :vocab] = 0.0
        wide[-1, :vocab:2] = -0.0  # ties between -0.0 and +0.0
        logits = wide.to(dtype)[:, :vocab]  # row stride vocab + 3
        token_ids, log_probs = triton_top_tokens.top_tokens_triton(logits, k)
        expected_ids, _ = _top_tokens_lowest_ids_first(logits.float(), k)
        assert torch.equal(token_ids, expected_ids), (rows, vocab, k, token_ids, expected_ids)
        expected_lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, expected_ids)
        torch.testing.assert_close(log_probs, expected_lp, atol=2e-5, rtol=1e-6)
    # An all -inf row: NaN log-probabilities, as log-softmax gives.
    _, log_probs = triton_top_tokens.top_tokens_triton(torch.full((1, 8), float("-inf")), 2)
    assert bool(log_probs.isnan().all())
    return len(CASES)


def test_top_tokens_kernel_matches_the_cpu_rule_in_interpreter():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"checked {len(CASES)} cases" in run.stdout


if __name__ == "__main__":
    print(f"checked {compare()} cases")

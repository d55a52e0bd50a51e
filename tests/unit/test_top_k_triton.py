"""The Triton top-K (tree/triton_topk.py) gives `top_tokens`' CPU result exactly: the same ids in the same order
(lower id first among equal logits, also at the K-th place) and log-probabilities within float32 rounding of a
log-softmax. CI has no GPU, so it runs in Triton's interpreter in a subprocess (the switch is read when the kernels
are defined). Cases: vocabularies below, at and above the chunk width (several chunks, a short last chunk), K from 1
to the vocabulary, ties (logits on a coarse grid), -inf logits, 2-D and 3-D logits, strided rows."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest


def compare(seed: int = 0) -> int:
    import torch

    from vllm_ddtree.tree.build import top_tokens
    from vllm_ddtree.tree.triton_topk import top_tokens_triton

    gen = torch.Generator().manual_seed(seed)
    checked = 0
    for vocab, k, chunk, grid in itertools.product((3, 16, 40, 300), (1, 3, 16), (16, 64), (None, 0.5)):
        if k > vocab:
            continue
        wide = torch.randn(2, 3, vocab + 5, generator=gen) * 3
        logits = wide[..., 2 : vocab + 2]  # [2, 3, V] strided rows
        if grid:
            logits = (logits / grid).round() * grid  # many equal logits
        logits[torch.rand(logits.shape, generator=gen) < 0.1] = float("-inf")
        logits[..., 0] = logits[..., 0].clamp(min=-5.0)  # a finite logit per row
        for view in (logits, logits[0]):  # 3-D and 2-D
            expected_ids, expected_lp = top_tokens(view, k)  # the CPU path: the exact tie rule
            ids, lp = top_tokens_triton(view, k, chunk=chunk)
            case = dict(vocab=vocab, k=k, chunk=chunk, grid=grid, dims=view.dim())
            assert ids.dtype == torch.int64 and lp.dtype == torch.float32, case
            assert torch.equal(ids, expected_ids), (case, ids, expected_ids)
            torch.testing.assert_close(lp, expected_lp, rtol=1e-5, atol=1e-5, msg=str(case))
            checked += 1
    return checked


@pytest.mark.slow
def test_triton_top_k_matches_cpu_top_tokens_in_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert int(run.stdout.split()[-1]) > 60  # cases checked


if __name__ == "__main__":
    print("cases checked:", compare())

"""scripts/bench_tree.py's chunked top-K candidate picks the same logits as one torch.topk over the vocabulary
(the candidate is timed on the GPU; its values are checked there too, and here on the CPU)."""

import pytest
import torch

from test_benchmark_script import load_script


@pytest.mark.parametrize("vocab,k,dtype", [(151936, 15, torch.bfloat16), (49152, 64, torch.float32),
                                           (151936, 128, torch.float32), (4096, 1, torch.bfloat16)])
def test_chunked_top_ids_pick_torch_topks_values(vocab, k, dtype):
    bench = load_script("bench_tree.py")
    rows = (torch.randn(6, vocab, generator=torch.Generator().manual_seed(k)) * 3).to(dtype)
    rows[0, 100:140] = 9.0  # ties at the top, across a chunk boundary
    widths = bench.chunk_widths(vocab, k)
    assert widths
    expected = torch.topk(rows, k, dim=-1).values
    for width in widths:
        ids = bench.chunked_top_ids(rows, k, width)
        assert torch.equal(rows.gather(1, ids), expected), width
        assert (ids.sort(dim=-1).values.diff(dim=-1) > 0).all()  # distinct ids

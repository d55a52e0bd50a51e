"""`pad_dflash_query_buffers`: vLLM 0.26's DFlash proposer sized its query buffers for max_num_seqs * (1 + D)
tokens only, and its CUDA-graph dispatcher pads a query batch up to the largest capture size (with FULL decode
graphs: multiples of B + 1, which DDTree's budget sets independently of D). Seen on the H200 with B = 64 and
block size 4: the padded batch read positions past the buffer's end."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vllm_ddtree.compat import pad_dflash_query_buffers


def proposer_like_vllm_026(max_num_seqs: int, depth: int, max_num_tokens: int) -> SimpleNamespace:
    """The attributes 0.26's DFlashProposer.__init__ sets for its query buffers."""
    max_query_tokens = max_num_seqs * (1 + depth)
    max_positions = max_num_tokens + max_query_tokens
    return SimpleNamespace(
        max_query_tokens=max_query_tokens,
        max_num_tokens=max_num_tokens,
        max_positions=max_positions,
        positions=torch.zeros(max_query_tokens, dtype=torch.int64),
        _slot_mapping_buffer=torch.zeros(max_query_tokens, dtype=torch.int64),
        arange=torch.arange(max_positions + 1, dtype=torch.int32),
    )


def config_with_capture_size(size: int | None) -> SimpleNamespace:
    return SimpleNamespace(compilation_config=SimpleNamespace(max_cudagraph_capture_size=size))


def test_buffers_grow_to_the_largest_capture_size():
    # B = 64 (uniform decode step of 65 tokens), drafter depth 3, 8 sequences: 32 query tokens, padded up to 520.
    proposer = proposer_like_vllm_026(max_num_seqs=8, depth=3, max_num_tokens=4096)
    pad_dflash_query_buffers(proposer, config_with_capture_size(520))
    assert proposer.positions.shape == (520,) and proposer.positions.dtype == torch.int64
    assert proposer._slot_mapping_buffer.shape == (520,)
    assert not proposer.positions.any()
    assert proposer.arange.shape == (4096 + 520 + 1,) and proposer.arange.dtype == torch.int32
    assert torch.equal(proposer.arange, torch.arange(4096 + 520 + 1, dtype=torch.int32))


def test_buffers_already_large_enough_stay():
    proposer = proposer_like_vllm_026(max_num_seqs=64, depth=15, max_num_tokens=8192)  # 1024 query tokens
    positions = proposer.positions
    for size in (512, None):
        pad_dflash_query_buffers(proposer, config_with_capture_size(size))
        assert proposer.positions is positions


def test_left_alone_where_vllm_sizes_them_itself():
    """vLLM 0.32 sizes the buffers for the padding (`max_padded_query_tokens`); the shim must not touch them."""
    proposer = proposer_like_vllm_026(max_num_seqs=2, depth=3, max_num_tokens=64)
    proposer.max_padded_query_tokens = 8
    pad_dflash_query_buffers(proposer, config_with_capture_size(64))
    assert proposer.positions.shape == (8,)

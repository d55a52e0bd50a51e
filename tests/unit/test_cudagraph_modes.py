"""Which CUDA-graph mode DDTree runs under. Full graphs may hold tree attention only for uniform verification
batches (the persistent tree buffers); a full graph of a mixed batch would replay causal attention for its tree
requests and accept wrong tokens, so a user's FULL becomes FULL_AND_PIECEWISE. VLLM_DDTREE_FULL_CUDA_GRAPHS=0
turns every full mode into PIECEWISE."""

from __future__ import annotations

import logging

import pytest
from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode

from vllm_ddtree.compat import disable_full_cuda_graphs, full_cuda_graphs_for_uniform_batches_only

LOGGER = logging.getLogger("test")


@pytest.mark.parametrize(
    "mode,compiled,expected",
    [
        (CUDAGraphMode.FULL, True, CUDAGraphMode.FULL_AND_PIECEWISE),
        (CUDAGraphMode.FULL, False, CUDAGraphMode.FULL_DECODE_ONLY),
        (CUDAGraphMode.FULL_AND_PIECEWISE, True, CUDAGraphMode.FULL_AND_PIECEWISE),
        (CUDAGraphMode.FULL_DECODE_ONLY, True, CUDAGraphMode.FULL_DECODE_ONLY),
        (CUDAGraphMode.PIECEWISE, True, CUDAGraphMode.PIECEWISE),
        (CUDAGraphMode.NONE, True, CUDAGraphMode.NONE),
    ],
)
def test_full_graphs_only_for_uniform_batches(mode, compiled, expected):
    config = CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE if compiled else CompilationMode.NONE, cudagraph_mode=mode
    )
    full_cuda_graphs_for_uniform_batches_only(config, LOGGER)
    assert config.cudagraph_mode == expected
    assert config.cudagraph_mode.mixed_mode() != CUDAGraphMode.FULL


@pytest.mark.parametrize(
    "mode,expected",
    [
        (CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.PIECEWISE),
        (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE),
        (CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.PIECEWISE),
        (CUDAGraphMode.PIECEWISE, CUDAGraphMode.PIECEWISE),
    ],
)
def test_opting_out_leaves_piecewise_graphs(mode, expected):
    config = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=mode)
    disable_full_cuda_graphs(config, LOGGER)
    assert config.cudagraph_mode == expected


def vllm_default_capture_sizes(max_size: int = 512) -> list[int]:
    """vLLM 0.26's default list (`VllmConfig._set_cudagraph_sizes`): 1, 2, 4, then steps of 8 to 256, then 16."""
    return [1, 2, 4] + list(range(8, min(max_size, 256) + 1, 8)) + list(range(272, max_size + 1, 16))


def uniform(drafts: int, max_num_reqs: int) -> list[int]:
    """`compat.drafts_by_batch_size` without a per-batch-size schedule."""
    return [0] + [drafts] * max_num_reqs


def test_model_runner_v2_leaves_tree_steps_without_full_graphs_under_power_of_two_capture_sizes():
    """Session 17's pair benchmark: capture sizes 1, 2, 4, ..., 8192 and B = 64. The chain's 16-token steps have a
    FULL graph at every request count; DDTree's 65-token steps only at powers of two, so batches whose requests end
    at different lengths ran most steps piecewise. vLLM's default sizes and benchmark.py's list leave no gap."""
    from vllm_ddtree.runner_v2 import request_counts_without_full_graph as missing_of

    powers = [2**k for k in range(14)]
    missing = missing_of(powers, uniform(64, 64), 65, 8192)
    assert missing[:4] == [3, 5, 6, 7] and not {1, 2, 4, 8, 16, 32, 64} & set(missing)
    assert missing_of(powers, uniform(15, 64), 16, 8192) == []  # the chain's B + 1 = 16
    for budget in (64, 16, 15):
        assert missing_of(vllm_default_capture_sizes(), uniform(budget, 256), budget + 1, 512) == []
    # B + 1 = 9 is below the default list's step of 16 above 256 tokens: 30 requests (270 tokens) -> the 272 bucket
    small = missing_of(vllm_default_capture_sizes(), uniform(8, 256), 9, 512)
    assert 30 in small and min(small) * 9 > 256
    from test_benchmark_script import load_benchmark

    bench_sizes = load_benchmark().capture_sizes(uniform(64, 64), 16)
    assert missing_of(bench_sizes, uniform(64, 64), 65, max(bench_sizes)) == []


def test_budget_per_batch_size_needs_the_sizes_of_each_tier():
    """With `num_speculative_tokens_per_batch_size` V2 captures FULL graphs per draft length (each capture size
    rounded up to a multiple of that length's tokens per request). B = 64 at 1-4 requests, 15 at 5-64: with powers
    of two, 3 requests (195 tokens) fall in the 256 bucket, whose FULL graph is the 16-token tier's; every
    16-token step has its graph. benchmark.py's sizes for the schedule leave no gap."""
    from vllm_ddtree.runner_v2 import request_counts_without_full_graph as missing_of

    drafts = [0] + [64] * 4 + [15] * 60
    powers = [2**k for k in range(14)]
    assert missing_of(powers, drafts, 65, 8192) == [3]
    assert missing_of(powers, [0] + [64] * 4 + [0] * 60, 65, 8192) == [3]  # no speculation: nothing to cover
    from test_benchmark_script import load_benchmark

    bench_sizes = load_benchmark().capture_sizes(drafts, 16)
    assert missing_of(bench_sizes, drafts, 65, max(bench_sizes)) == []


def test_the_gap_is_logged_with_the_sizes_that_close_it(caplog):
    from vllm_ddtree.runner_v2 import _log_cuda_graph_coverage

    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    config = CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE, cudagraph_capture_sizes=sizes)
    config.max_cudagraph_capture_size = 512
    with caplog.at_level(logging.WARNING, logger="test"):
        _log_cuda_graph_coverage(config, uniform(64, 8), 65, LOGGER)
    assert "verification steps of [3, 5, 6, 7] requests" in caplog.text
    assert "[195, 325, 390, 455]" in caplog.text  # the sizes to add
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="test"):
        _log_cuda_graph_coverage(config, uniform(64, 64), 65, LOGGER)
    assert "the largest step has 4160" in caplog.text and "--max-cudagraph-capture-size 4160" in caplog.text
    caplog.clear()
    config.cudagraph_capture_sizes = vllm_default_capture_sizes()
    with caplog.at_level(logging.WARNING, logger="test"):
        _log_cuda_graph_coverage(config, uniform(64, 8), 65, LOGGER)
    assert caplog.text == ""

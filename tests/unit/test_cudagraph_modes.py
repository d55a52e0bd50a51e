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

"""Which implementation of the tree operations runs: Triton kernels on CUDA tensors (one launch each), the
tensor-op versions elsewhere. `VLLM_DDTREE_TREE_KERNELS=torch` forces the tensor-op versions on CUDA too (they
are the reference the kernels are tested against)."""

import os

import torch


def use_triton(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and os.environ.get("VLLM_DDTREE_TREE_KERNELS", "triton") != "torch"

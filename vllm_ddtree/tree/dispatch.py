"""Which implementation of the tree operations runs: Triton kernels on CUDA tensors (one launch each), the
tensor-op versions elsewhere. `VLLM_DDTREE_TREE_KERNELS=torch` forces the tensor-op versions on CUDA too (they
are the reference the kernels are tested against).

The drafter's top-K has its own switch while its Triton version (tree/triton_topk.py) waits for its GPU timing:
`VLLM_DDTREE_TOP_K=triton` takes it on CUDA for K <= its MAX_K; the default is torch.topk."""

import os

import torch


def use_triton(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and os.environ.get("VLLM_DDTREE_TREE_KERNELS", "triton") != "torch"


def use_triton_top_k(tensor: torch.Tensor, k: int) -> bool:
    from vllm_ddtree.tree.triton_topk import MAX_K

    return tensor.is_cuda and os.environ.get("VLLM_DDTREE_TOP_K", "torch") == "triton" and k <= MAX_K

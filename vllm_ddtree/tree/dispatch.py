"""Which implementation of the tree operations runs: Triton kernels on CUDA tensors (one launch each), the
tensor-op versions elsewhere. `VLLM_DDTREE_TREE_KERNELS=torch` forces the tensor-op versions on CUDA too (they
are the reference the kernels are tested against).

The drafter's top-K (`build.top_tokens`) has its own switch, `VLLM_DDTREE_TOP_K=auto|triton|torch`. `auto`, the
default, takes the Triton top-K (tree/triton_topk.py) where session 34's bench_tree on the H200 timed it faster
than torch.topk with its log-probabilities (vocab 151,936, depth 15; docs/benchmarks.md): K <= 32 from 64 rows
(batch x depth) on, e.g. 0.43 against 0.88 ms at batch 32 and K = 15. It was slower at K = 64 (1.63 against
0.89 ms at batch 32) and at batch 1 with K = 15 (0.155 against 0.138 ms). `triton` takes it for every K <= its
MAX_K, `torch` never."""

import torch

from vllm_ddtree.env import env_choice

TREE_KERNELS_ENV = "VLLM_DDTREE_TREE_KERNELS"
TREE_KERNELS_CHOICES = ("triton", "torch")
TOP_K_ENV = "VLLM_DDTREE_TOP_K"
TOP_K_CHOICES = ("auto", "triton", "torch")
# `auto` takes the Triton top-K for K <= AUTO_TRITON_TOP_K_MAX_K over at least AUTO_TRITON_TOP_K_MIN_ROWS rows.
AUTO_TRITON_TOP_K_MAX_K = 32
AUTO_TRITON_TOP_K_MIN_ROWS = 64


def use_triton(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and tree_kernels_choice() == "triton"


def tree_kernels_choice() -> str:
    """VLLM_DDTREE_TREE_KERNELS, checked (config.split_ddtree_config reads it once at engine start, so a typo fails
    there instead of meaning triton)."""
    return env_choice(TREE_KERNELS_ENV, TREE_KERNELS_CHOICES, "is not one of triton, torch; unset it for the Triton "
                      "kernels on CUDA (torch: the tensor-op versions they are tested against)")  # fmt: skip


def use_triton_top_k(draft_logits: torch.Tensor, k: int) -> bool:
    """Whether `build.top_tokens` takes the Triton top-K for these [..., V] CUDA logits and this k."""
    if not draft_logits.is_cuda:
        return False
    rows = draft_logits.numel() // max(draft_logits.shape[-1], 1)
    return triton_top_k_wanted(top_k_choice(), rows, k)


def top_k_choice() -> str:
    """VLLM_DDTREE_TOP_K, checked (config.split_ddtree_config reads it once at engine start, so a typo fails there)."""
    return env_choice(TOP_K_ENV, TOP_K_CHOICES, f"is not one of {', '.join(TOP_K_CHOICES)}; unset it for auto "
                      "(the Triton top-K where it was timed faster)")  # fmt: skip


def triton_top_k_wanted(choice: str, rows: int, k: int) -> bool:
    """The rule of the module docstring for `VLLM_DDTREE_TOP_K=choice`, `rows` logits rows and top-k."""
    from vllm_ddtree.tree.triton_topk import MAX_K

    if choice == "torch" or k > MAX_K:
        return False
    return choice == "triton" or (k <= AUTO_TRITON_TOP_K_MAX_K and rows >= AUTO_TRITON_TOP_K_MIN_ROWS)

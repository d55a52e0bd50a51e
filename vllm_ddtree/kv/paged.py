"""Slot-level views of one layer's paged KV cache, per attention backend layout.

A slot is `block_id * block_size + offset`, as in vLLM's `slot_mapping`. `PagedKV` reads the keys and values of
given slots and copies slots to other slots, whatever the backend's tensor layout.
"""

from __future__ import annotations

import torch


class PagedKV:
    """Keys/values of one layer, addressed by slot.

    `keys` and `values` are views indexed [block, offset] -> [num_kv_heads, head_size] through `_index`.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, block_size: int, cpu_layout: bool):
        self.keys = keys  # CPU layout: [num_blocks, H, head_size, block_size]; else [num_blocks, block_size, H, D]
        # (GPU layouts: views whose last dim is contiguous, as the Triton kernels need)
        self.values = values  # CPU layout: [num_blocks, H, block_size, head_size]; else [num_blocks, block_size, H, D]
        self.block_size = block_size
        self._cpu_layout = cpu_layout

    @classmethod
    def for_cpu_attention(cls, kv_cache: torch.Tensor) -> "PagedKV":
        """vLLM's CPU_ATTN cache: [num_blocks, H, block_size, 2 * head_size]; per (block, head) the keys are
        stored transposed ([head_size, block_size]) followed by the values ([block_size, head_size])."""
        num_blocks, num_heads, block_size, two_d = kv_cache.shape
        head_size = two_d // 2
        flat = kv_cache.view(num_blocks, num_heads, 2, block_size * head_size)
        keys = flat[:, :, 0].view(num_blocks, num_heads, head_size, block_size)
        values = flat[:, :, 1].view(num_blocks, num_heads, block_size, head_size)
        return cls(keys, values, block_size, cpu_layout=True)

    @classmethod
    def for_packed(cls, kv_cache: torch.Tensor, head_size: int) -> "PagedKV":
        """vLLM 0.26's GPU caches (FLASH_ATTN, FLASHINFER, TRITON_ATTN, FLEX_ATTENTION): logical
        [num_blocks, H, block_size, 2 * head_size], keys then values in the last dim, any stride order."""
        nhd = kv_cache.transpose(1, 2)  # [num_blocks, block_size, H, 2 * D]
        return cls(nhd[..., :head_size], nhd[..., head_size:], kv_cache.shape[2], cpu_layout=False)

    @classmethod
    def for_nhd(cls, kv_cache: torch.Tensor) -> "PagedKV":
        """FlashAttention-style cache: [2, num_blocks, block_size, H, D]."""
        return cls(kv_cache[0], kv_cache[1], kv_cache.shape[2], cpu_layout=False)

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [n, H, D] of `slots` [n]."""
        block, offset = slots // self.block_size, slots % self.block_size
        if self._cpu_layout:
            return self.keys[block, :, :, offset], self.values[block, :, offset, :]
        return self.keys[block, offset], self.values[block, offset]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """KV of slot src[i] -> slot dst[i]; all reads happen before all writes."""
        k, v = self.read(src)
        block, offset = dst // self.block_size, dst % self.block_size
        if self._cpu_layout:
            self.keys[block, :, :, offset] = k
            self.values[block, :, offset, :] = v
        else:
            self.keys[block, offset] = k
            self.values[block, offset] = v


def paged_kv_for(impl, kv_cache: torch.Tensor) -> PagedKV:
    """The slot view of `kv_cache` for the attention implementation `impl` that owns it."""
    if isinstance(kv_cache, (list, tuple)):  # one cache per virtual engine in some vLLM versions
        kv_cache = kv_cache[0]
    if type(impl).__name__ == "CPUAttentionBackendImpl":
        return PagedKV.for_cpu_attention(kv_cache)
    if kv_cache.dim() == 5 and kv_cache.shape[0] == 2:
        return PagedKV.for_nhd(kv_cache)
    if kv_cache.dim() == 4 and kv_cache.shape[-1] == 2 * impl.head_size:
        return PagedKV.for_packed(kv_cache, impl.head_size)
    raise NotImplementedError(
        f"DDTree does not know the KV cache layout of {type(impl).__name__} (shape {tuple(kv_cache.shape)}); "
        "use the FLASH_ATTN or FLASHINFER backend on GPU, or CPU_ATTN on CPU."
    )

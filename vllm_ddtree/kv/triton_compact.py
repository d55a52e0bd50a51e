"""KV compaction on the GPU: the accepted paths' keys and values move in every target layer in one launch.

The layers' caches are separate tensors of one shape; the kernel gets a table of their base addresses and
copies, per (layer, request), the slot of scheduled token src[m] -> the slot of token dst[m] for m = 0, 1, ... in
order, in place (slots read from the step's slot mapping inside the kernel: no gathers on the host). Move m writes
the slot of node m + 1 and reads the slot of the accepted node at depth m + 1, whose index q is >= m + 1 (parents
precede children). Node q's slot is written only by move q - 1, which comes after move m when q > m + 1, so
every slot is read before it is overwritten. Entries with src == dst (nothing to move, padding) are skipped.

`copy_kv_slot` is also the compaction stage of the walk's launch (`tree.triton_walk`), which moves the accepted
paths' KV in the same launch that finds them when the target's layers form one KV cache group.

Launch safety: no host-device synchronization, capture-safe for fixed shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_ddtree.triton_jit import jit_unspecialized

_COPY_TYPE = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


@triton.jit
def layer_slot_offsets(NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_HD: tl.constexpr, stride_h):  # fmt: skip
    """([BLOCK_H, BLOCK_HD] element offsets of one slot's heads and dims from the slot's start, their mask)."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HD)
    ok = (h < NUM_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    return h[:, None].to(tl.int64) * stride_h + d[None, :], ok


@triton.jit
def copy_kv_slot(base, src, dst, inner, ok, stride_b, stride_s, v_offset, PAGE: tl.constexpr):
    """One layer's keys and values of KV slot `src` copied to slot `dst` (nothing where they are equal)."""
    if src != dst:
        src_at = (src // PAGE) * stride_b + (src % PAGE) * stride_s
        dst_at = (dst // PAGE) * stride_b + (dst % PAGE) * stride_s
        k = tl.load(base + src_at + inner, mask=ok)
        v = tl.load(base + v_offset + src_at + inner, mask=ok)
        tl.store(base + dst_at + inner, k, mask=ok)
        tl.store(base + v_offset + dst_at + inner, v, mask=ok)


@jit_unspecialized()
def _compact_kv_kernel(
    LayerBase,  # [L] int64 address of each layer's key at slot 0, head 0
    SlotMapping,  # [num_tokens] integer, the KV slot of each scheduled token
    SrcToken,  # [R, M] int64 scheduled-token index whose KV moves ...
    DstToken,  # [R, M] int64 ... to this token's slot
    num_moves,  # M
    stride_b,  # element strides of the [num_blocks, block_size, H, D] key view (same in every layer)
    stride_s,
    stride_h,
    v_offset,  # element offset of a slot's values from its keys
    PAGE: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HD: tl.constexpr,
    COPY_TYPE: tl.constexpr,
):
    layer = tl.program_id(0)
    req = tl.program_id(1)
    base = tl.load(LayerBase + layer).to(tl.pointer_type(COPY_TYPE))
    inner, ok = layer_slot_offsets(NUM_HEADS, HEAD_DIM, BLOCK_H, BLOCK_HD, stride_h)  # [BLOCK_H, BLOCK_HD]
    row = req.to(tl.int64) * num_moves
    for m in range(num_moves):
        src = tl.load(SlotMapping + tl.load(SrcToken + row + m)).to(tl.int64)
        dst = tl.load(SlotMapping + tl.load(DstToken + row + m)).to(tl.int64)
        copy_kv_slot(base, src, dst, inner, ok, stride_b, stride_s, v_offset, PAGE)


class LayerTable:
    """Base addresses of a set of same-shaped layer caches, kept on the device (built once per cache set)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]):
        first_k, first_v = keys[0], values[0]
        for k, v in zip(keys, values):
            if (
                k.shape != first_k.shape
                or k.stride() != first_k.stride()
                or v.stride() != first_k.stride()
                or k.dtype != first_k.dtype
                or v.data_ptr() - k.data_ptr() != first_v.data_ptr() - first_k.data_ptr()
            ):
                raise ValueError("LayerTable needs caches of one shape, stride and key/value spacing")
        assert first_k.stride(3) == 1
        self.element_size = first_k.element_size()
        self.shape = tuple(first_k.shape)  # [num_blocks, block_size, H, D]
        self.strides = first_k.stride()[:3]
        self.v_offset = (first_v.data_ptr() - first_k.data_ptr()) // self.element_size
        self.key_ptrs = [k.data_ptr() for k in keys]
        self.base = torch.tensor(self.key_ptrs, dtype=torch.int64).to(first_k.device)
        _, page, num_heads, head_dim = self.shape
        # What a kernel that copies slots of these caches takes (`copy_kv_slot`): strides, then constexprs.
        self.copy_args = (*self.strides, self.v_offset)
        self.copy_constants = dict(
            PAGE=page, NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_HD=triton.next_power_of_2(head_dim), COPY_TYPE=_COPY_TYPE[self.element_size],
        )  # fmt: skip


def compact_kv_triton_(
    table: LayerTable,
    src: torch.Tensor,  # [R, M] int64 scheduled-token index whose KV moves
    dst: torch.Tensor,  # [R, M] int64 scheduled-token index whose slot it moves to
    slot_mapping: torch.Tensor,  # [num_tokens] integer, the KV slot of each scheduled token
) -> None:
    num_reqs, num_moves = src.shape
    if num_reqs == 0 or num_moves == 0:
        return
    _compact_kv_kernel[(len(table.key_ptrs), num_reqs)](
        table.base, slot_mapping.contiguous(), src.contiguous(), dst.contiguous(), num_moves, *table.copy_args,
        **table.copy_constants, num_warps=4,
    )  # fmt: skip

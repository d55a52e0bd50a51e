"""The drafter's per-depth top-K tokens and their log-probabilities in three Triton launches (a candidate for the
CUDA path of `build.top_tokens`; `dispatch.use_triton_top_k` says when it runs).

On CUDA `top_tokens` spends most of its time in torch.topk's radix select (0.64 ms at the Qwen3-8B shape, batch 32:
480 rows of 151,936 logits; session 31), and the chain it is compared with takes one argmax. Here each row is read
twice and only a few logits of it are ever ranked:

1. one program per (row, chunk of `chunk` logits): the chunk's max and sum of exp (for the row's log-sum-exp);
2. one program per (row, chunk): the row's floor, the K-th largest of its chunk maxima (K distinct logits, so
   every logit of the row's top K is at or above it), then the chunk's best logits at or above the floor, by
   rounds of (max, then the lowest id holding it) in registers, at most K; most chunks hold none;
3. one program per row: the row's log-sum-exp from the chunks' (max, sum), and the K best of the chunks'
   candidates by the same rounds.

Equal logits go to the lower token id, also at the K-th place: the exact rule of `build.py`'s module docstring
(which torch.topk does not follow). Candidates are laid out chunk by chunk and, within a chunk, in pick order, so
among equal logits the lower position is the lower id. Unused candidate slots hold id V, which the merge never
picks. With fewer than K chunks the floor is -inf (every logit is a candidate), so the default chunk width shrinks
until the row has K chunks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Launch knobs: at most CHUNK logits per program (fewer where the row would have fewer than K chunks, down to
# MIN_CHUNK). The kernels are used for K <= MAX_K (up to K rounds per program).
CHUNK = 4096
MIN_CHUNK = 256
MAX_K = 64


@triton.jit
def _chunk_stats_kernel(
    logits_ptr,  # [R, V] (row stride `row_stride`, unit stride along V), any float dtype
    chunk_max_ptr,  # [R, C] float32
    chunk_sum_ptr,  # [R, C] float32 sum of exp(logit - chunk max)
    row_stride,
    V,
    num_chunks,
    CHUNK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    ids = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = ids < V
    x = tl.load(logits_ptr + row * row_stride + ids, mask=valid, other=float("-inf")).to(tl.float32)
    peak = tl.max(x, 0)
    exp_sum = tl.sum(tl.where(valid, tl.exp(x - peak), 0.0), 0)
    out = row * num_chunks + chunk
    tl.store(chunk_max_ptr + out, peak)
    tl.store(chunk_sum_ptr + out, tl.where(peak == float("-inf"), 0.0, exp_sum))


@triton.jit
def _chunk_top_k_kernel(
    logits_ptr,  # [R, V] as above
    chunk_max_ptr,  # [R, C] float32
    cand_val_ptr,  # [R, C, K] float32 the chunk's best logits at or above the row's floor, non-increasing
    cand_id_ptr,  # [R, C, K] int32 their ids (V: no candidate in that slot)
    row_stride,
    V,
    num_chunks,
    K: tl.constexpr,
    K_PAD: tl.constexpr,  # power of two >= K
    CHUNK: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,  # power of two >= C
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    out = (row * num_chunks + chunk) * K
    slots = tl.arange(0, K_PAD)
    tl.store(cand_id_ptr + out + slots, tl.zeros([K_PAD], dtype=tl.int32) + V, mask=slots < K)
    tl.store(cand_val_ptr + out + slots, tl.full([K_PAD], float("-inf"), tl.float32), mask=slots < K)

    # The row's floor: the K-th largest chunk max (-inf with fewer than K chunks). The K largest chunk maxima are
    # K distinct logits, so every logit of the row's top K is at or above it.
    c = tl.arange(0, CHUNKS_PAD)
    peaks = tl.load(chunk_max_ptr + row * num_chunks + c, mask=c < num_chunks, other=float("-inf"))
    left = c < num_chunks
    floor = tl.max(peaks, 0)  # (a float32 scalar like its updates: the loop carries one type)
    for _ in range(K):
        floor = tl.max(tl.where(left, peaks, float("-inf")), 0)
        drop = tl.min(tl.where(left & (peaks == floor), c, CHUNKS_PAD), 0)
        left = left & (c != drop)
    floor = tl.where(num_chunks >= K, floor, float("-inf"))

    ids = chunk * CHUNK + tl.arange(0, CHUNK)
    alive = ids < V
    x = tl.load(logits_ptr + row * row_stride + ids, mask=alive, other=float("-inf")).to(tl.float32)
    alive = alive & (x >= floor)
    picks = tl.minimum(tl.sum(alive.to(tl.int32), 0), K)  # most chunks hold none of the row's top K
    for i in range(picks):
        best = tl.max(tl.where(alive, x, float("-inf")), 0)
        pick = tl.min(tl.where(alive & (x == best), ids, V), 0)
        tl.store(cand_val_ptr + out + i, best)
        tl.store(cand_id_ptr + out + i, pick)
        alive = alive & (ids != pick)


@triton.jit
def _merge_top_k_kernel(
    cand_val_ptr,  # [R, C, K] float32
    cand_id_ptr,  # [R, C, K] int32
    chunk_max_ptr,  # [R, C] float32
    chunk_sum_ptr,  # [R, C] float32
    out_id_ptr,  # [R, K] int64
    out_lp_ptr,  # [R, K] float32
    V,
    num_chunks,
    K: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,  # power of two >= C
    CANDIDATES_PAD: tl.constexpr,  # power of two >= C * K
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS_PAD)
    peaks = tl.load(chunk_max_ptr + row * num_chunks + c, mask=c < num_chunks, other=float("-inf"))
    sums = tl.load(chunk_sum_ptr + row * num_chunks + c, mask=c < num_chunks, other=0.0)
    peak = tl.max(peaks, 0)
    log_sum_exp = peak + tl.log(tl.sum(tl.where(sums > 0, sums * tl.exp(peaks - peak), 0.0), 0))

    pos = tl.arange(0, CANDIDATES_PAD)
    present = pos < num_chunks * K
    base = row * num_chunks * K
    val = tl.load(cand_val_ptr + base + pos, mask=present, other=float("-inf"))
    cid = tl.load(cand_id_ptr + base + pos, mask=present, other=V)
    alive = present & (cid < V)
    for i in range(K):
        best = tl.max(tl.where(alive, val, float("-inf")), 0)
        at = tl.min(tl.where(alive & (val == best), pos, CANDIDATES_PAD), 0)
        token = tl.sum(tl.where(pos == at, cid, 0), 0)
        tl.store(out_id_ptr + row * K + i, token.to(tl.int64))
        tl.store(out_lp_ptr + row * K + i, best - log_sum_exp)
        alive = alive & (pos != at)


def chunk_width(vocab: int, k: int) -> int:
    """The widest power-of-two chunk up to CHUNK that still gives a row K chunks (not below MIN_CHUNK)."""
    width = CHUNK
    while width > MIN_CHUNK and triton.cdiv(vocab, width) < k:
        width //= 2
    return width


def top_tokens_triton(
    draft_logits: torch.Tensor, k: int, chunk: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`build.top_tokens` for [..., V] logits: ([..., K] int64 ids by logit descending, lower id first among equal
    logits; [..., K] float32 log-softmax at them). K <= MAX_K; no host sync (sizes come from shapes only)."""
    assert 1 <= k <= min(MAX_K, draft_logits.shape[-1]), (k, draft_logits.shape)
    vocab = draft_logits.shape[-1]
    chunk = chunk or chunk_width(vocab, k)
    rows = draft_logits.reshape(-1, vocab)  # [R, V]
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    num_rows, num_chunks = rows.shape[0], triton.cdiv(vocab, chunk)
    device = rows.device
    cand_val = torch.empty(num_rows, num_chunks, k, device=device, dtype=torch.float32)  # [R, C, K]
    cand_id = torch.empty(num_rows, num_chunks, k, device=device, dtype=torch.int32)  # [R, C, K]
    chunk_max = torch.empty(num_rows, num_chunks, device=device, dtype=torch.float32)  # [R, C]
    chunk_sum = torch.empty(num_rows, num_chunks, device=device, dtype=torch.float32)  # [R, C]
    token_ids = torch.empty(num_rows, k, device=device, dtype=torch.int64)  # [R, K]
    log_probs = torch.empty(num_rows, k, device=device, dtype=torch.float32)  # [R, K]
    if num_rows:
        grid = (num_rows, num_chunks)
        chunks_pad = triton.next_power_of_2(num_chunks)
        _chunk_stats_kernel[grid](rows, chunk_max, chunk_sum, rows.stride(0), vocab, num_chunks, CHUNK=chunk)
        _chunk_top_k_kernel[grid](
            rows, chunk_max, cand_val, cand_id, rows.stride(0), vocab, num_chunks, K=k,
            K_PAD=triton.next_power_of_2(k), CHUNK=chunk, CHUNKS_PAD=chunks_pad,
        )  # fmt: skip
        _merge_top_k_kernel[(num_rows,)](
            cand_val, cand_id, chunk_max, chunk_sum, token_ids, log_probs, vocab, num_chunks, K=k,
            CHUNKS_PAD=chunks_pad, CANDIDATES_PAD=triton.next_power_of_2(num_chunks * k),
        )  # fmt: skip
    shape = (*draft_logits.shape[:-1], k)
    return token_ids.view(shape), log_probs.view(shape)

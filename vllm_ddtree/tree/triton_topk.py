"""The drafter's per-depth top-K tokens and their log-probabilities in two Triton launches (a candidate for the
CUDA path of `build.top_tokens`; `dispatch.use_triton_top_k` says when it runs).

On CUDA `top_tokens` spends most of its time in torch.topk's radix select (0.64 ms at the Qwen3-8B shape, batch 32:
480 rows of 151,936 logits; session 31), and the chain it is compared with takes one argmax. Here each row is read
once:

1. one program per (row, chunk of CHUNK logits): the chunk's max and sum of exp (for the row's log-sum-exp), and
   its K best logits by K rounds of (max, then the lowest id holding it), in registers;
2. one program per row: the row's log-sum-exp from the chunks' (max, sum), and the K best of the chunks' C * K
   candidates by the same rounds.

Equal logits go to the lower token id, also at the K-th place: the exact rule of `build.py`'s module docstring
(which torch.topk does not follow). Candidates are laid out chunk by chunk and, within a chunk, in pick order, so
among equal logits the lower position is the lower id. A chunk with fewer than K logits (the last one, or a
vocabulary smaller than K) pads with id V, which the merge never picks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Launch knobs: CHUNK logits per first-stage program. The kernel is used for K <= MAX_K (K rounds per program).
CHUNK = 4096
MAX_K = 64


@triton.jit
def _chunk_top_k_kernel(
    logits_ptr,  # [R, V] (row stride `row_stride`, unit stride along V), any float dtype
    cand_val_ptr,  # [R, C, K] float32 the chunk's K best logits, non-increasing
    cand_id_ptr,  # [R, C, K] int32 their ids (V: none left)
    chunk_max_ptr,  # [R, C] float32
    chunk_sum_ptr,  # [R, C] float32 sum of exp(logit - chunk max)
    row_stride,
    V,
    num_chunks,
    K: tl.constexpr,
    CHUNK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    ids = chunk * CHUNK + tl.arange(0, CHUNK)
    alive = ids < V
    x = tl.load(logits_ptr + row * row_stride + ids, mask=alive, other=float("-inf")).to(tl.float32)
    peak = tl.max(x, 0)
    exp_sum = tl.sum(tl.where(alive, tl.exp(x - peak), 0.0), 0)
    out = row * num_chunks + chunk
    tl.store(chunk_max_ptr + out, peak)
    tl.store(chunk_sum_ptr + out, tl.where(peak == float("-inf"), 0.0, exp_sum))
    for i in range(K):
        best = tl.max(tl.where(alive, x, float("-inf")), 0)
        pick = tl.min(tl.where(alive & (x == best), ids, V), 0)
        tl.store(cand_val_ptr + out * K + i, best)
        tl.store(cand_id_ptr + out * K + i, pick)
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


def top_tokens_triton(draft_logits: torch.Tensor, k: int, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """`build.top_tokens` for [..., V] logits: ([..., K] int64 ids by logit descending, lower id first among equal
    logits; [..., K] float32 log-softmax at them). K <= MAX_K; no host sync (sizes come from shapes only)."""
    assert 1 <= k <= min(MAX_K, draft_logits.shape[-1]), (k, draft_logits.shape)
    vocab = draft_logits.shape[-1]
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
        _chunk_top_k_kernel[(num_rows, num_chunks)](
            rows, cand_val, cand_id, chunk_max, chunk_sum, rows.stride(0), vocab, num_chunks, K=k, CHUNK=chunk
        )
        _merge_top_k_kernel[(num_rows,)](
            cand_val, cand_id, chunk_max, chunk_sum, token_ids, log_probs, vocab, num_chunks, K=k,
            CHUNKS_PAD=triton.next_power_of_2(num_chunks), CANDIDATES_PAD=triton.next_power_of_2(num_chunks * k),
        )  # fmt: skip
    shape = (*draft_logits.shape[:-1], k)
    return token_ids.view(shape), log_probs.view(shape)

"""The drafter's per-depth top-K tokens and their log-probabilities in two launches: the CUDA path of
`build.top_tokens`.

torch.topk (a radix select, several passes over the logits) and a float32 log-softmax (which writes a float32 copy
of them) took ~0.95 ms of the 3.8 ms draft at the Qwen3-8B shape, batch 32 (session 31's profile: 480 rows of
151,936 logits), where the chain's argmax takes one pass. Here:
- `_chunk_top_keys_kernel`, one program per (row, chunk of the vocabulary): reads its chunk once and keeps its
  best K2 tokens (K2 = K rounded up to a power of two) and its (max, sum of exp(logit - max));
- `_merge_chunks_kernel`, one program per row: the best K of the row's C * K2 candidates, the row's log-sum-exp
  from the C pairs, and each chosen token's log-probability (logit - max) - log(sum), as log-softmax computes it.

Each token is one int64 key: its float32 logit's bits made order-preserving in the high 32 bits, V - 1 - id in the
low 32. Keys are distinct and sort as (logit descending, id ascending), so the K largest are build.py's per-depth
ranking exactly, equal logits by lower id first, also at the K-th place. -0.0 counts as +0.0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096  # vocabulary entries a first-stage program reads (151,936 -> 38 chunks per row)


@triton.jit
def _token_keys(x, ids, valid, vocab):
    """int64 keys of float32 logits `x` at token `ids` (module docstring); -2^63 where not `valid`."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)  # -0.0 as +0.0
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # signed order of the floats
    ordered = tl.where(valid, ordered, -2147483648).to(tl.int64)
    low = tl.where(valid, vocab - 1 - ids, 0).to(tl.int64)
    return (ordered << 32) | low


@triton.jit
def _chunk_top_keys_kernel(
    logits_ptr,  # [N, V] float32/16-bit, unit stride along V
    keys_ptr,  # [N, C, K2] int64 out: each chunk's best keys, descending
    max_ptr,  # [N, C] float32 out: each chunk's max logit
    sum_exp_ptr,  # [N, C] float32 out: each chunk's sum of exp(logit - max)
    row_stride,
    vocab,
    K2: tl.constexpr,
    CHUNK_SIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    num_chunks = tl.num_programs(1)
    ids = chunk * CHUNK_SIZE + tl.arange(0, CHUNK_SIZE)
    valid = ids < vocab
    x = tl.load(logits_ptr + row * row_stride + ids, mask=valid, other=float("-inf")).to(tl.float32)
    x_max = tl.max(x, axis=0)
    shift = tl.where(x_max == float("-inf"), 0.0, x_max)
    sum_exp = tl.sum(tl.exp(x - shift), axis=0)
    top = tl.topk(_token_keys(x, ids, valid, vocab), K2)  # [K2] descending
    slot = row * num_chunks + chunk
    tl.store(keys_ptr + slot * K2 + tl.arange(0, K2), top)
    tl.store(max_ptr + slot, x_max)
    tl.store(sum_exp_ptr + slot, sum_exp)


@triton.jit
def _merge_chunks_kernel(
    logits_ptr,  # [N, V] as above
    keys_ptr,  # [N, C, K2] int64
    max_ptr,  # [N, C] float32
    sum_exp_ptr,  # [N, C] float32
    token_ids_ptr,  # [N, K] int64 out
    log_probs_ptr,  # [N, K] float32 out
    row_stride,
    vocab,
    num_chunks,
    k,
    K2: tl.constexpr,
    CANDIDATES: tl.constexpr,  # power of two >= C * K2
    CHUNKS: tl.constexpr,  # power of two >= C
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CANDIDATES)
    present = offs < num_chunks * K2
    keys = tl.load(keys_ptr + row * num_chunks * K2 + offs, mask=present, other=0)
    keys = tl.where(present, keys, tl.full([CANDIDATES], -2147483648, tl.int64) << 32)
    top = tl.topk(keys, K2)  # [K2] descending
    token_ids = (vocab - 1) - (top & 0xFFFFFFFF)
    chunks = tl.arange(0, CHUNKS)
    seen = chunks < num_chunks
    chunk_max = tl.load(max_ptr + row * num_chunks + chunks, mask=seen, other=float("-inf"))
    chunk_sum = tl.load(sum_exp_ptr + row * num_chunks + chunks, mask=seen, other=0.0)
    row_max = tl.max(chunk_max, axis=0)
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    log_sum = tl.log(tl.sum(chunk_sum * tl.exp(chunk_max - shift), axis=0))
    rank = tl.arange(0, K2)
    kept = rank < k
    logits = tl.load(logits_ptr + row * row_stride + token_ids, mask=kept, other=0.0).to(tl.float32)
    tl.store(token_ids_ptr + row * k + rank, token_ids, mask=kept)
    tl.store(log_probs_ptr + row * k + rank, (logits - row_max) - log_sum, mask=kept)


def top_tokens_triton(draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`build.top_tokens` in two launches: ([..., K] int64 token ids, [..., K] float32 log-probs) of
    [..., V] logits, ranked by logit descending, equal logits by lower id first."""
    vocab = draft_logits.shape[-1]
    assert 1 <= k <= vocab, (k, vocab)
    logits = draft_logits.reshape(-1, vocab)  # [N, V]
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows = logits.shape[0]
    k2 = triton.next_power_of_2(k)
    chunk = max(min(CHUNK, triton.next_power_of_2(vocab)), k2)
    num_chunks = triton.cdiv(vocab, chunk)
    device = logits.device
    keys = torch.empty((rows, num_chunks, k2), dtype=torch.int64, device=device)
    chunk_max = torch.empty((rows, num_chunks), dtype=torch.float32, device=device)
    chunk_sum = torch.empty((rows, num_chunks), dtype=torch.float32, device=device)
    token_ids = torch.empty((rows, k), dtype=torch.int64, device=device)
    log_probs = torch.empty((rows, k), dtype=torch.float32, device=device)
    if rows:
        _chunk_top_keys_kernel[(rows, num_chunks)](
            logits, keys, chunk_max, chunk_sum, logits.stride(0), vocab, K2=k2, CHUNK_SIZE=chunk,
        )  # fmt: skip
        _merge_chunks_kernel[(rows,)](
            logits, keys, chunk_max, chunk_sum, token_ids, log_probs, logits.stride(0), vocab, num_chunks, k,
            K2=k2, CANDIDATES=triton.next_power_of_2(num_chunks * k2), CHUNKS=triton.next_power_of_2(num_chunks),
        )  # fmt: skip
    shape = (*draft_logits.shape[:-1], k)
    return token_ids.view(shape), log_probs.view(shape)

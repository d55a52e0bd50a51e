"""vLLM's `bad_words` at every tree node, matched along the node's own path.

vLLM's rule (both model runners): a bad word w_1 .. w_L bans w_L as the next token when the request's last L - 1
output tokens are w_1 .. w_{L-1}; prompt tokens never count, and a one-token word is banned everywhere. A tree
node's logits row predicts the token after the request's output tokens (the root, the last of them, included)
followed by the node's path below the root, so each word is matched against that sequence, node by node. A node
off the target's path can thus ban a token that the target's own choices never see, which is right: the walk
only ever reads the choices on its path.

The words are host data (sampling parameters); the nodes' tokens stay on the device. Both runners call
`mask_bad_words_`: the V1 scorer with the request's output tokens from its token lists, Model Runner V2's
wrapper (`install_tree_bad_words`) with them read from V2's `all_token_ids` on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_ddtree.verify.step import TreeStep, to_device
from vllm_ddtree.verify.v2_processors import wrap_v2_processor

NO_TOKEN = -1  # a context slot before the request's first output token


@dataclass
class BatchBadWords:
    """The batch's bad words, one row per word."""

    request: torch.Tensor  # [W] int64 the request (batch row) of each word
    prefix: torch.Tensor  # [W, P] int64 tokens before the banned one, latest first (w_{L-1}, w_{L-2}, ..)
    prefix_used: torch.Tensor  # [W, P] bool, the word has a token in that slot
    banned: torch.Tensor  # [W] int64 the word's last token

    @property
    def context_length(self) -> int:
        return self.prefix.shape[1]


def batch_bad_words(words_by_request: dict[int, list[list[int]]], device) -> BatchBadWords | None:
    """`BatchBadWords` of {request: [token ids of each word]} (vLLM's `bad_words_token_ids`), None if empty."""
    words = [(req, word) for req, req_words in sorted(words_by_request.items()) for word in req_words if word]
    if not words:
        return None
    length = max(1, max(len(word) - 1 for _, word in words))
    prefix = np.full((len(words), length), NO_TOKEN, dtype=np.int64)
    for row, (_, word) in enumerate(words):
        prefix[row, : len(word) - 1] = word[-2::-1]
    used = np.arange(length)[None, :] < np.array([len(word) - 1 for _, word in words])[:, None]
    return BatchBadWords(
        request=to_device(np.array([req for req, _ in words], dtype=np.int64), device),
        prefix=to_device(prefix, device),
        prefix_used=to_device(used, device),
        banned=to_device(np.array([word[-1] for _, word in words], dtype=np.int64), device),
    )


def output_tails(output_token_ids: list[list[int]], requests, length: int, num_reqs: int) -> np.ndarray:
    """[R, length] the last `length` output tokens of each request in `requests` (latest last), NO_TOKEN-padded on
    the left; other rows all NO_TOKEN."""
    tails = np.full((num_reqs, length), NO_TOKEN, dtype=np.int64)
    for req in requests:
        tail = output_token_ids[req][-length:]
        if tail:
            tails[req, length - len(tail) :] = tail
    return tails


def node_contexts(
    step: TreeStep,
    node_tokens: torch.Tensor,  # [R, N] token of every node
    output_tail: torch.Tensor,  # [R, P] each request's last P output tokens, latest last (the root's), NO_TOKEN-padded
) -> torch.Tensor:
    """[R, N, P] the k-th latest token before each node's next one (k = 0: the node's own token): the node's path
    below the root, latest first, then the request's output tokens."""
    num_reqs, width = step.parents.shape
    length = output_tail.shape[1]
    node = torch.arange(width, device=node_tokens.device).expand(num_reqs, width)  # [R, N] k-th ancestor
    contexts = []
    for k in range(length):
        below_root = k < step.depths  # [R, N] the node's k-th ancestor is not the root yet
        from_outputs = output_tail.gather(1, (length - 1 - (k - step.depths)).clamp(0, length - 1))
        contexts.append(torch.where(below_root, node_tokens.gather(1, node), from_outputs))
        node = torch.where(below_root, step.parents.gather(1, node).clamp(min=0), node)
    return torch.stack(contexts, dim=-1)


def mask_bad_words_(
    logits: torch.Tensor,  # [rows, V] one row per valid node, modified in place
    step: TreeStep,
    node_tokens: torch.Tensor,  # [R, N]
    output_tail: torch.Tensor,  # [R, P >= words.context_length] as in `node_contexts`
    words: BatchBadWords,
) -> torch.Tensor:
    """Set -inf where a bad word bans the token at a node; returns `logits`."""
    width = step.parents.shape[1]
    tail = output_tail[:, output_tail.shape[1] - words.context_length :]
    contexts = node_contexts(step, node_tokens, tail)[words.request]  # [W, N, P]
    matches = ((contexts == words.prefix[:, None, :]) | ~words.prefix_used[:, None, :]).all(dim=-1)  # [W, N]
    vocab = logits.shape[1]
    valid = torch.arange(width, device=logits.device)[None, :] < step.num_nodes[words.request][:, None]
    valid &= (words.banned < vocab)[:, None]  # a token past the logits bans nothing (vLLM's slice is empty there)
    banned = words.banned.clamp(max=vocab - 1)
    index = step.node_rows[words.request] * vocab + banned[:, None]  # [W, N] flat logits index
    # -inf where a word matches, +inf elsewhere: `amin` leaves those entries as they were, whatever the order of
    # words that share a (row, token).
    ban = torch.where(matches & valid, float("-inf"), float("inf")).to(logits.dtype)
    dense = logits if logits.is_contiguous() else logits.contiguous()  # V2's rows can be a strided view
    dense.view(-1).scatter_reduce_(0, index.flatten(), ban.flatten(), reduce="amin")
    if dense is not logits:
        logits.copy_(dense)
    return logits


def v2_output_tails(
    req_states,  # V2's request state: all_token_ids, prompt_len, total_len (`.gpu`) per request slot
    slots: torch.Tensor,  # [R] request slot of each request
    length: int,
) -> torch.Tensor:
    """[R, length] `output_tails` from V2's device state: the output tokens are all_token_ids[prompt_len:total_len]
    (V2 appends each step's sampled tokens there, so the root is the last)."""
    slots = slots.to(torch.int64)
    back = torch.arange(length - 1, -1, -1, device=slots.device)  # [P] steps back from the last output token
    position = req_states.total_len.gpu[slots].to(torch.int64)[:, None] - 1 - back  # [R, P]
    is_output = position >= req_states.prompt_len.gpu[slots].to(torch.int64)[:, None]
    tokens = req_states.all_token_ids.gpu[slots[:, None], position.clamp(min=0)].to(torch.int64)
    return torch.where(is_output, tokens, NO_TOKEN)


def install_tree_bad_words(bad_words_state, state) -> None:
    """Make V2's `BadWordsState` match along each node's path during a tree verification (`state.step` set), and run
    V2's own kernel otherwise (`v2_processors.wrap_v2_processor`: `apply_bad_words` in 0.26, `apply` in 0.32).
    The words are recorded on the host as requests arrive (`add_request`)."""
    words_by_slot: dict[int, list[list[int]]] = {}  # only slots whose request has bad words
    original_add = bad_words_state.add_request

    def add_request(req_idx, sampling_params, *args, **kwargs):
        words = list(sampling_params.bad_words_token_ids or [])
        if words:
            words_by_slot[req_idx] = words
        else:
            words_by_slot.pop(req_idx, None)
        return original_add(req_idx, sampling_params, *args, **kwargs)

    def tree_rule(logits, expanded_idx_mapping, idx_mapping_np, row_tokens) -> bool:
        step = state.step
        if step is None or not words_by_slot:  # most steps: nothing to look up per request
            return False
        slots_of_batch = [int(slot) for slot in idx_mapping_np]
        by_request = {req: words_by_slot[slot] for req, slot in enumerate(slots_of_batch) if slot in words_by_slot}
        words = batch_bad_words(by_request, step.parents.device)
        if words is None:
            return False
        slots = expanded_idx_mapping[step.node_rows[:, 0]]  # [R] the slot of each request, from its root's row
        tails = v2_output_tails(bad_words_state.req_states, slots, words.context_length)
        mask_bad_words_(logits, step, row_tokens.to(torch.int64)[step.node_rows], tails, words)
        return True

    if wrap_v2_processor(bad_words_state, "apply_bad_words", tree_rule):
        bad_words_state.add_request = add_request


def mask_v1_bad_words(
    logits: torch.Tensor,  # [rows, V]
    step: TreeStep,
    node_tokens: torch.Tensor,  # [R, N]
    sampling_metadata,  # V1's SamplingMetadata: bad_words_token_ids {request: words}, output_token_ids
) -> torch.Tensor:
    """[rows, V] a copy of `logits` with the V1 batch's bad words applied (the V1 scorer's step)."""
    num_reqs = step.parents.shape[0]
    by_request = {req: w for req, w in sampling_metadata.bad_words_token_ids.items() if req < num_reqs}
    words = batch_bad_words(by_request, logits.device)
    if words is None:
        return logits
    tails = output_tails(sampling_metadata.output_token_ids, by_request, words.context_length, num_reqs)
    return mask_bad_words_(logits.clone(), step, node_tokens, to_device(tails, logits.device), words)

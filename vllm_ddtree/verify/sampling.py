"""The target's choice at each tree node.

Greedy requests take the argmax, sampled requests draw one token per node from the target's processed
distribution at that node. Both see the allowed-token mask, and penalties and bad words counted along the node's
own root path; sampled requests then apply temperature, top-k/top-p (vLLM's own `apply_top_k_top_p`) and an
exponential race (argmax p / q, q ~ Exp(1)) drawn from the request's generator when it has a seed. Each node's
sample is independent of the drafter, so walking the tree along the samples yields tokens distributed exactly as
the target's (the DDTree verification rule).

Only SamplingMetadata fields are read; every tensor stays on the logits' device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_ddtree.verify.bad_words import mask_v1_bad_words
from vllm_ddtree.verify.step import TreeStep, to_device

_SAMPLING_EPS = 1e-5


def node_requests(step: TreeStep) -> torch.Tensor:
    """[rows] the request of every logits row."""
    reqs = torch.arange(step.num_nodes.shape[0], device=step.num_nodes.device)
    return reqs.repeat_interleave(step.num_nodes, output_size=int(step.num_nodes_cpu.sum()))


def path_token_counts(step: TreeStep, node_tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, V] how often each token occurs on a node's root path, the root excluded, the node included."""
    from vllm_ddtree.tree import ancestor_mask

    num_reqs, width = step.parents.shape
    on_path = ancestor_mask(step.parents)  # [R, N, N] node i, ancestor-or-self j
    on_path[:, :, 0] = False  # the root is already among the request's output tokens
    tokens = node_tokens[:, None, :].expand(num_reqs, width, width)
    counts = torch.zeros((num_reqs, width, vocab_size), dtype=torch.float32, device=node_tokens.device)
    counts.scatter_add_(2, tokens, on_path.float())
    return counts.view(num_reqs * width, vocab_size).index_select(0, valid_node_rows(step, counts.device))


def valid_node_rows(step: TreeStep, device) -> torch.Tensor:
    """[rows] index of each logits row's node in the step's flattened [R * N] node grid. Padded entries alias the
    last valid node; the valid ones come in logits-row order (from the host's node counts: a boolean mask would
    wait for the device)."""
    width = step.parents.shape[1]
    valid = np.concatenate([row * width + np.arange(n) for row, n in enumerate(step.num_nodes_cpu.tolist())])
    return to_device(valid, device)


def mask_stop_tokens_below_min_tokens(
    logits: torch.Tensor,  # [rows, V]
    node_req: torch.Tensor,  # [rows]
    step: TreeStep,
    below_min: dict,  # `compat.min_tokens_requests`: {request: (min_tokens, output ids, stop ids, _)}
) -> torch.Tensor:
    """[rows, V] `logits` (not modified) with min_tokens applied: a node at depth d follows len(output) + d
    generated tokens, so its stop tokens are masked while that is below the request's min_tokens (vLLM's rule at
    the chain's draft positions, along each node's path). On Model Runner V2, V2's own sampler does it from the
    nodes' tree positions."""
    num_reqs, vocab_size = step.parents.shape[0], logits.shape[1]
    remaining = np.zeros(num_reqs, dtype=np.int64)  # [R] depths below which the stop tokens stay masked
    reqs, stop_ids = [], []
    for req, (min_tokens, output_ids, stops, _) in below_min.items():
        if req < num_reqs and stops:
            remaining[req] = max(min_tokens - len(output_ids), 0)
            reqs += [req] * len(stops)
            stop_ids += list(stops)
    if not reqs:
        return logits
    device = logits.device
    stop_mask = torch.zeros((num_reqs, vocab_size), dtype=torch.bool, device=device)  # [R, V]
    stop_mask[to_device(np.asarray(reqs), device), to_device(np.asarray(stop_ids), device)] = True
    depth = step.depths.view(-1).index_select(0, valid_node_rows(step, device))  # [rows]
    masked_rows = depth < to_device(remaining, device)[node_req]  # [rows]
    return logits.masked_fill(masked_rows[:, None] & stop_mask[node_req], float("-inf"))


def output_token_counts(output_token_ids: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    """[R, V] counts of each request's generated tokens."""
    counts = torch.zeros((len(output_token_ids), vocab_size + 1), dtype=torch.float32)
    for row, tokens in enumerate(output_token_ids):
        if tokens:
            ids = torch.tensor(tokens, dtype=torch.int64).clamp_(min=-1, max=vocab_size)
            ids[ids < 0] = vocab_size  # placeholders of not-yet-known tokens
            counts[row].index_add_(0, ids, torch.ones(ids.shape[0]))
    return counts[:, :vocab_size].to(device)


def prompt_token_mask(prompt_token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, V] True where the token occurs in the prompt (vLLM pads prompts with `vocab_size`)."""
    mask = torch.zeros((prompt_token_ids.shape[0], vocab_size + 1), dtype=torch.bool, device=prompt_token_ids.device)
    mask.scatter_(1, prompt_token_ids.to(torch.int64), True)
    return mask[:, :vocab_size]


def apply_penalties_(
    logits: torch.Tensor,  # [rows, V] float32
    node_req: torch.Tensor,  # [rows]
    step: TreeStep,
    node_tokens: torch.Tensor,  # [R, N]
    sampling_metadata,
) -> torch.Tensor:
    vocab_size = logits.shape[1]
    base = output_token_counts(sampling_metadata.output_token_ids, vocab_size, logits.device)[node_req]
    counts = base + path_token_counts(step, node_tokens, vocab_size)  # [rows, V]
    prompt_mask = prompt_token_mask(sampling_metadata.prompt_token_ids, vocab_size)[node_req]
    return penalize(
        logits,
        counts,
        prompt_mask,
        sampling_metadata.repetition_penalties[node_req],
        sampling_metadata.frequency_penalties[node_req],
        sampling_metadata.presence_penalties[node_req],
    )


def penalize(
    logits: torch.Tensor,  # [rows, V] float32
    counts: torch.Tensor,  # [rows, V] output-token counts of each row's context (its path included)
    prompt_mask: torch.Tensor,  # [rows, V] bool, the token is in the prompt
    repetition: torch.Tensor,  # [rows]
    frequency: torch.Tensor,  # [rows]
    presence: torch.Tensor,  # [rows]
) -> torch.Tensor:
    """vLLM's repetition, frequency and presence penalties (the formulas of both model runners' samplers)."""
    output_mask = counts > 0
    seen = output_mask | prompt_mask
    repetition = repetition.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)
    logits = logits - frequency.unsqueeze(1) * counts
    return logits - presence.unsqueeze(1) * output_mask


def exponential_noise(
    shape: tuple[int, int], node_req: torch.Tensor, step: TreeStep, generators: dict, device
) -> torch.Tensor:
    """q ~ Exp(1) per (row, token); rows of seeded requests come from their own generator."""
    q = torch.empty(shape, dtype=torch.float32, device=device)
    q.exponential_()
    if generators:
        row_start = step.num_nodes_cpu.cumsum() - step.num_nodes_cpu
        for req, generator in generators.items():
            start, count = int(row_start[req]), int(step.num_nodes_cpu[req])
            q[start : start + count].exponential_(generator=generator)
    return q


@dataclass
class NodeChoices:
    token_ids: torch.Tensor  # [rows] the target's token at every logits row
    processed_logits: torch.Tensor  # [rows, V] logits the choice was made from (vLLM's "processed" logits)


def choose_nodes(
    logits: torch.Tensor,  # [rows, V]
    step: TreeStep,
    sampling_metadata,
    node_tokens: torch.Tensor,  # [R, N] token of every node
) -> NodeChoices:
    """The target's token at every logits row (one row per tree node), and the processed logits behind it.

    The processing follows vLLM's `Sampler`: allowed-token mask, penalties, bad words along each node's path
    (`bad_words.py`), min_tokens (greedy rows take the argmax here),
    then temperature, top-k/top-p and the exponential race for sampled rows. `logits` is not modified.
    """
    from vllm_ddtree.compat import apply_top_k_top_p, min_tokens_requests

    below_min = min_tokens_requests(sampling_metadata)
    bad_words = getattr(sampling_metadata, "bad_words_token_ids", None)
    unprocessed = sampling_metadata.no_penalties and sampling_metadata.allowed_token_ids_mask is None
    if sampling_metadata.all_greedy and unprocessed and not below_min and not bad_words:
        return NodeChoices(logits.argmax(dim=-1), logits)
    node_req = node_requests(step)
    logits = logits.to(torch.float32)
    if sampling_metadata.allowed_token_ids_mask is not None:
        logits = logits.masked_fill(sampling_metadata.allowed_token_ids_mask[node_req], float("-inf"))
    if not sampling_metadata.no_penalties:
        logits = apply_penalties_(logits, node_req, step, node_tokens, sampling_metadata)
    if bad_words:
        logits = mask_v1_bad_words(logits, step, node_tokens, sampling_metadata)
    if below_min:
        logits = mask_stop_tokens_below_min_tokens(logits, node_req, step, below_min)
    greedy = logits.argmax(dim=-1)
    if sampling_metadata.all_greedy:
        return NodeChoices(greedy, logits)
    temperature = sampling_metadata.temperature[node_req]
    is_greedy = temperature < _SAMPLING_EPS
    logits = logits / torch.where(is_greedy, 1.0, temperature).unsqueeze(1)
    top_k = None if sampling_metadata.top_k is None else sampling_metadata.top_k[node_req]
    top_p = None if sampling_metadata.top_p is None else sampling_metadata.top_p[node_req]
    logits = apply_top_k_top_p(logits, top_k, top_p)
    probs = logits.softmax(dim=-1)
    q = exponential_noise(probs.shape, node_req, step, sampling_metadata.generators, probs.device)
    sampled = probs.div_(q).argmax(dim=-1)
    return NodeChoices(torch.where(is_greedy, greedy, sampled), logits)


def node_choices(
    logits: torch.Tensor,  # [rows, V]
    step: TreeStep,
    sampling_metadata,
    node_tokens: torch.Tensor,  # [R, N] token of every node
) -> torch.Tensor:
    """[rows] the target's token at every logits row (one row per tree node)."""
    return choose_nodes(logits, step, sampling_metadata, node_tokens).token_ids

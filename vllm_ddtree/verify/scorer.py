"""The scorer: the target's choice at every tree node, the walk, and vLLM's sampler output.

At temperature 0 the target's choice at a node is its argmax; with sampling it is a sample from the target's
processed distribution at that node (see `sampling.py`). The walk follows those choices from the root, so the
accepted tokens are exactly what the target would have produced one token at a time.
"""

from __future__ import annotations

import torch

from vllm_ddtree.tree import WalkResult, walk_tree
from vllm_ddtree.tree.dispatch import use_triton
from vllm_ddtree.verify.step import TreeStep, chain_positions_

PLACEHOLDER_TOKEN_ID = -1


def node_tokens(step: TreeStep, input_ids: torch.Tensor) -> torch.Tensor:
    """[R, N] the token of every node, read from this step's input ids."""
    return input_ids.to(torch.int64)[step.node_token_index]


def walk_step(
    step: TreeStep,
    node_choices: torch.Tensor,  # [rows] the target's choice at every logits row
    tokens: torch.Tensor,  # [R, N] the token of every node
    max_depth: int,
) -> WalkResult:
    target = node_choices.to(torch.int64)[step.node_rows]  # [R, N]
    return walk_tree(tokens, step.parents, step.depths, target, _num_walk_nodes(step), max_depth)


def walk_and_moves_(
    step: TreeStep,
    node_choices: torch.Tensor,  # [rows] the target's choice at every logits row
    input_ids: torch.Tensor,  # [num_tokens] the step's scheduled tokens (a node's token: `node_tokens`)
    max_depth: int,
    positions: torch.Tensor,  # [num_tokens] the step's positions (tree order), put back in chain order in place
    tokens: torch.Tensor | None = None,  # [R, N] `node_tokens`, if the caller has them already (torch path)
    kv: tuple | None = None,  # `kv.compact.kv_for_the_walk`: the launch moves the accepted paths' KV too
) -> tuple[WalkResult, tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """What the runner needs after the target's choices: the walk, `accepted_path_moves` and the sampler output
    (`sampled_token_ids` as int32, [R, N]); `chain_positions_` is applied to `positions`. On CUDA all of it is
    one Triton launch, which also reads the nodes' tokens and choices itself (and with `kv`, compacts the KV)."""
    if use_triton(node_choices):
        from vllm_ddtree.tree.triton_walk import walk_and_moves_triton_

        path, num_accepted, output, src, dst, sampled = walk_and_moves_triton_(
            input_ids, step.parents, node_choices, _num_walk_nodes(step), max_depth, step.node_token_index,
            step.node_rows, step.num_nodes, positions, kv,
        )  # fmt: skip
        return WalkResult(path, num_accepted, output), (src.flatten(), dst.flatten()), sampled
    assert kv is None, "kv_for_the_walk gives no KV where the walk runs in torch"
    walk = walk_step(step, node_choices, node_tokens(step, input_ids) if tokens is None else tokens, max_depth)
    chain_positions_(positions, step)
    return walk, accepted_path_moves(step, walk), sampled_token_ids(walk, step.width).to(torch.int32)


def _num_walk_nodes(step: TreeStep) -> torch.Tensor:
    return step.num_nodes if step.num_walk_nodes is None else step.num_walk_nodes


def sampled_token_ids(walk: WalkResult, width: int) -> torch.Tensor:
    """[R, width] accepted tokens then the bonus token, padded with -1 (the rejection sampler's format)."""
    out = walk.output_token_ids  # [R, D + 1]
    if out.shape[1] >= width:
        return out[:, :width].contiguous()
    pad = out.new_full((out.shape[0], width - out.shape[1]), PLACEHOLDER_TOKEN_ID)
    return torch.cat([out, pad], dim=1)


def accepted_path_moves(step: TreeStep, walk: WalkResult) -> tuple[torch.Tensor, torch.Tensor]:
    """Token moves that put each request's accepted path right after its root.

    Returns (src, dst), both [R * M] indices into the step's scheduled tokens: the token at src goes to dst.
    Entries that move nothing have src == dst; entries aliased by padding repeat an identical (src, dst) pair,
    so a gather followed by a scatter is well defined without masks (no host sync).
    """
    num_reqs, width = step.parents.shape
    path = walk.path_nodes  # [R, D + 1], -1 after the path's end
    depth = min(path.shape[1] - 1, width - 1)
    index = torch.arange(1, depth + 1, device=path.device)[None, :]  # [1, M]
    index = torch.minimum(index, step.num_nodes[:, None] - 1)  # [R, M] clamped to the last valid node
    index = torch.clamp(index, min=0)
    path_at = path.gather(1, index)  # [R, M]
    accepted = index <= walk.num_accepted[:, None]
    src_node = torch.where(accepted & (path_at >= 0), path_at, index)
    src = step.node_token_index.gather(1, src_node)
    dst = step.node_token_index.gather(1, index)
    return src.flatten(), dst.flatten()


def move_rows_(rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """rows[dst] = rows[src] for [num_tokens, ...] `rows` and `accepted_path_moves`' (src, dst): the accepted paths'
    drafter context moved behind each root. `index_select` then `index_copy_` (the source is read whole before any
    write): the same result as advanced indexing, with less host work per call. Repeated (src, dst) pairs write
    equal values."""
    rows.index_copy_(0, dst, rows.index_select(0, src))


def output_logprobs(
    logits: torch.Tensor,  # [rows, V] raw or processed target logits
    step: TreeStep,
    walk: WalkResult,
    output_token_ids: torch.Tensor,  # [R, W] as returned by `sampled_token_ids`, -1 padded
    num_logprobs: int,
    as_logprobs: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's `LogprobsTensors` fields for every output slot, rows in `output_token_ids.flatten()` order.

    Output token j is the target's choice at path node j, so its logprobs come from that node's logits row
    (log-softmax of it when `as_logprobs`, else the logits themselves). Like vLLM's rejection sampler, each row
    holds the token's value then the top `num_logprobs`; slots past the path are zeros (vLLM drops them).
    Returns token ids [R * W, K + 1] int32, values [R * W, K + 1] float32, ranks [R * W] int64 (1 = the best).
    """
    num_reqs, width = output_token_ids.shape
    cols = min(width, walk.path_nodes.shape[1])  # only the path's D + 1 slots can hold tokens
    rows = step.node_rows.gather(1, walk.path_nodes[:, :cols].clamp(min=0))  # [R, C]; past the path: the root
    values = logits[rows.flatten()].to(torch.float32)  # [R * C, V]
    if as_logprobs:
        values = values.log_softmax(dim=-1)
    tokens = output_token_ids[:, :cols].to(torch.int64).clamp(min=0).reshape(-1, 1)  # [R * C, 1]
    token_values = values.gather(1, tokens)
    ranks = (values >= token_values).sum(dim=-1)  # [R * C]
    top_values, top_ids = values.topk(num_logprobs, dim=-1)
    ids = torch.cat([tokens, top_ids], dim=1).to(torch.int32)
    vals = torch.cat([token_values, top_values], dim=1)

    def widen(x: torch.Tensor) -> torch.Tensor:  # [R * C, ...] -> [R * W, ...], zeros in the new slots
        x = x.view(num_reqs, cols, *x.shape[1:])
        pad = x.new_zeros((num_reqs, width - cols, *x.shape[2:]))
        return torch.cat([x, pad], dim=1).flatten(0, 1)

    return widen(ids), widen(vals), widen(ranks)

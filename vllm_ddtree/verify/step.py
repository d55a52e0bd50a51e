"""The layout of one verification step: which scheduled tokens are which tree nodes.

vLLM schedules, per request, the root (the last accepted token) followed by its n <= B draft tokens, and computes
target logits at all n + 1 of them (`SpecDecodeMetadata.logits_indices`). Requests without drafts (prefill
chunks, plain decodes) are root-only trees. Every per-node tensor here is padded to [R, N] with N = B + 1; a
padded entry aliases the request's last valid node, so gathers and scatters stay in bounds and need no masks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_ddtree.tree.dispatch import use_triton


@dataclass
class TreeStep:
    num_nodes: torch.Tensor  # [R] int64, valid nodes per request (root included)
    parents: torch.Tensor  # [R, N] int64, -1 for the root
    depths: torch.Tensor  # [R, N] int64; a padded entry has its alias's depth
    node_rows: torch.Tensor  # [R, N] int64, row of each node in the step's logits
    node_token_index: torch.Tensor  # [R, N] int64, index of each node among the step's scheduled tokens
    num_nodes_cpu: np.ndarray  # [R] host copy of num_nodes
    tree_reqs_cpu: np.ndarray  # [T] requests with at least one draft node
    tree_reqs: torch.Tensor | None = None  # [T] int64 device copy of tree_reqs_cpu
    # [R] int64, nodes the walk may accept (root included): num_nodes, except 1 for a request whose drafts are
    # vLLM's placeholders (see `build_tree_step`). None: num_nodes.
    num_walk_nodes: torch.Tensor | None = None

    @property
    def width(self) -> int:
        return self.parents.shape[1]


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host array -> device tensor without a device sync (pinned staging buffer, non-blocking copy on CUDA)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def padded_node_index(num_nodes_cpu: np.ndarray, width: int) -> np.ndarray:
    """[R, N] node index clamped to each request's last valid node."""
    node = np.arange(width)[None, :]
    return np.minimum(node, num_nodes_cpu[:, None] - 1)


def build_tree_step(
    num_draft_tokens: list[int],
    logits_indices: torch.Tensor,  # [sum(n + 1)] scheduled-token index of each logits row
    prev_parents: torch.Tensor | None,  # [R_prev, N] trees proposed in the previous step
    prev_depths: torch.Tensor | None,  # [R_prev, N]
    prev_rows: list[int],  # [R] row of each request in prev_*, -1 where it has no drafts
    width: int,
    positions: torch.Tensor | None = None,  # [num_tokens] if given, tree positions are set (`tree_positions_`)
) -> TreeStep:
    device = logits_indices.device
    num_nodes_cpu = np.asarray(num_draft_tokens, dtype=np.int64) + 1
    num_reqs = num_nodes_cpu.shape[0]
    node_cpu = padded_node_index(num_nodes_cpu, width)  # [R, N]
    row_start = np.cumsum(num_nodes_cpu) - num_nodes_cpu
    has_drafts = num_nodes_cpu > 1
    tree_reqs_cpu = np.flatnonzero(has_drafts)
    # Row of each request's kept tree; -1 for requests without drafts and for drafts without a kept tree: vLLM's
    # scheduler pads a new request that needs one token (e.g. a one-token prompt joining a decode batch) with
    # placeholder drafts (-1) to a full speculative step. Like vLLM, never accept them: they are laid out as a
    # chain and the walk sees the root only.
    if prev_parents is None or prev_parents.shape[0] == 0:
        prev_parents = prev_depths = None
    kept = has_drafts & (prev_parents is not None)
    kept_rows_cpu = np.where(kept, np.asarray(prev_rows, dtype=np.int64), -1)
    num_walk_nodes_cpu = np.where(has_drafts & (kept_rows_cpu < 0), 1, num_nodes_cpu)
    # One host-to-device upload for every host-side index of the step: [R | R*N | R*N | T | R | R].
    packed = to_device(np.concatenate([num_nodes_cpu, (row_start[:, None] + node_cpu).ravel(), node_cpu.ravel(),
                                       tree_reqs_cpu, kept_rows_cpu, num_walk_nodes_cpu]), device)
    sizes = [num_reqs, num_reqs * width, num_reqs * width, tree_reqs_cpu.size, num_reqs, num_reqs]
    num_nodes, node_rows, node, tree_reqs, kept_rows, num_walk_nodes = torch.split(packed, sizes)
    return _lay_out(
        num_nodes, node_rows.view(num_reqs, width), node.view(num_reqs, width), tree_reqs, kept_rows, num_walk_nodes,
        num_nodes_cpu, tree_reqs_cpu, logits_indices, prev_parents, prev_depths, positions,
    )  # fmt: skip


def _lay_out(
    num_nodes: torch.Tensor,  # [R]
    node_rows: torch.Tensor,  # [R, N] logits row of each (padded) node
    node: torch.Tensor,  # [R, N] padded node index
    tree_reqs: torch.Tensor,  # [T]
    kept_rows: torch.Tensor,  # [R] row of the request's kept tree in prev_*, -1: none
    num_walk_nodes: torch.Tensor,  # [R]
    num_nodes_cpu: np.ndarray,
    tree_reqs_cpu: np.ndarray,
    logits_indices: torch.Tensor,
    prev_parents: torch.Tensor | None,
    prev_depths: torch.Tensor | None,
    positions: torch.Tensor | None,
) -> TreeStep:
    """The device part of a step's layout from its index tensors: parents, depths, token indices (one Triton launch
    on CUDA) and, if given, the tree positions."""
    on_triton = use_triton(logits_indices)
    if on_triton:
        from vllm_ddtree.verify.triton_step import tree_step_layout_triton_

        parents, depths, node_token_index = tree_step_layout_triton_(
            num_nodes, node_rows, kept_rows, prev_parents, prev_depths, logits_indices, positions
        )
    else:
        parents, depths = _layout_torch(num_nodes, node, kept_rows.to(torch.int64), prev_parents, prev_depths)
        node_token_index = logits_indices.to(torch.int64)[node_rows]
    step = TreeStep(
        num_nodes=num_nodes,
        parents=parents,
        depths=depths,
        node_rows=node_rows,
        node_token_index=node_token_index,
        num_nodes_cpu=num_nodes_cpu,
        tree_reqs_cpu=tree_reqs_cpu,
        tree_reqs=tree_reqs,
        num_walk_nodes=num_walk_nodes,
    )
    if positions is not None and not on_triton:  # the kernel has set them
        tree_positions_(positions, step)
    return step


class UniformStepLayouts:
    """The host-side part of `build_tree_step` for uniform verification steps (every request has the same n drafts
    and a kept tree: Model Runner V2's decode steps; n < B under `num_speculative_tokens_per_batch_size`), computed
    and uploaded once per (batch size, n) instead of every step."""

    def __init__(self, width: int, device: torch.device):
        self.width, self.device = width, device
        self._by_shape: dict[tuple[int, int], tuple] = {}

    def constants(self, num_reqs: int, num_nodes: int) -> tuple:
        """(num_nodes [R], node_rows [R, N], node [R, N], tree_reqs [T = R]) on the device, and their host copies
        (num_nodes_cpu, tree_reqs_cpu), for `num_nodes` <= N nodes per request."""
        key = (num_reqs, num_nodes)
        if key not in self._by_shape:
            num_nodes_cpu = np.full(num_reqs, num_nodes, dtype=np.int64)
            tree_reqs_cpu = np.arange(num_reqs, dtype=np.int64)
            node_cpu = padded_node_index(num_nodes_cpu, self.width)  # [R, N]
            node_rows_cpu = np.arange(num_reqs)[:, None] * num_nodes + node_cpu
            device_part = [torch.from_numpy(a).to(self.device)
                           for a in (num_nodes_cpu, node_rows_cpu, node_cpu, tree_reqs_cpu)]  # fmt: skip
            self._by_shape[key] = (*device_part, num_nodes_cpu, tree_reqs_cpu)
        return self._by_shape[key]


def build_uniform_tree_step(
    layouts: UniformStepLayouts,
    num_reqs: int,
    logits_indices: torch.Tensor,  # [R * n] scheduled-token index of each logits row
    prev_parents: torch.Tensor,  # [S, N] the trees kept by request slot
    prev_depths: torch.Tensor,  # [S, N]
    kept_rows: torch.Tensor,  # [R] integer, device: the request slot of each request (V2's idx_mapping)
    positions: torch.Tensor | None = None,  # [num_tokens] if given, tree positions are set
    num_nodes: int | None = None,  # n nodes per request, root included (default N: the whole tree)
) -> TreeStep:
    """`build_tree_step` for a uniform step, with nothing computed or uploaded from the host: the same TreeStep as
    `build_tree_step([n - 1] * R, logits_indices, prev_parents, prev_depths, kept_rows.tolist(), N, positions)`."""
    constants = layouts.constants(num_reqs, layouts.width if num_nodes is None else num_nodes)
    num_nodes_t, node_rows, node, tree_reqs, num_nodes_cpu, tree_reqs_cpu = constants
    return _lay_out(
        num_nodes_t, node_rows, node, tree_reqs, kept_rows, num_nodes_t, num_nodes_cpu, tree_reqs_cpu, logits_indices,
        prev_parents, prev_depths, positions,
    )  # fmt: skip


PADDING_SLOT, CHAIN_SLOT = -1, -2  # `uniform_step_inputs_`'s slots for padding requests and prefill chunks


def uniform_step_inputs_(
    slots: torch.Tensor,  # [P] int64: request slot, CHAIN_SLOT (a prefill chunk of n tokens) or PADDING_SLOT
    kept_parents: torch.Tensor,  # [S, N] int64 the trees kept by request slot
    kept_depths: torch.Tensor,  # [S, N] int64
    seq_lens: torch.Tensor,  # [P] int32, context + nodes
    positions: torch.Tensor,  # [P * n] int64: chain positions in, root position + depth out (kept trees)
    parents: torch.Tensor,  # [P, N] int64 out (rows of padding requests unspecified)
    depths: torch.Tensor,  # [P, N] int64 out, depth of the padded node index (rows of padding requests unspecified)
    node_mask: torch.Tensor,  # [P, N, N] uint8 out: ancestor masks, zero for padding requests
    num_nodes_out: torch.Tensor,  # [P] int32 out: n, 0 for padding requests
    context_lens: torch.Tensor,  # [P] int32 out: seq_lens - num_nodes_out
    num_nodes: int,  # n <= N nodes per request, root included
) -> None:
    """A uniform batch (every request n scheduled tokens) laid out from fixed-address buffers only: a request with
    a slot is a verification of its kept tree (`build_uniform_tree_step`'s parents, depths and positions), a
    CHAIN_SLOT request a chain of n nodes (a prefill chunk: positions left alone, causal masks); plus the FULL-graph
    tree inputs of `TreeAttentionMetadataBuilder._build_persistent`. One launch on CUDA. With no host values it can
    run inside the target's captured graph (`GraphStepLayouts`)."""
    if use_triton(slots):
        from vllm_ddtree.tree.triton_layout import uniform_step_inputs_triton_

        uniform_step_inputs_triton_(slots, kept_parents, kept_depths, seq_lens, positions, parents, depths, node_mask,
                                    num_nodes_out, context_lens, num_nodes)  # fmt: skip
        return
    from vllm_ddtree.tree.layout import ancestor_mask

    padded, width = parents.shape
    tree = (slots >= 0)[:, None]  # [P, 1]
    real = slots != PADDING_SLOT  # [P]
    kept = slots.clamp(min=0)
    chain = torch.arange(width, device=slots.device)  # [N]
    node = chain.clamp(max=num_nodes - 1)  # [N] padded node index
    parents.copy_(torch.where(tree, kept_parents[kept], chain - 1))
    depths.copy_(torch.where(tree, kept_depths[kept][:, node], node))
    node_mask.copy_(ancestor_mask(parents) & real[:, None, None])
    num_nodes_out.copy_(torch.where(real, num_nodes, 0))
    torch.sub(seq_lens, num_nodes_out, out=context_lens)
    tokens = positions.view(padded, num_nodes)  # [P, n]
    tokens.copy_(torch.where(tree, tokens[:, :1] + depths[:, :num_nodes], tokens))


class GraphStepLayouts:
    """Uniform verification steps laid out inside the target's FULL CUDA graph (`"layout_in_graph": true`, Model
    Runner V2): `uniform_step_inputs_` is captured at the start of each uniform verification graph (P padded
    requests of n nodes), reading the request slots from `slots`; a step that replays such a graph only copies its
    slots there, and its TreeStep is the same views every time. Steps of other shapes (or whose graph was captured
    without it) keep the host path (`build_uniform_tree_step` and the metadata builder)."""

    def __init__(self, uniform: UniformStepLayouts, max_reqs: int, device: torch.device):
        width = uniform.width
        self.uniform = uniform
        self.slots = torch.full((max_reqs,), PADDING_SLOT, dtype=torch.int64, device=device)  # [max_reqs]
        chain = torch.arange(width, dtype=torch.int64, device=device)
        self.parents = (chain - 1).repeat(max_reqs, 1)  # [max_reqs, N] the step's parents, written in the graph
        self.depths = chain.repeat(max_reqs, 1)  # [max_reqs, N]
        # (n, seq_lens [P]: the backend's) of the uniform verification graph of P requests being captured
        self.capturing: tuple[int, torch.Tensor] | None = None
        self.captured: set[tuple[int, int]] = set()  # (P, n) of the graphs that lay out their steps
        self._steps: dict[tuple[int, int], TreeStep] = {}

    def write_inputs_(self, positions: torch.Tensor, kept_parents: torch.Tensor, kept_depths: torch.Tensor,
                      tree_inputs, recorded: bool) -> None:  # fmt: skip
        """In the target's forward while `capturing`: the step's layout and tree inputs, captured with it.
        `positions`: [P * n] the forward's own input; `tree_inputs`: the metadata builder's PersistentTreeBuffers;
        `recorded`: this forward is being recorded into a CUDA graph (not the eager warm-up before it)."""
        num_nodes, seq_lens = self.capturing
        padded = seq_lens.shape[0]
        if positions.dim() != 1 or positions.shape[0] != padded * num_nodes:
            return
        uniform_step_inputs_(
            self.slots[:padded], kept_parents, kept_depths, seq_lens, positions, self.parents[:padded],
            self.depths[:padded], tree_inputs.node_mask[:padded], tree_inputs.num_nodes[:padded],
            tree_inputs.context_lens[:padded], num_nodes,
        )  # fmt: skip
        if recorded:
            self.captured.add((padded, num_nodes))

    def set_slots_(self, num_reqs: int, padded: int, num_nodes: int, tree_slots: torch.Tensor | None) -> None:
        """A step laid out on the host that replays the graph of (padded, n): the slots that make the graph write the
        same layout. `tree_slots`: [R] each request's slot if it has drafts, else CHAIN_SLOT; None: all chains."""
        if (padded, num_nodes) in self.captured:
            self._write_slots_(CHAIN_SLOT if tree_slots is None else tree_slots, num_reqs, padded)

    def _write_slots_(self, slots: torch.Tensor | int, num_reqs: int, padded: int) -> None:
        """Rows 0..R-1 of `slots` from `slots` ([R], or one value for all), PADDING_SLOT from R up to `padded`."""
        if isinstance(slots, int):
            self.slots[:num_reqs].fill_(slots)
        else:
            self.slots[:num_reqs].copy_(slots)
        if padded > num_reqs:  # no empty-slice op on the per-step path
            self.slots[num_reqs:padded].fill_(PADDING_SLOT)

    def step(self, num_reqs: int, padded: int, num_nodes: int, slots: torch.Tensor) -> TreeStep | None:
        """Before replaying the graph of (padded, n): this step's request slots ([R] V2's idx_mapping) into `slots`
        (padding requests -1), and its TreeStep; None if that graph does not lay out its steps."""
        if (padded, num_nodes) not in self.captured:
            return None
        self._write_slots_(slots, num_reqs, padded)
        key = (num_reqs, num_nodes)
        if key not in self._steps:
            num_nodes_t, node_rows, _, tree_reqs, num_nodes_cpu, tree_reqs_cpu = self.uniform.constants(*key)
            self._steps[key] = TreeStep(
                num_nodes=num_nodes_t, parents=self.parents[:num_reqs], depths=self.depths[:num_reqs],
                node_rows=node_rows, node_token_index=node_rows,  # every scheduled token is a logits row
                num_nodes_cpu=num_nodes_cpu, tree_reqs_cpu=tree_reqs_cpu, tree_reqs=tree_reqs,
                num_walk_nodes=num_nodes_t,
            )  # fmt: skip
        return self._steps[key]


def _layout_torch(
    num_nodes: torch.Tensor,  # [R]
    node: torch.Tensor,  # [R, N] padded node index
    kept_rows: torch.Tensor,  # [R], -1: no kept tree
    prev_parents: torch.Tensor | None,  # [R_prev, N]
    prev_depths: torch.Tensor | None,  # [R_prev, N]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(parents, depths) [R, N]: the kept tree's, else a chain for requests with drafts, else the root alone;
    depths are those of the padded node index. The reference of `triton_step`'s kernel."""
    width = node.shape[1]
    chain = torch.arange(width, device=node.device)[None, :]  # [1, N]
    has_drafts = (num_nodes > 1)[:, None]  # [R, 1]
    parents = torch.where(has_drafts, chain - 1, -1)  # [R, N]
    depths = torch.where(has_drafts, chain, 0)
    if prev_parents is not None and prev_depths is not None:
        kept = (kept_rows >= 0)[:, None]
        row = kept_rows.clamp(min=0)
        parents = torch.where(kept, prev_parents[row], parents)
        depths = torch.where(kept, prev_depths[row], depths)
    return parents, depths.gather(1, node)


def tree_positions_(positions: torch.Tensor, step: TreeStep) -> None:
    """Give each node the position (root position + depth) in place; vLLM gave it root position + index."""
    index = step.node_token_index  # [R, N]
    root_positions = positions[index[:, 0]]  # [R]
    positions[index.flatten()] = (root_positions[:, None] + step.depths).flatten().to(positions.dtype)


def chain_positions_(positions: torch.Tensor, step: TreeStep) -> None:
    """Undo `tree_positions_`: node i gets root position + i again (the accepted path is moved to the front)."""
    index = step.node_token_index
    root_positions = positions[index[:, 0]]
    node = torch.arange(step.width, device=index.device)[None, :]
    node = torch.minimum(node, step.num_nodes[:, None] - 1)
    positions[index.flatten()] = (root_positions[:, None] + node).flatten().to(positions.dtype)

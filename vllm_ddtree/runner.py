"""Hooks that give vLLM's model runner DDTree: the tree proposer, tree positions and attention, the scorer and KV
compaction. Each hook wraps one `GPUModelRunner` method (the CPU runner inherits them) and does nothing unless
the speculative config carries DDTree settings.

One decode step, in the order vLLM calls the hooks:
  `_prepare_inputs`            the scheduled drafts are last step's tree: lay it out, positions = root + depth
  `_build_attention_metadata`  attach ancestor masks to the target layers' attention metadata
  (target forward)             tree requests attend along their root paths (`TreeAttentionMetadata`)
  `_sample`                    target choice per node, walk, accepted path + bonus; move the path's KV in place;
                               positions back in chain order
  `propose_draft_token_ids`    run the drafter (the path's context rows moved to the front), build the next tree
  `take_draft_token_ids`       the drafts for the scheduler, with the trees' parents of requests with structured
                               output (`structured.py`)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from vllm_ddtree import config as ddtree_config
from vllm_ddtree.attention.layers import wrap_target_layers
from vllm_ddtree.attention.metadata import ATTRIBUTE as TREE_METADATA
from vllm_ddtree.attention.metadata import (
    TreeAttentionMetadataBuilder,
    dummy_tree_step,
    full_cuda_graphs_requested,
    tree_attention_builder,
    uniform_nodes,
)
from vllm_ddtree.kv.compact import compact_accepted_kv_, kv_for_the_walk, slot_mapping_of
from vllm_ddtree.structured import attach_tree_parents
from vllm_ddtree.tree import WalkResult
from vllm_ddtree.verify.scorer import node_tokens, output_logprobs, walk_and_moves_
from vllm_ddtree.verify.step import TreeStep, build_tree_step


@dataclass
class DDTreeRunnerState:
    budget: int
    depth: int
    # Trees whose drafts vLLM may schedule next, by row; `prev_rows` maps request ids to those rows.
    prev_parents: torch.Tensor | None = None  # [R_prev, B + 1]
    prev_depths: torch.Tensor | None = None  # [R_prev, B + 1]
    prev_rows: dict[str, int] = field(default_factory=dict)
    # This step.
    step: TreeStep | None = None
    walk: WalkResult | None = None
    moves: tuple[torch.Tensor, torch.Tensor] | None = None  # (src, dst) scheduled-token indices
    # Set once the KV cache exists.
    layers: dict = field(default_factory=dict)  # target attention layers by name
    layer_groups: list = field(default_factory=list)  # [(gid, layers)] the target layers by KV cache group
    attention: TreeAttentionMetadataBuilder | None = None
    kv_tables: dict = field(default_factory=dict)  # device address tables of the layers' caches (GPU)
    timer: object = None  # profiling.StepTimer when VLLM_DDTREE_PROFILE is set, else a no-op
    structured_output_step: bool = True  # whether this step scheduled a request with structured output

    @property
    def width(self) -> int:
        return self.budget + 1


def remember_trees_(state: DDTreeRunnerState, tree, req_ids: list[str], live_req_ids) -> None:
    """Keep the trees just proposed (row i: `req_ids[i]`) for the next step's verification, and the older trees
    of live requests that were not scheduled this step: vLLM keeps their drafts and verifies them whenever the
    request is scheduled again (a step's token budget can leave running requests out)."""
    scheduled = set(req_ids)
    carried = [req_id for req_id in state.prev_rows if req_id not in scheduled and req_id in live_req_ids]
    parents, depths, rows = [], [], {}
    if tree is not None:
        parents.append(tree.parents)
        depths.append(tree.depths)
        rows = {req_id: row for row, req_id in enumerate(req_ids)}
    if carried:
        assert state.prev_parents is not None and state.prev_depths is not None
        old_rows = torch.tensor([state.prev_rows[req_id] for req_id in carried], device=state.prev_parents.device)
        offset = parents[0].shape[0] if parents else 0
        parents.append(state.prev_parents[old_rows])
        depths.append(state.prev_depths[old_rows])
        rows.update({req_id: offset + i for i, req_id in enumerate(carried)})
    state.prev_parents = _concat(parents)
    state.prev_depths = _concat(depths)
    state.prev_rows = rows


def constrained_tree_parents(state: DDTreeRunnerState, runner, req_ids: list[str]) -> dict[str, list[int]]:
    """{request id: parents of its kept tree} for the requests of `req_ids` with structured output: the scheduler
    computes their grammar masks node by node (`structured.py`). One small device-to-host copy, on such steps only."""
    from vllm_ddtree.compat import structured_output_rows

    constrained = [req_id for req_id, is_constrained in zip(req_ids, structured_output_rows(runner, req_ids))
                   if is_constrained and req_id in state.prev_rows]  # fmt: skip
    if not constrained or state.prev_parents is None:
        return {}
    rows = torch.tensor([state.prev_rows[req_id] for req_id in constrained], device=state.prev_parents.device)
    return dict(zip(constrained, state.prev_parents[rows].tolist()))


def _concat(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """Rows of `parts` in order; a single part is kept as is (no copy launched)."""
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def hook(cls, name: str):
    """Decorator: replace `cls.name` by the decorated function, which receives the original first."""

    def decorate(fn):
        original = getattr(cls, name)

        @functools.wraps(original)
        def wrapper(self, *args, **kwargs):
            return fn(original, self, *args, **kwargs)

        setattr(cls, name, wrapper)
        return fn

    return decorate


def configure_cuda_graphs(compilation_config, logger) -> None:
    """Before a DDTree runner starts (V1 or V2): FULL graphs for uniform tree-verification batches only, or none
    with VLLM_DDTREE_FULL_CUDA_GRAPHS=0 (`attention.metadata.full_cuda_graphs_requested`)."""
    from vllm_ddtree.compat import disable_full_cuda_graphs, full_cuda_graphs_for_uniform_batches_only

    switch = full_cuda_graphs_for_uniform_batches_only if full_cuda_graphs_requested() else disable_full_cuda_graphs
    switch(compilation_config, logger)


def install_runner_hooks() -> None:
    from vllm_ddtree.compat import (
        LOGGER_NAME,
        GPUModelRunner,
        SamplerOutput,
        init_logger,
        prepare_inputs_outputs,
    )

    if getattr(GPUModelRunner, "_ddtree_hooked", False):
        return
    GPUModelRunner._ddtree_hooked = True
    logger = init_logger(LOGGER_NAME)

    @hook(GPUModelRunner, "__init__")
    def __init__(original, self, vllm_config, device, *args, **kwargs):
        spec = vllm_config.speculative_config
        settings = ddtree_config.settings_of(spec)
        if settings is not None:
            configure_cuda_graphs(vllm_config.compilation_config, logger)
        original(self, vllm_config, device, *args, **kwargs)
        self._ddtree = None
        if settings is None:
            return
        from vllm_ddtree.proposer import DDTreeProposer

        self.drafter = DDTreeProposer(
            vllm_config,
            self.device,
            self,
            budget=settings["budget"],
            depth=settings["depth"],
            max_topk=settings["max_topk"],
        )
        from vllm_ddtree.profiling import step_timer

        self._ddtree = DDTreeRunnerState(budget=settings["budget"], depth=settings["depth"])
        self._ddtree.timer = self.drafter.timer = step_timer(self.device)
        logger.info(
            "DDTree: node budget %d, tree depth %d, max top-k per depth %s",
            settings["budget"],
            settings["depth"],
            settings["max_topk"],
        )
        # tree_in_graph and layout_in_graph (both on by default) are Model Runner V2's; they do nothing here.

    @hook(GPUModelRunner, "initialize_kv_cache")
    def initialize_kv_cache(original, self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        state = self._ddtree
        if state is not None:
            state.layers, state.layer_groups = wrap_target_layers(self.get_model(), self.kv_cache_config)
            state.attention = tree_attention_builder(
                state.layers, self.compilation_config.cudagraph_mode, self.max_num_reqs, state.width, state.depth,
                self.device, logger,
            )
        return result

    @hook(GPUModelRunner, "_prepare_inputs")
    def _prepare_inputs(original, self, scheduler_output, num_scheduled_tokens):
        state = self._ddtree
        if state is None:
            return original(self, scheduler_output, num_scheduled_tokens)
        state.timer.end_step()
        state.timer.mark("start")
        result = original(self, scheduler_output, num_scheduled_tokens)
        state.timer.mark("vllm_prepare_inputs")
        logits_indices, spec_decode_metadata = prepare_inputs_outputs(result)
        state.step = state.walk = state.moves = None
        if spec_decode_metadata is None:
            state.timer.skip_step()  # no verification: not a decode step of the profile
        else:
            prev_rows = [state.prev_rows.get(req_id, -1) for req_id in self.input_batch.req_ids]
            state.step = build_tree_step(
                spec_decode_metadata.num_draft_tokens,
                logits_indices,
                state.prev_parents,
                state.prev_depths,
                prev_rows,
                state.width,
                positions=self.positions,  # tree positions: root + depth
            )
        state.timer.mark("tree_layout")
        return result

    @hook(GPUModelRunner, "_build_attention_metadata")
    def _build_attention_metadata(original, self, *args, **kwargs):
        state = self._ddtree
        if state is not None:
            state.timer.mark("vllm_other")
        result = original(self, *args, **kwargs)
        if state is None or state.attention is None:
            return result
        # n if vLLM may replay the FULL graph of n-node trees for this batch: every request with n scheduled tokens,
        # drafts or not (a prefill chunk of n tokens then is a chain of n nodes; `attention.metadata`).
        num_reqs, num_tokens, max_query_len = (kwargs.get(k) for k in ("num_reqs", "num_tokens", "max_query_len"))
        uniform = None
        if state.attention.persistent is not None and None not in (num_reqs, num_tokens, max_query_len):
            uniform = uniform_nodes(num_reqs, num_tokens, max_query_len, state.width)
        if state.step is not None:
            state.timer.mark("vllm_attention_metadata")
            state.attention.attach(state.step, result[0], uniform)
            state.timer.mark("tree_attention_metadata")
        elif uniform is not None:
            # A uniform batch without drafts: a dummy run (warm-up or FULL-graph capture: the tree attention path is
            # captured, reading the persistent buffers real steps write before each replay) or prefill chunks.
            state.attention.attach(dummy_tree_step(num_reqs, uniform, state.width, self.device), result[0])
        return result

    @hook(GPUModelRunner, "_sample")
    def _sample(original, self, logits, spec_decode_metadata):
        state = self._ddtree
        if state is None or spec_decode_metadata is None or state.step is None:
            return original(self, logits, spec_decode_metadata)
        from vllm_ddtree.verify.sampling import choose_nodes

        state.timer.mark("verify_forward")
        sampling_metadata = self.input_batch.sampling_metadata
        self.input_batch.update_async_output_token_ids()
        step = state.step
        tokens = node_tokens(step, self.input_ids.gpu)  # [R, N]
        choices = choose_nodes(logits, step, sampling_metadata, tokens)  # [rows] tokens, [rows, V] processed logits
        slot_mappings = slot_mapping_of(self)
        kv = kv_for_the_walk(state.layer_groups, slot_mappings, state.kv_tables, choices.token_ids)
        state.walk, state.moves, output = walk_and_moves_(
            step, choices.token_ids, self.input_ids.gpu, state.depth, self.positions, tokens, kv=kv
        )
        state.timer.mark("walk")
        if kv is None:  # else moved in the walk's launch
            compact_accepted_kv_(
                state.layer_groups,
                *state.moves,
                slot_mappings,
                num_reqs=step.parents.shape[0],
                tables=state.kv_tables,
            )
        state.timer.mark("kv_compaction")
        logprobs = None
        if sampling_metadata.max_num_logprobs is not None:
            from vllm_ddtree.compat import LogprobsTensors

            mode = self.model_config.logprobs_mode  # raw_logprobs (default), raw_logits, processed_*
            source = choices.processed_logits if mode.startswith("processed") else logits
            fields = output_logprobs(
                source, step, state.walk, output, sampling_metadata.max_num_logprobs, mode.endswith("logprobs")
            )
            logprobs = LogprobsTensors(*fields)
        return SamplerOutput(sampled_token_ids=output, logprobs_tensors=logprobs)

    @hook(GPUModelRunner, "propose_draft_token_ids")
    def propose_draft_token_ids(original, self, *args, **kwargs):
        # The arguments pass through untouched: their list changes between vLLM releases (0.26 and 0.32 take ten).
        state = self._ddtree
        if state is not None:
            state.timer.mark("vllm_sampler_output")
            self.drafter.accepted_path_moves = state.moves  # applied to the drafter's context (proposer.py)
            scheduler_output = args[0] if args else kwargs.get("scheduler_output")  # first in 0.26 and 0.32
            state.structured_output_step = getattr(scheduler_output, "has_structured_output_requests", True)
        draft_token_ids = original(self, *args, **kwargs)
        if state is not None:
            state.timer.mark("draft_other")
            remember_trees_(state, self.drafter.last_tree, self.input_batch.req_ids, self.requests)
        return draft_token_ids

    @hook(GPUModelRunner, "take_draft_token_ids")
    def take_draft_token_ids(original, self, *args, **kwargs):
        draft_token_ids = original(self, *args, **kwargs)
        state = self._ddtree
        if state is not None and draft_token_ids is not None and state.structured_output_step:
            parents = constrained_tree_parents(state, self, draft_token_ids.req_ids)
            attach_tree_parents(draft_token_ids, parents)
        return draft_token_ids


__all__ = ["DDTreeRunnerState", "install_runner_hooks", "TREE_METADATA"]

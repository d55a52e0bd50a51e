"""Hooks that give vLLM's Model Runner V2 (`vllm/v1/worker/gpu/`) DDTree; used where vLLM picks
V2 (vLLM 0.26's default on GPU) or with VLLM_DDTREE_RUNNER=v2.

Design: docs/model-runner-v2.md. One decode step, in the order V2 calls the hooks:
  `init_speculator`        (at __init__) a `DDTreeSpeculator` for DDTree configs
  `prepare_attn`           after V2 computed the slots from chain positions: the step's tree layout
                           (`build_tree_step` with the trees kept by request slot), positions = root + depth
  `model_state.prepare_attn`  ancestor masks attached to the target layers' metadata (FULL graphs: persistent
                           buffers, attached to the dummy batch at capture)
  (target forward)
  `rejection_sampler`      a `TreeVerifier`: choices, walk, KV compaction, positions back to chain order
  `speculator.propose`     path rows moved to the front, DFlash pass, the next tree
  `draft_tokens_handler`   on steps with structured output, the trees' parents go to the scheduler with the drafts
V2's own `post_update` then does the rollback (num_computed_tokens += num_sampled) on the GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from vllm_ddtree import config as ddtree_config
from vllm_ddtree.attention.layers import wrap_target_layers
from vllm_ddtree.attention.metadata import (
    TreeAttentionMetadataBuilder,
    backend_rows_requested,
    dummy_tree_step,
    tree_attention_builder,
    uniform_nodes,
)
from vllm_ddtree.runner import configure_cuda_graphs, hook
from vllm_ddtree.structured import attach_tree_parents
from vllm_ddtree.verify.step import (
    CHAIN_SLOT,
    GraphStepLayouts,
    TreeStep,
    UniformStepLayouts,
    build_tree_step,
    build_uniform_tree_step,
)


CHAIN_PROFILE_ENV = "VLLM_DDTREE_PROFILE_CHAIN"


@dataclass
class DDTreeV2State:
    budget: int
    depth: int
    step: TreeStep | None = None
    layers: dict = field(default_factory=dict)  # target attention layers by name
    layer_groups: list = field(default_factory=list)  # [(gid, layers)] the target layers by KV cache group
    attention: TreeAttentionMetadataBuilder | None = None
    kv_tables: dict = field(default_factory=dict)  # device address tables of the layers' caches
    block_tables: object = None  # V2's BlockTables: slot_mappings [num_groups, max_tokens]
    timer: object = None  # profiling.StepTimer when VLLM_DDTREE_PROFILE is set, else a no-op
    uniform_layouts: UniformStepLayouts | None = None  # per-batch-size constants of uniform steps
    # "layout_in_graph": true: uniform steps laid out inside the target's FULL graphs; a uniform step's layout
    # waits (`deferred`: build_uniform_tree_step's arguments) until the graph mode is known (model_state.prepare_attn)
    graph_layouts: GraphStepLayouts | None = None
    deferred: tuple | None = None
    step_in_graph: bool = False  # this step's layout and tree inputs are written by the graph it replays

    @property
    def width(self) -> int:
        return self.budget + 1

    def slot_mappings(self, num_tokens: int) -> dict[int, torch.Tensor]:
        """This step's slot of every scheduled token per KV cache group (read before the drafter overwrites its
        group's row)."""
        table = self.block_tables.slot_mappings
        return {gid: table[gid, :num_tokens] for gid in range(table.shape[0])}


def request_counts_without_full_graph(
    capture_sizes: list[int], drafts: list[int], width: int, max_capture_size: int
) -> list[int]:
    """Request counts r whose uniform verification step (r x (drafts[r] + 1) tokens, within the capture sizes) gets
    no FULL graph from Model Runner V2 (vLLM 0.26's `CudaGraphManager`): a step runs under the graphs of the
    smallest capture size at or above its token count, and only sizes rounded up to a multiple of a step's tokens
    per request hold FULL graphs for its uniform batches (one set per draft length of
    `num_speculative_tokens_per_batch_size`). Power-of-two sizes with B + 1 = 65 leave out 3 requests (195 tokens
    -> the 256-token piecewise graph). vLLM's default sizes (steps of 8 to 256 tokens, then 16) leave out none
    while B + 1 exceeds the step: with B + 1 = 9, the request counts whose steps fall between 256 and 512 tokens
    are left out. `drafts`: [max_num_reqs + 1] (`compat.drafts_by_batch_size`); `width`: B + 1."""
    max_num_reqs = len(drafts) - 1
    max_decode = max_num_reqs * width  # V2 sizes its decode graphs by the largest step
    full: dict[int, set[int]] = {}  # token count -> tokens per request of its FULL uniform graphs
    for nodes in {n + 1 for n in drafts[1:] if n > 0}:
        for size in capture_sizes:
            tokens = -(-size // nodes) * nodes
            if tokens <= min(max_decode, max_capture_size) and tokens // nodes <= max_num_reqs:
                full.setdefault(tokens, set()).add(nodes)
    buckets = sorted(set(full) | set(capture_sizes))
    missing = []
    for r in range(1, max_num_reqs + 1):
        if drafts[r] == 0:
            continue  # no verification at this batch size
        nodes = drafts[r] + 1
        bucket = next((t for t in buckets if t >= r * nodes), None)
        if bucket is None:
            continue  # above every capture size: no graph at all, by vLLM's own limit (as for every method)
        if nodes not in full.get(bucket, ()):
            missing.append(r)
    return missing


def _log_cuda_graph_coverage(compilation_config, drafts: list[int], width: int, logger) -> None:
    mode = compilation_config.cudagraph_mode
    sizes = compilation_config.cudagraph_capture_sizes
    if mode is None or not sizes or mode.decode_mode().name != "FULL":
        return
    max_num_reqs = len(drafts) - 1
    max_size = compilation_config.max_cudagraph_capture_size or max(sizes)
    largest_step = max(r * (drafts[r] + 1) for r in range(1, max_num_reqs + 1))
    if largest_step > max_size:
        logger.info(
            "DDTree: CUDA graphs cover verification steps of up to %d tokens (max_cudagraph_capture_size); the "
            "largest step has %d (max_num_seqs=%d): larger steps run without graphs. --max-cudagraph-capture-size "
            "%d covers them all.",
            max_size, largest_step, max_num_reqs, largest_step,
        )  # fmt: skip
    missing = request_counts_without_full_graph(sizes, drafts, width, max_size)
    if missing:
        logger.warning(
            "DDTree: with cudagraph_capture_sizes %s, Model Runner V2 has no FULL CUDA graph for verification steps "
            "of %s requests: those steps run piecewise, with tree attention eager (several times slower). Add the "
            "sizes %s to cudagraph_capture_sizes (requests x tokens per request).",
            sizes, missing, [r * (drafts[r] + 1) for r in missing],
        )  # fmt: skip


def uniform_verification_nodes(input_batch, width: int) -> int | None:
    """n when every request of the batch is scheduled n tokens, 2 <= n <= width: a batch V2 runs in the FULL graph
    of n-node trees, if it has one (n < width under `num_speculative_tokens_per_batch_size`), whether its requests
    have drafts or are prefill chunks of n tokens (`attention.metadata.uniform_nodes`); None otherwise."""
    max_query_len = int(input_batch.num_scheduled_tokens.max())
    return uniform_nodes(input_batch.num_reqs, input_batch.num_tokens, max_query_len, width)


def hand_tree_parents_to_scheduler(handler, speculator) -> None:
    """Make V2's `DraftTokensHandler` hand the scheduler each request's tree parents with its drafts, on the steps
    whose batch has structured output (the only steps where V2 copies drafts to the host): the scheduler computes
    those requests' grammar masks node by node (`structured.py`). The parents, [R, B + 1] gathered by request slot,
    are copied on the handler's copy stream before its event, so `get_draft_tokens`'s one wait covers both copies;
    other steps copy nothing."""
    set_draft_tokens, get_draft_tokens = handler.set_draft_tokens, handler.get_draft_tokens
    copied: list = [None]  # [R, B + 1] numpy parents of the last structured-output step, else None

    def set_tree_draft_tokens(input_batch, draft_tokens: torch.Tensor) -> None:
        copied[0] = None
        if input_batch.has_structured_output_reqs:
            parents = speculator.tree_parents[input_batch.idx_mapping]  # [R, B + 1], a new tensor
            handler.copy_stream.wait_stream(torch.cuda.current_stream(handler.device))
            with torch.cuda.stream(handler.copy_stream):
                copied[0] = parents.to("cpu", non_blocking=True).numpy()
                parents.record_stream(handler.copy_stream)
        set_draft_tokens(input_batch, draft_tokens)  # records the handler's event after both copies

    def get_tree_draft_tokens():
        draft_token_ids = get_draft_tokens()  # waits for the event when it copied
        parents, copied[0] = copied[0], None
        if parents is not None and draft_token_ids is not None:
            attach_tree_parents(draft_token_ids, dict(zip(draft_token_ids.req_ids, parents.tolist())))
        return draft_token_ids

    handler.set_draft_tokens, handler.get_draft_tokens = set_tree_draft_tokens, get_tree_draft_tokens


def install_v2_runner_hooks() -> None:
    from vllm_ddtree.compat import LOGGER_NAME, init_logger, v2_model_runner_module

    module = v2_model_runner_module()
    runner_cls = module.GPUModelRunner
    if getattr(runner_cls, "_ddtree_hooked", False):
        return
    runner_cls._ddtree_hooked = True
    logger = init_logger(LOGGER_NAME)
    original_init_speculator = module.init_speculator

    def init_speculator(vllm_config, device, *args, **kwargs):
        settings = ddtree_config.settings_of(vllm_config.speculative_config)
        if settings is None:
            return original_init_speculator(vllm_config, device, *args, **kwargs)
        from vllm_ddtree.speculator_v2 import DDTreeSpeculator

        return DDTreeSpeculator(
            vllm_config, device, budget=settings["budget"], depth=settings["depth"], max_topk=settings["max_topk"],
            tree_in_graph=settings["tree_in_graph"],
        )  # fmt: skip

    module.init_speculator = init_speculator

    @hook(runner_cls, "__init__")
    def __init__(original, self, vllm_config, device, *args, **kwargs):
        settings = ddtree_config.settings_of(vllm_config.speculative_config)
        if settings is not None:
            configure_cuda_graphs(vllm_config.compilation_config, logger)
        original(self, vllm_config, device, *args, **kwargs)
        self._ddtree = None
        from vllm_ddtree.profiling import step_timer

        self._chain_timer = step_timer(self.device) if _chain_profile_requested(vllm_config, settings) else None
        if settings is None:
            return

        self._ddtree = DDTreeV2State(budget=settings["budget"], depth=settings["depth"])
        self._ddtree.timer = step_timer(self.device)
        self._ddtree.uniform_layouts = UniformStepLayouts(self._ddtree.width, self.device)
        if settings.get("layout_in_graph") and backend_rows_requested():
            logger.warning("DDTree: VLLM_DDTREE_BACKEND_ROWS=1 lays every step out from the host (\"layout_in_graph\" "
                           "is off: the kept backend rows are written on the host path only)")  # fmt: skip
        elif settings.get("layout_in_graph"):
            self._ddtree.graph_layouts = GraphStepLayouts(self._ddtree.uniform_layouts, self.max_num_reqs, self.device)
            logger.info("DDTree: uniform verification steps are laid out inside the target's FULL CUDA graphs "
                        "(\"layout_in_graph\": true)")  # fmt: skip
        if self.speculator is not None:  # None on pipeline stages before the last
            self.speculator.timer = self._ddtree.timer
            hand_tree_parents_to_scheduler(self.draft_tokens_handler, self.speculator)
            if self.speculator.tree_in_graph:  # "tree_in_graph" (default): V2's roots buffer, before any capture
                from vllm_ddtree.compat import v2_last_sampled_tokens

                self.speculator.roots = v2_last_sampled_tokens(self)
                if self.speculator.roots is None:
                    logger.warning("DDTree: this vLLM's Model Runner V2 has no req_states.last_sampled_tokens: "
                                   "the tree is built after the drafter's pass (as with \"tree_in_graph\": false)")
                else:
                    logger.info("DDTree: the tree build runs inside the drafter's CUDA graph (\"tree_in_graph\")")
        logger.info(
            "DDTree on Model Runner V2: node budget %d, tree depth %d, max top-k per depth %s",
            settings["budget"], settings["depth"], settings["max_topk"],
        )  # fmt: skip

    @hook(runner_cls, "load_model")
    def load_model(original, self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        state = self._ddtree
        if state is not None and getattr(self, "sampler", None) is not None:
            from vllm_ddtree.verify.verifier_v2 import TreeVerifier

            self.rejection_sampler = TreeVerifier(self.sampler, state, self.speculator)
            _wrap_model_state_prepare_attn(self.model_state, state, self.device)
            if state.graph_layouts is not None:
                _lay_out_steps_in_target_graphs(self.model, state, self.speculator)
        elif self._chain_timer is not None and self.rejection_sampler is not None:
            _mark_chain_phases(self, self._chain_timer)
        return result

    @hook(runner_cls, "initialize_kv_cache")
    def initialize_kv_cache(original, self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        state = self._ddtree
        if state is not None:
            state.layers, state.layer_groups = wrap_target_layers(self.model, self.kv_cache_config)
            state.block_tables = self.block_tables
            mode = self.cudagraph_manager.cudagraph_mode if self.cudagraph_manager is not None else None
            state.attention = tree_attention_builder(
                state.layers, mode, self.max_num_reqs, state.width, state.depth, self.device, logger
            )
            from vllm_ddtree.compat import drafts_by_batch_size

            drafts = drafts_by_batch_size(self.vllm_config.speculative_config, self.max_num_reqs)
            _log_cuda_graph_coverage(self.compilation_config, drafts, state.width, logger)
        return result

    @hook(runner_cls, "capture_model")
    def capture_model(original, self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        finally:
            if self._ddtree is not None and self._ddtree.graph_layouts is not None:
                self._ddtree.graph_layouts.capturing = None

    @hook(runner_cls, "execute_model")
    def execute_model(original, self, *args, **kwargs):
        state = self._ddtree
        if state is not None:
            state.step = state.deferred = None  # set again by prepare_attn on real steps with drafts
            state.step_in_graph = False
        timer = state.timer if state is not None else self._chain_timer
        if timer is not None:
            timer.end_step()
            timer.mark("start")
        return original(self, *args, **kwargs)

    @hook(runner_cls, "prepare_attn")
    def prepare_attn(original, self, input_batch):
        state = self._ddtree
        timer = state.timer if state is not None else self._chain_timer
        if timer is None:
            return original(self, input_batch)
        timer.mark("vllm_prepare_inputs")
        result = original(self, input_batch)  # slots from chain positions: siblings keep distinct slots
        timer.mark("vllm_slots")
        num_drafts = getattr(input_batch, "num_draft_tokens_per_req", None)
        if num_drafts is None or input_batch.num_draft_tokens == 0:
            timer.skip_step()  # no verification: not a decode step of the profile
        elif state is not None:
            speculator = self.speculator
            if num_drafts.min() == num_drafts.max() > 0:  # the decode steps: nothing from the host
                uniform = (
                    state.uniform_layouts,
                    input_batch.num_reqs,
                    input_batch.logits_indices,
                    speculator.tree_parents,
                    speculator.tree_depths,
                    input_batch.idx_mapping,  # the trees are kept by request slot
                    input_batch.positions,  # tree positions: root + depth
                    int(num_drafts[0]) + 1,  # < B + 1 under num_speculative_tokens_per_batch_size
                )
                if state.graph_layouts is not None:
                    state.deferred = uniform  # laid out by its FULL graph, if it replays one
                else:
                    state.step = build_uniform_tree_step(*uniform)
            else:
                state.step = build_tree_step(
                    num_drafts.tolist(),
                    input_batch.logits_indices,
                    speculator.tree_parents,
                    speculator.tree_depths,
                    input_batch.idx_mapping_np.tolist(),
                    state.width,
                    positions=input_batch.positions,  # tree positions: root + depth
                )
            state.timer.mark("tree_layout")
        return result


def _chain_profile_requested(vllm_config, settings) -> bool:
    """`VLLM_DDTREE_PROFILE_CHAIN=1` at engine start, on an engine of vLLM's own DFlash chain (not DDTree)."""
    spec = vllm_config.speculative_config
    return (
        settings is None and spec is not None and getattr(spec, "method", None) == "dflash"
        and os.environ.get(CHAIN_PROFILE_ENV) == "1"
    )  # fmt: skip


def _mark_chain_phases(runner, timer) -> None:
    """The chain's decode steps get the phase marks DDTree's get (`VLLM_DDTREE_PROFILE`), so that the two profiles
    compare phase by phase: vLLM's attention metadata, the target forward, its rejection sampler (in place of
    DDTree's choices, walk, compaction and output), the output copy, the DFlash pass. Installed only on request
    (`scripts/bench_step.py` sets `VLLM_DDTREE_PROFILE_CHAIN=1` for `dflash`): a no-op mark costs a call."""
    model_state, sampler, speculator = runner.model_state, runner.rejection_sampler, runner.speculator
    prepare_attn, propose = model_state.prepare_attn, speculator.propose

    def prepare_attn_marked(*args, for_capture: bool = False, **kwargs):
        metadata = prepare_attn(*args, for_capture=for_capture, **kwargs)
        if not for_capture:
            timer.mark("vllm_attention_metadata")
        return metadata

    def rejection_sampler_marked(*args, **kwargs):
        timer.mark("verify_forward")
        output = sampler(*args, **kwargs)
        timer.mark("rejection_sampler")
        return output

    def propose_marked(*args, **kwargs):
        timer.mark("vllm_sampler_output")
        draft_tokens = propose(*args, **kwargs)
        timer.mark("draft")
        return draft_tokens

    model_state.prepare_attn = prepare_attn_marked
    runner.rejection_sampler = rejection_sampler_marked
    if not getattr(propose, "_ddtree_marked", False):  # the speculator outlives a second load_model
        propose_marked._ddtree_marked = True
        speculator.propose = propose_marked


def _wrap_model_state_prepare_attn(model_state, state: DDTreeV2State, device: torch.device) -> None:
    """Attach tree metadata to the target's per-layer metadata: this step's tree at runtime, a chain of n <= B + 1
    nodes per request when a uniform verification batch of n tokens per request is captured in a FULL graph."""
    original = model_state.prepare_attn

    def prepare_attn(input_batch, *args, for_capture: bool = False, **kwargs):
        metadata = original(input_batch, *args, for_capture=for_capture, **kwargs)
        builder = state.attention
        if builder is None or metadata is None:
            return metadata
        mode = kwargs.get("cudagraph_mode", args[0] if args else None)
        # n if V2 may replay the FULL graph of n-node trees for this batch (drafts or not): then every request's
        # layout goes into the persistent buffers that graph reads, prefill chunks as chains.
        uniform = uniform_verification_nodes(input_batch, state.width) if builder.persistent is not None else None
        if for_capture:
            if uniform is not None:  # a uniform verification batch's FULL graph: capture tree attention in it
                builder.attach(dummy_tree_step(input_batch.num_reqs, uniform, state.width, device), metadata)
            if state.graph_layouts is not None:  # and its steps' layout, at the start of the target's forward
                backend = builder.backend_metadata_of(metadata)
                capture = uniform is not None and backend is not None
                state.graph_layouts.capturing = (uniform, backend.seq_lens) if capture else None
            return metadata
        if state.deferred is not None:
            _lay_out_deferred_step(state, mode, builder.backend_metadata_of(metadata))
        if state.step is not None:
            state.timer.count(f"target_cudagraph_{getattr(mode, 'name', mode)}")  # FULL expected for uniform steps
            state.timer.mark("vllm_attention_metadata")
            if not state.step_in_graph:  # else the graph writes the tree inputs itself
                builder.attach(state.step, metadata, uniform)
                _slots_for_host_laid_out_step(state, mode, builder, metadata, uniform, input_batch)
            state.timer.mark("tree_attention_metadata")
        elif uniform is not None:  # no drafts, every request a prefill chunk of n tokens: chains of n
            builder.attach(dummy_tree_step(input_batch.num_reqs, uniform, state.width, device), metadata)
            _slots_for_host_laid_out_step(state, mode, builder, metadata, uniform, input_batch)
        return metadata

    model_state.prepare_attn = prepare_attn


__all__ = ["DDTreeV2State", "install_v2_runner_hooks"]


def _lay_out_deferred_step(state: DDTreeV2State, mode, backend_metadata) -> None:
    """A uniform step's layout once its graph mode is known: written by the FULL graph it replays if that graph
    lays out its steps (`GraphStepLayouts`), else on the host path (`build_uniform_tree_step`)."""
    uniform, state.deferred = state.deferred, None
    layouts, num_reqs, _, _, _, slots, _, num_nodes = uniform
    if getattr(mode, "name", None) == "FULL" and backend_metadata is not None:
        padded = backend_metadata.seq_lens.shape[0]
        state.step = state.graph_layouts.step(num_reqs, padded, num_nodes, slots)
        state.step_in_graph = state.step is not None
    if state.step is None:
        state.step = build_uniform_tree_step(*uniform)


def _slots_for_host_laid_out_step(state: DDTreeV2State, mode, builder, metadata, uniform, input_batch) -> None:
    """"layout_in_graph": a step laid out on the host (a uniform batch with prefill chunks, or a FULL graph that
    does not lay out its steps) that still replays a graph which does: its request slots go in so that the graph
    writes the same layout, the kept tree for requests with drafts, a chain for the others."""
    layouts = state.graph_layouts
    if layouts is None or uniform is None or getattr(mode, "name", None) != "FULL":
        return  # the default (no layout_in_graph) returns here, before any work: this runs every step
    backend = builder.backend_metadata_of(metadata)
    if backend is None:
        return
    step = state.step
    tree_slots = None if step is None else torch.where(step.num_nodes > 1, input_batch.idx_mapping, CHAIN_SLOT)
    layouts.set_slots_(input_batch.num_reqs, backend.seq_lens.shape[0], uniform, tree_slots)


def _lay_out_steps_in_target_graphs(model, state: DDTreeV2State, speculator) -> None:
    """"layout_in_graph": true. The target's forward first lays out the step (`GraphStepLayouts.write_inputs_`)
    while a uniform verification batch's FULL graph is captured (and in its warm-up run), so every replay of that
    graph writes its own step's parents, depths, positions and tree-attention inputs from the slots copied in."""
    forward = model.forward

    from vllm_ddtree.compat import forward_cudagraph_mode_name

    def forward_laying_out_tree_step(*args, **kwargs):
        layouts, positions = state.graph_layouts, kwargs.get("positions")
        # A FULL capture and its warm-up run the forward eagerly (mode NONE); a PIECEWISE capture (breakable
        # graphs too) must not record the layout: its graphs also serve batches laid out on the host.
        if (layouts.capturing is not None and positions is not None and state.attention.persistent is not None
                and forward_cudagraph_mode_name() in (None, "NONE")):  # fmt: skip
            tree_inputs = state.attention.persistent
            layouts.write_inputs_(positions, speculator.tree_parents, speculator.tree_depths, tree_inputs,
                                  recorded=_stream_capturing())  # fmt: skip
        return forward(*args, **kwargs)

    model.forward = forward_laying_out_tree_step


def _stream_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()

"""DDTree's drafter on vLLM's Model Runner V2: its DFlash speculator, drafting D = depth positions, turned into a tree.

The DFlash pass runs exactly as V2 runs it (inputs kernel, context K/V, the query forward in its FULL CUDA graph).
Two things change:
- inside the captured graph, `sample_draft` keeps each position's top-K tokens and their float32 log-probs in
  persistent buffers (the chain's argmax is their first column);
- one launch builds the best-`budget` tree per request from them (`trees_into_slots_`: roots read and
  parents/depths written by request slot, `req_state_idx`, V2's per-request state index), for the step that
  verifies it; `propose` returns its B node tokens, which V2 stores as the request's draft tokens.

Where the build runs (speculative-config key `"tree_in_graph"`):
- true (the default): inside `sample_draft`, so in the drafter's FULL graph, at no host time at replay (0.12 ->
  0.01 ms a step on the H200, session 23's profile). Request slots come from V2's `sample_idx_mapping` rows (-1
  for the graph's padding requests, whose trees go to a scratch slot), roots from
  `req_states.last_sampled_tokens` (handed over by the runner hook before capture);
- false: after the pass, from `propose`, with V2's `idx_mapping` and `last_sampled`.

Before the pass the accepted path's context rows move to the front of each request (`accepted_path_moves`, set
by the verifier), so DFlash's own "first num_sampled rows are the new context" rule reads root + path.
"""

from __future__ import annotations

import torch

from vllm_ddtree.compat import v2_dflash_speculator_class
from vllm_ddtree.config import drafting_config
from vllm_ddtree.profiling import step_timer
from vllm_ddtree.tree.build import top_tokens, topk_per_depth, trees_into_slots_
from vllm_ddtree.verify.scorer import move_rows_

DFlashSpeculator = v2_dflash_speculator_class()
_NO_TIMER = step_timer(torch.device("cpu"))  # a no-op until the runner sets its own


class DDTreeSpeculator(DFlashSpeculator):
    def __init__(self, vllm_config, device: torch.device, budget: int, depth: int, max_topk: int | None,
                 tree_in_graph: bool = True):  # fmt: skip
        super().__init__(drafting_config(vllm_config, depth), device)
        self.draft_logits = None  # the tree verifier needs no draft distributions
        self.budget = budget
        self.depth = depth
        vocab = self.vocab_size
        self.topk = topk_per_depth(vocab, max_topk, budget)
        rows = self.max_num_reqs * depth
        # Filled inside the drafter's CUDA graph: [max_reqs * D, K], request-major.
        self.top_token_ids = torch.zeros((rows, self.topk), dtype=torch.int64, device=device)
        self.top_log_probs = torch.zeros((rows, self.topk), dtype=torch.float32, device=device)
        # The last tree proposed for each request slot; a chain until then (any tree verifies losslessly). Row
        # max_reqs is a scratch slot: the trees of a graph's padding requests (in-graph build) land there.
        width = budget + 1
        chain = torch.arange(width, dtype=torch.int64, device=device)
        self.tree_parents = (chain - 1).repeat(self.max_num_reqs + 1, 1)  # [max_reqs + 1, B + 1]
        self.tree_depths = chain.repeat(self.max_num_reqs + 1, 1)  # [max_reqs + 1, B + 1]
        # (src, dst) token moves of this step's accepted paths, set by the verifier.
        self.accepted_path_moves: tuple[torch.Tensor, torch.Tensor] | None = None
        self.timer = _NO_TIMER  # the runner's profiling.StepTimer (runner_v2)
        # In-graph tree build ("tree_in_graph", the default): on once the runner hands over V2's roots buffer.
        self.tree_in_graph = tree_in_graph
        self.roots: torch.Tensor | None = None  # [max_reqs] V2's last_sampled_tokens (runner_v2)
        self.roots_and_scratch = torch.zeros(self.max_num_reqs + 1, dtype=torch.int64, device=device)
        self.tree_tokens = torch.zeros((self.max_num_reqs, width), dtype=torch.int64, device=device)

    @property
    def builds_trees_in_graph(self) -> bool:
        return self.tree_in_graph and self.roots is not None

    def load_model(self, target_model) -> None:
        super().load_model(target_model)
        combine = self.model.combine_hidden_states

        def combine_then_move_paths(hidden_states: torch.Tensor) -> torch.Tensor:
            combined = combine(hidden_states)  # [num_tokens, hidden]
            self._move_accepted_paths_(combined)
            return combined

        self.model.combine_hidden_states = combine_then_move_paths

    def _move_accepted_paths_(self, context: torch.Tensor) -> None:
        moves, self.accepted_path_moves = self.accepted_path_moves, None
        if moves is not None:
            src, dst = moves
            move_rows_(context, src, dst)

    def sample_draft(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """Per drafted position: keep its top-K tokens and log-probs; return the argmax (runs in the graph)."""
        logits = self.model.compute_logits(hidden_states)  # [n, V], n = num_reqs_padded * D
        token_ids, log_probs = top_tokens(logits, self.topk)  # [n, K]
        n = logits.shape[0]
        self.top_token_ids[:n].copy_(token_ids)
        self.top_log_probs[:n].copy_(log_probs)
        if self.builds_trees_in_graph:
            idx_mapping = kwargs["idx_mapping"] if "idx_mapping" in kwargs else args[1]  # [n] slot of each row
            self._build_trees_(token_ids, log_probs, idx_mapping)
        return token_ids[:, 0]

    def _build_trees_(self, token_ids: torch.Tensor, log_probs: torch.Tensor, idx_mapping: torch.Tensor) -> None:
        """The tree build inside `sample_draft` (in the drafter's graph): every request's tree into its slot and its
        node tokens into `tree_tokens`; the graph's padding requests (slot -1) into the scratch slot."""
        num_reqs, scratch = token_ids.shape[0] // self.depth, self.max_num_reqs
        slots = idx_mapping[: num_reqs * self.depth].view(num_reqs, self.depth)[:, 0].to(torch.int64)  # [R]
        slots = torch.where(slots < 0, scratch, slots)
        self.roots_and_scratch[:scratch].copy_(self.roots)  # read at replay, after V2's post_update
        self.tree_tokens[:num_reqs].copy_(self._trees_into_slots(token_ids, log_probs, self.roots_and_scratch, slots))

    def _trees_into_slots(self, token_ids: torch.Tensor, log_probs: torch.Tensor, roots: torch.Tensor,
                          slots: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """[R, B + 1] node tokens of the best-`budget` tree of each of the R = len(slots) requests, from its rows of
        the per-position top-K (`token_ids`, `log_probs`: [>= R * D, K], request-major); parents and depths written
        to the request's slot, the root read from roots[slot]."""
        rows, shape = slots.shape[0] * self.depth, (slots.shape[0], self.depth, -1)
        return trees_into_slots_(token_ids[:rows].view(shape), log_probs[:rows].view(shape), roots, slots, self.budget,
                                 self.tree_parents, self.tree_depths)  # fmt: skip

    @torch.inference_mode()
    def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                num_sampled, num_rejected, last_sampled, *args, **kwargs) -> torch.Tensor:  # fmt: skip
        self.timer.mark("vllm_sampler_output")  # V2's output copy and post_update
        if not aux_hidden_states:  # DFlash reads the last hidden states themselves
            self._move_accepted_paths_(last_hidden_states)
        super().propose(input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                        num_sampled, num_rejected, last_sampled, *args, **kwargs)  # fmt: skip
        self.accepted_path_moves = None
        self.timer.mark("draft")
        num_reqs = input_batch.num_reqs
        if self.builds_trees_in_graph:
            self.timer.mark("tree_build")
            return self.tree_tokens[:num_reqs, 1:]  # [R, B], built in the pass (V2 copies them at once)
        token_ids = self._trees_into_slots(
            self.top_token_ids, self.top_log_probs,
            last_sampled.view(-1),  # [max_reqs, 1] in 0.26: the root of each request slot
            input_batch.idx_mapping,  # [R] request slots
        )  # fmt: skip
        self.timer.mark("tree_build")
        return token_ids[:, 1:]  # [R, B]

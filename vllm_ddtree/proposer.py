"""The DDTree proposer: vLLM's DFlash drafter run once per step, its per-position logits turned into a tree.

The drafter runs exactly as vLLM's in-tree DFlash does (one parallel pass over [bonus token, mask * D]), with D =
the tree depth (the drafter's block size - 1, or `max_depth`), independent of the node budget B. Instead of the
per-position argmax (a chain), `build_draft_tree` keeps the B most probable prefixes. The proposer returns the B
non-root node tokens per request, parents before children, so vLLM's scheduler treats them as B draft tokens
(and may truncate them to any prefix, which is still a tree; with `num_speculative_tokens_per_batch_size` vLLM asks
for n <= B and gets the first n). Parents and depths are kept for the next step's
verification.
"""

from __future__ import annotations

import torch

from vllm_ddtree.compat import DFlashProposer, pad_dflash_query_buffers
from vllm_ddtree.config import drafting_config
from vllm_ddtree.tree import DraftTree, build_draft_tree
from vllm_ddtree.verify.scorer import move_rows_


class DDTreeProposer(DFlashProposer):
    def __init__(self, vllm_config, device: torch.device, runner, budget: int, depth: int, max_topk: int | None):
        super().__init__(drafting_config(vllm_config, depth), device, runner)
        pad_dflash_query_buffers(self, vllm_config)
        self.budget = budget
        self.depth = depth
        self.max_topk = max_topk
        # [num_reqs * depth, vocab] logits of the last drafter pass.
        self._draft_logits: torch.Tensor | None = None
        self.last_tree: DraftTree | None = None
        self.timer = None  # set by the runner (profiling.StepTimer or a no-op)
        # (src, dst) scheduled-token indices of the accepted paths, set by the runner after a verification step.
        self.accepted_path_moves: tuple[torch.Tensor, torch.Tensor] | None = None

    def set_inputs_first_pass(self, **kwargs):
        """Move each accepted path's context rows to the front of its request before DFlash reads them.

        The drafter's context is the target's hidden states at the scheduled tokens (after DFlash's `fc` combined
        the target layers), in tree node order; vLLM takes a request's first 1 + accepted tokens as its new
        context, so the path's rows go there. One gather and one scatter on [num_tokens, hidden]; positions were
        put back in chain order by the walk (verify.scorer.walk_and_moves_). vLLM passes keywords (0.26, 0.32).
        """
        moves, self.accepted_path_moves = self.accepted_path_moves, None
        if moves is not None:
            src, dst = moves
            context = kwargs["target_hidden_states"]  # [num_tokens, hidden]
            move_rows_(context, src, dst)
        return super().set_inputs_first_pass(**kwargs)

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        # Keep the full per-position logits; the argmax chain returned here is not used.
        logits = self.model.compute_logits(hidden_states)
        self._draft_logits = logits
        return logits.argmax(dim=-1), None

    def propose(self, num_speculative_tokens: int, **kwargs) -> torch.Tensor:
        next_token_ids = kwargs["next_token_ids"]  # [R]
        num_reqs = next_token_ids.shape[0]
        if num_speculative_tokens == 0:
            super().propose(0, **kwargs)  # keeps the drafter's KV in sync
            self.last_tree = None
            return next_token_ids.new_empty((num_reqs, 0), dtype=torch.int64)
        if self.timer is not None:
            self.timer.mark("draft_inputs")
        super().propose(self.depth, **kwargs)
        if self.timer is not None:
            self.timer.mark("draft")
        assert self._draft_logits is not None
        draft_logits = self._draft_logits.view(num_reqs, self.depth, -1)  # [R, D, V]
        self.last_tree = build_draft_tree(
            draft_logits, next_token_ids.to(torch.int64), budget=self.budget, max_topk=self.max_topk
        )
        self._draft_logits = None
        if self.timer is not None:
            self.timer.mark("tree_build")
        # [R, n]: the first n nodes, a tree of the n best prefixes (n < B under num_speculative_tokens_per_batch_size)
        return self.last_tree.token_ids[:, 1 : 1 + num_speculative_tokens]

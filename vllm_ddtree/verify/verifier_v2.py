"""DDTree's scorer on vLLM's Model Runner V2, in place of V2's `RejectionSampler` (same call, same output).

Per tree node the target's choice is V2's own: its sampling parameters (`Sampler.apply_sampling_params`, with the
penalties and bad words counted along each node's path: `penalties_v2.py`, `bad_words.py`), then a
Gumbel-max draw keyed by the request's seed and the node's position (root + depth, the position plain decoding
gives that token), which is the argmax at temperature 0. The walk follows the choices from the root; every
accepted token is therefore the one plain V2 decoding would have produced with the same seed. Then the accepted
path's KV moves behind the root, positions go back to chain order and V2's output contract is met:
`sampled_token_ids` [R, B + 1] (path tokens, then the bonus token), `num_sampled` and `num_rejected` [R], with
V2's own rule for chunked prefills, and logprobs rows in V2's `cu_num_logits` layout.
"""

from __future__ import annotations

import torch

from vllm_ddtree.kv.compact import compact_accepted_kv_, kv_for_the_walk
from vllm_ddtree.verify.bad_words import install_tree_bad_words
from vllm_ddtree.verify.penalties_v2 import install_tree_penalties
from vllm_ddtree.verify.sampling import node_requests
from vllm_ddtree.verify.scorer import walk_and_moves_


class TreeVerifier:
    def __init__(self, sampler, state, speculator):
        self.sampler = sampler
        self.state = state  # runner_v2.DDTreeV2State: this step's TreeStep, target layers, slot mappings
        self.speculator = speculator  # receives the accepted-path moves
        if sampler is not None and state is not None:
            from vllm_ddtree.compat import v2_bad_words_state

            install_tree_penalties(sampler.penalties_state, state)  # penalties counted along each node's path
            install_tree_bad_words(v2_bad_words_state(sampler), state)  # bad words matched along each node's path

    def __call__(self, logits: torch.Tensor, input_batch, draft_logits=None, *args, **kwargs):
        from vllm_ddtree.compat import v2_sampling

        v2 = v2_sampling()
        state, sampler = self.state, self.sampler
        step = state.step
        assert step is not None, "DDTree verification without a tree layout (runner_v2.prepare_attn)"
        state.timer.mark("verify_forward")  # the target forward and its logits
        num_nans = v2.get_num_nans(logits) if sampler.compute_nans else None  # before any processing, as V2
        rows = input_batch.logits_indices
        pos = input_batch.positions[rows]  # [rows] tree positions: root + depth
        processed = v2.apply_sampling_params(sampler, logits, input_batch, pos, input_batch.input_ids[rows])
        choices = v2.gumbel_sample(
            processed, input_batch.expanded_idx_mapping, sampler.sampling_states.temperature.gpu,
            sampler.sampling_states.seeds.gpu, pos, use_fp64=sampler.use_fp64_gumbel,
        )  # fmt: skip
        state.timer.mark("target_choices")
        slot_mappings = state.slot_mappings(input_batch.num_tokens)
        kv = kv_for_the_walk(state.layer_groups, slot_mappings, state.kv_tables, choices)  # None: compacted below
        walk, moves, output = walk_and_moves_(
            step, choices, input_batch.input_ids, state.depth, input_batch.positions, kv=kv
        )  # fmt: skip
        state.timer.mark("walk")
        if kv is None:
            compact_accepted_kv_(
                state.layer_groups, *moves, slot_mappings, num_reqs=step.parents.shape[0], tables=state.kv_tables
            )  # fmt: skip
        state.timer.mark("kv_compaction")
        self.speculator.accepted_path_moves = moves
        num_sampled = (walk.num_accepted + 1).to(torch.int32)
        num_sampled, num_rejected = v2.get_num_sampled_and_rejected(
            num_sampled, input_batch.seq_lens, input_batch.cu_num_logits, input_batch.idx_mapping,
            sampler.req_states.prefill_len.gpu,
        )  # fmt: skip
        logprobs = self._logprobs(v2, logits, processed, input_batch, step, walk, output)
        state.timer.mark("verifier_output")
        return v2.SamplerOutput(
            sampled_token_ids=output, logprobs_tensors=logprobs, num_nans=num_nans, num_sampled=num_sampled,
            num_rejected=num_rejected,
        )  # fmt: skip

    def _logprobs(self, v2, logits, processed, input_batch, step, walk, output):
        """V2's logprobs for the output tokens: request r's j-th output token (the target's choice at path node
        j) takes logits row cu_num_logits[r] + j, as V2's rejection sampler lays them out."""
        max_num_logprobs = self.sampler.sampling_states.max_num_logprobs(input_batch.idx_mapping_np)
        if max_num_logprobs == v2.NO_LOGPROBS:
            return None
        mode = self.sampler.logprobs_mode
        source = processed if mode in ("processed_logprobs", "processed_logits") else logits
        num_rows, width = logits.shape[0], output.shape[1]
        req = node_requests(step)  # [rows] request of each row
        local = input_batch.expanded_local_pos.to(torch.int64)  # [rows] row index within its request
        path = walk.path_nodes  # [R, D + 1], -1 past the path
        node = path[req, local.clamp(max=path.shape[1] - 1)]  # [rows]
        on_path = (local < path.shape[1]) & (node >= 0)
        path_rows = torch.where(on_path, step.node_rows[req, node.clamp(min=0)], torch.arange(num_rows, device=logits.device))
        sampled = output.to(torch.int64)[req, local.clamp(max=width - 1)].clamp(min=0)  # [rows]
        return v2.compute_topk_scores(
            source[path_rows], max_num_logprobs, sampled, input_batch.cu_num_logits_np.tolist(),
            logits_mode=mode in ("raw_logits", "processed_logits"),
        )  # fmt: skip

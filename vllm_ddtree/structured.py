"""Structured output (JSON schema, regex, choice, grammar) for DDTree requests on the V1 model runner.

vLLM's scheduler checks a request's drafts against its grammar and computes one token mask per draft position as if
the drafts were a chain: the mask of draft i assumes drafts 1..i were accepted. A tree's nodes are not a chain, so a
request with structured output drafts one: the drafter's argmax path, which `tree.build.chain_only_` puts first in
its tree (nodes 1..L, L = min(B, D), in depth order), and the scheduler keeps those L drafts only
(`install_chain_drafts_hook`). Such a request accepts what vLLM's DFlash chain would; the other requests of the
batch keep their trees. DDTree's Model Runner V2 hooks (vLLM 0.26 on the GPU) do not draft chains yet, so requests
with structured output are refused there (`requests.py`).
"""

from __future__ import annotations

from vllm_ddtree import config as ddtree_config


def chain_length(speculative_config) -> int | None:
    """L: the drafts a structured-output request keeps, min(budget, depth); None when the config is not DDTree's."""
    settings = ddtree_config.settings_of(speculative_config)
    if settings is None:
        return None
    return min(settings["budget"], settings["depth"])


def keep_chain_drafts_(requests: dict, draft_token_ids, length: int) -> None:
    """Cut, in place, the drafts of every request with structured output to their first `length` tokens (its chain).
    `draft_token_ids`: vLLM's `DraftTokenIds` (req_ids, one list of draft tokens per request)."""
    for req_id, drafts in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
        request = requests.get(req_id)
        if request is not None and request.use_structured_output:
            del drafts[length:]


def install_chain_drafts_hook() -> None:
    """Wrap the scheduler's two ways of taking drafts (`update_draft_token_ids`, and with async scheduling
    `update_draft_token_ids_in_output`; 0.26 and 0.32) so a structured-output request's drafts are its chain
    before vLLM validates them against the grammar. Idempotent; other methods pass through."""
    from vllm_ddtree.compat import Scheduler

    for name in ("update_draft_token_ids", "update_draft_token_ids_in_output"):
        original = getattr(Scheduler, name, None)
        if original is None or getattr(original, "_ddtree_hook", False):
            continue
        setattr(Scheduler, name, _keeping_chains(original))


def _keeping_chains(original):
    def update(self, draft_token_ids, *args, **kwargs):
        length = chain_length(self.vllm_config.speculative_config)
        if length is not None:
            keep_chain_drafts_(self.requests, draft_token_ids, length)
        return original(self, draft_token_ids, *args, **kwargs)

    update._ddtree_hook = True
    update.__wrapped__ = original
    return update

"""Per-request checks: sampling parameters DDTree cannot honour yet are refused when the request arrives
(an HTTP 400 under `vllm serve`), never silently ignored inside the engine."""

from __future__ import annotations

from vllm_ddtree import config as ddtree_config

_HOW = "send the request to a server without speculative decoding, or with method 'dflash'"


def unsupported_reason(params) -> tuple[str, str] | None:
    """(parameter, why) for the first parameter DDTree does not support, or None."""
    if getattr(params, "logprob_token_ids", None) is not None:
        return "logprob_token_ids", f"logprob_token_ids is not supported with DDTree yet; use logprobs; {_HOW}"
    if getattr(params, "thinking_token_budget", None) is not None:
        return "thinking_token_budget", f"thinking_token_budget is not supported with DDTree yet; {_HOW}"
    return None


def install_request_hook() -> None:
    from vllm_ddtree.compat import SamplingParams, validation_error

    original = SamplingParams.verify
    if getattr(original, "_ddtree_hook", False):
        return

    def verify(self, model_config, speculative_config, *args, **kwargs):
        original(self, model_config, speculative_config, *args, **kwargs)
        if ddtree_config.settings_of(speculative_config) is None:
            return
        problem = unsupported_reason(self)
        if problem is not None:
            parameter, why = problem
            raise validation_error(why, parameter)

    verify._ddtree_hook = True
    SamplingParams.verify = verify

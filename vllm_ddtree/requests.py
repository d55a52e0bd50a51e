"""Per-request checks: sampling parameters DDTree cannot honour yet are refused when the request arrives
(an HTTP 400 under `vllm serve`), never silently ignored inside the engine."""

from __future__ import annotations

from vllm_ddtree import config as ddtree_config

_HOW = "send the request to a server without speculative decoding, or with method 'dflash'"


def unsupported_reason(params, structured_outputs_config=None) -> tuple[str, str] | None:
    """(parameter, why) for the first parameter DDTree does not support, or None. `structured_outputs_config`: the
    engine's (its reasoning parser decides whether structured output is served)."""
    if getattr(params, "structured_outputs", None) is not None and (
        why := _structured_output_after_reasoning_refusal(structured_outputs_config)
    ):
        return "structured_outputs", why
    if getattr(params, "logprob_token_ids", None) is not None:
        return "logprob_token_ids", f"logprob_token_ids is not supported with DDTree yet; use logprobs; {_HOW}"
    if getattr(params, "thinking_token_budget", None) is not None:
        return "thinking_token_budget", f"thinking_token_budget is not supported with DDTree yet; {_HOW}"
    return None


def _structured_output_after_reasoning_refusal(structured_outputs_config) -> str | None:
    """Why a structured-output request is refused in an engine with a reasoning parser, or None. On vLLM 0.26 the
    grammar did not take over where reasoning ended inside a verified tree path: the answer went on unconstrained
    (tests/e2e/test_structured_output.py, session 43 on an H100). 0.32's scheduler finds the end anywhere in a
    step's tokens, and there the answers are token-identical to no speculation."""
    from vllm_ddtree.compat import VLLM_VERSION, scheduler_defers_grammar_at_reasoning_end

    parser = getattr(structured_outputs_config, "reasoning_parser", None)
    if not parser or getattr(structured_outputs_config, "enable_in_reasoning", False):
        return None
    if not scheduler_defers_grammar_at_reasoning_end():
        return None
    return (
        f"structured output after reasoning (reasoning_parser {parser!r}) is not supported with DDTree on vLLM "
        f"{VLLM_VERSION}: start the engine without a reasoning parser, or {_HOW}"
    )


def install_request_hook() -> None:
    from vllm_ddtree.compat import SamplingParams, validation_error

    original = SamplingParams.verify
    if getattr(original, "_ddtree_hook", False):
        return

    def verify(self, model_config, speculative_config, *args, **kwargs):
        original(self, model_config, speculative_config, *args, **kwargs)
        if ddtree_config.settings_of(speculative_config) is None:
            return
        structured_outputs_config = args[0] if args else kwargs.get("structured_outputs_config")
        problem = unsupported_reason(self, structured_outputs_config)
        if problem is not None:
            parameter, why = problem
            raise validation_error(why, parameter)

    verify._ddtree_hook = True
    SamplingParams.verify = verify

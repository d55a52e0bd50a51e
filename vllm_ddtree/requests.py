"""Per-request checks: sampling parameters DDTree cannot honour yet are refused when the request arrives
(an HTTP 400 under `vllm serve`), never silently ignored inside the engine."""

from __future__ import annotations

from vllm_ddtree import config as ddtree_config
from vllm_ddtree.env import V2_STRUCTURED_OUTPUT_ENV, v2_structured_output_opted_in

_HOW = "send the request to a server without speculative decoding, or with method 'dflash'"


def unsupported_reason(params) -> tuple[str, str] | None:
    """(parameter, why) for the first parameter DDTree does not support, or None."""
    if getattr(params, "structured_outputs", None) is not None and (why := _structured_output_refusal()):
        return "structured_outputs", why
    if getattr(params, "logprob_token_ids", None) is not None:
        return "logprob_token_ids", f"logprob_token_ids is not supported with DDTree yet; use logprobs; {_HOW}"
    if getattr(params, "thinking_token_budget", None) is not None:
        return "thinking_token_budget", f"thinking_token_budget is not supported with DDTree yet; {_HOW}"
    return None


def _structured_output_refusal() -> str | None:
    """Why DDTree refuses structured output in this process's engines, or None. DDTree's Model Runner V2 hooks hand
    the scheduler the trees' parents (`runner_v2.hand_tree_parents_to_scheduler`) but have not run on a GPU yet,
    so where DDTree may run V2 the requests are refused unless VLLM_DDTREE_V2_STRUCTURED_OUTPUT=1 opts in."""
    from vllm_ddtree.compat import RUNNER_ENV, ddtree_may_run_on_model_runner_v2

    if v2_structured_output_opted_in() or not ddtree_may_run_on_model_runner_v2():
        return None
    return (
        "structured output with DDTree is verified on the V1 model runner only so far, and this engine may run Model "
        f"Runner V2; start it with {RUNNER_ENV}=v1 (or VLLM_USE_V2_MODEL_RUNNER=0), or opt in to the V2 path with "
        f"{V2_STRUCTURED_OUTPUT_ENV}=1, or {_HOW}"
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
        problem = unsupported_reason(self)
        if problem is not None:
            parameter, why = problem
            raise validation_error(why, parameter)

    verify._ddtree_hook = True
    SamplingParams.verify = verify

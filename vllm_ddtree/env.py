"""The plugin's environment switches with a fixed set of values (no vLLM imports: the tree package uses it too)."""

from __future__ import annotations

import os


def env_choice(name: str, choices: tuple[str, ...], fix: str) -> str:
    """Environment variable `name`, stripped and lower-cased; `choices[0]` (the default) when unset or empty. Any
    other value outside `choices` raises ValueError naming it, followed by `fix` (the accepted values)."""
    value = os.environ.get(name, "").strip().lower() or choices[0]
    if value not in choices:
        raise ValueError(f"{name}={os.environ[name]!r} {fix}")
    return value


V2_STRUCTURED_OUTPUT_ENV = "VLLM_DDTREE_V2_STRUCTURED_OUTPUT"


def v2_structured_output_opted_in() -> bool:
    """VLLM_DDTREE_V2_STRUCTURED_OUTPUT=1: serve structured output on DDTree's Model Runner V2 path before its GPU
    check (`requests.py`); 0 (default) refuses those requests where DDTree may run V2."""
    return env_choice(V2_STRUCTURED_OUTPUT_ENV, ("0", "1"), "is not 0 or 1; unset it to refuse structured output "
                      "where DDTree may run Model Runner V2, or set 1 to serve it there") == "1"  # fmt: skip

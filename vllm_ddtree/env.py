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

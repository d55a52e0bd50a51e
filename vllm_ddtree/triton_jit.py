"""`triton.jit` for the plugin's kernels without the specializations that made them compile again while serving.

Triton compiles a kernel once per combination of its runtime arguments' traits: an integer equal to 1 or divisible
by 16, a pointer aligned to 16 bytes. Arguments that change from step to step (split counts, a stride that is the
step's token count, views into one packed upload) then cost a compile (~1 s) the first time a new combination
shows up, in the middle of a request: seen on the H200 as vLLM's "Triton kernel JIT compilation during inference"
warnings for the tree layout, walk and attention kernels (session 18).
"""

from __future__ import annotations

import inspect

import triton


def _runtime_parameters(fn) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values() if "constexpr" not in str(p.annotation)]


def jit_unspecialized(*names: str):
    """triton.jit without value or alignment specialization of the named runtime parameters (all of them if none
    is named: for the small per-step kernels, whose speed does not hang on it)."""

    def decorate(fn):
        runtime = _runtime_parameters(fn)
        unknown = set(names) - set(runtime)
        assert not unknown, f"{fn.__name__} has no runtime parameters {sorted(unknown)}"
        chosen = list(names) or runtime
        return triton.jit(fn, do_not_specialize=chosen, do_not_specialize_on_alignment=chosen)

    return decorate

"""One wrapper for Model Runner V2's logits processors that need a tree rule during a verification step.

V2's penalties and bad-words kernels read a row's context from the step's tokens in layout order: right for plain
decoding, wrong for a tree. `wrap_v2_processor` puts a tree rule in front of the processor's call in both of its
forms: `<legacy_name>(logits, expanded_idx_mapping, idx_mapping_np, input_ids, ...)` in 0.26, `apply(logits, ctx)`
with those fields on a LogitsContext in 0.32. Where the rule does not apply, V2's own call runs.
"""

from __future__ import annotations

from typing import Callable

import torch

# tree_rule(logits, expanded_idx_mapping, idx_mapping_np, input_ids) -> whether it handled the call (in place)
TreeRule = Callable[[torch.Tensor, torch.Tensor, object, torch.Tensor], bool]


def wrap_v2_processor(processor, legacy_name: str, tree_rule: TreeRule) -> bool:
    """Wrap `processor`'s call with `tree_rule`; False (and nothing changed) if it is wrapped already."""
    name = legacy_name if hasattr(processor, legacy_name) else "apply"
    original = getattr(processor, name)
    if getattr(original, "_ddtree_hook", False):
        return False

    def legacy(logits, expanded_idx_mapping, idx_mapping_np, input_ids, *args, **kwargs):  # 0.26
        if not tree_rule(logits, expanded_idx_mapping, idx_mapping_np, input_ids):
            return original(logits, expanded_idx_mapping, idx_mapping_np, input_ids, *args, **kwargs)

    def apply(logits, ctx):  # 0.32
        if not tree_rule(logits, ctx.expanded_idx_mapping, ctx.idx_mapping_np, ctx.input_ids):
            return original(logits, ctx)
        return logits

    wrapper = legacy if name == legacy_name else apply
    wrapper._ddtree_hook = True
    setattr(processor, name, wrapper)
    return True

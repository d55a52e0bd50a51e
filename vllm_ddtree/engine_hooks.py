"""Config hook: accept `{"method": "ddtree", ...}` in `LLM(speculative_config=...)` and `vllm serve`."""

from __future__ import annotations

import functools

from vllm_ddtree import config as ddtree_config


def is_ddtree(speculative_config) -> bool:
    return tree_depth(speculative_config) is not None


def tree_depth(speculative_config) -> int | None:
    """The drafter's query depth D of a DDTree config (None for other configs)."""
    settings = ddtree_config.settings_of(speculative_config)
    return None if settings is None else settings["depth"]


def install_config_hook() -> None:
    from vllm_ddtree.compat import (
        LOGGER_NAME,
        EngineArgs,
        choose_model_runner,
        init_logger,
        reserve_drafter_slots_for_tree_depth,
    )

    choose_model_runner(is_ddtree, init_logger(LOGGER_NAME))
    reserve_drafter_slots_for_tree_depth(tree_depth)
    original = EngineArgs.create_speculative_config
    if getattr(original, "_ddtree_hook", False):
        return

    @functools.wraps(original)
    def create_speculative_config(self, target_model_config, target_parallel_config):
        spec = self.speculative_config
        if not isinstance(spec, dict) or spec.get("method") != ddtree_config.METHOD:
            return original(self, target_model_config, target_parallel_config)
        spec = {k.replace("-", "_"): v for k, v in spec.items()}
        dflash_spec, ddtree = ddtree_config.split_ddtree_config(spec)
        pipeline_stages = getattr(target_parallel_config, "pipeline_parallel_size", 1)
        if pipeline_stages > 1:
            raise ValueError(
                f"speculative method 'ddtree' does not support pipeline parallelism yet (pipeline_parallel_size="
                f"{pipeline_stages}): the tree layout lives on the last stage. Use tensor parallelism "
                "(tensor_parallel_size) or method 'dflash'."
            )
        if getattr(target_model_config, "uses_mrope", False):  # both runners: tree positions are 1-D
            raise ValueError("speculative method 'ddtree' does not support M-RoPE target models yet; use method "
                             "'dflash'.")  # fmt: skip
        self.speculative_config = dflash_spec
        try:
            spec_config = original(self, target_model_config, target_parallel_config)
        finally:
            self.speculative_config = spec
        draft = spec_config.draft_model_config
        depth = ddtree_config.validate_models(ddtree, target_model_config.hf_config, draft.hf_config, draft.model)
        setattr(spec_config, ddtree_config.ATTRIBUTE, {**ddtree.to_dict(), "depth": depth})
        return spec_config

    create_speculative_config._ddtree_hook = True
    EngineArgs.create_speculative_config = create_speculative_config

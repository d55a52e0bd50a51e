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


# vLLM's single-key flags and the speculative_config keys they set.
SPEC_FLAGS = (
    ("--spec-method", "method", "spec_method"),
    ("--spec-model", "model", "spec_model"),
    ("--spec-tokens", "num_speculative_tokens", "spec_tokens"),
)


def is_ddtree_request(engine_args) -> bool:
    """`EngineArgs` asking for DDTree, by `speculative_config` or by `--spec-method`."""
    spec = engine_args.speculative_config
    from_dict = isinstance(spec, dict) and spec.get("method") == ddtree_config.METHOD
    return from_dict or getattr(engine_args, "spec_method", None) == ddtree_config.METHOD


def take_spec_flags(engine_args) -> None:
    """Merge `--spec-method/--spec-model/--spec-tokens` into a copy of `speculative_config`, as vLLM does inside
    `create_speculative_config` (with its error for a key given twice), and clear them: the hook reads the merged
    config before vLLM would merge."""
    spec = engine_args.speculative_config
    for flag, key, attribute in SPEC_FLAGS:
        value = getattr(engine_args, attribute, None)
        if value is None:
            continue
        spec = dict(spec or {})
        if key in spec:
            raise ValueError(f"{flag} and --speculative-config['{key}'] are mutually exclusive")
        spec[key] = value
        setattr(engine_args, attribute, None)
    engine_args.speculative_config = spec


def route_ddtree_requests(handle) -> None:
    """Wrap `EngineArgs.create_speculative_config`: configs asking for DDTree (`is_ddtree_request`) go to
    `handle(original, engine_args, target_model_config, target_parallel_config)`, every other one to vLLM's
    `original`; and let `--spec-method` take "ddtree". Idempotent."""
    from vllm_ddtree.compat import EngineArgs, accept_spec_method_in_cli

    accept_spec_method_in_cli(ddtree_config.METHOD)
    original = EngineArgs.create_speculative_config
    if getattr(original, "_ddtree_hook", False):
        return

    @functools.wraps(original)
    def create_speculative_config(self, target_model_config, target_parallel_config):
        if not is_ddtree_request(self):
            return original(self, target_model_config, target_parallel_config)
        return handle(original, self, target_model_config, target_parallel_config)

    create_speculative_config._ddtree_hook = True
    EngineArgs.create_speculative_config = create_speculative_config


def install_config_hook() -> None:
    from vllm_ddtree.compat import (
        LOGGER_NAME,
        choose_model_runner,
        init_logger,
        reserve_drafter_slots_for_tree_depth,
        reserve_kv_lookahead_for_tree_depth,
    )

    choose_model_runner(is_ddtree, init_logger(LOGGER_NAME))
    reserve_drafter_slots_for_tree_depth(tree_depth)
    reserve_kv_lookahead_for_tree_depth(tree_depth)
    route_ddtree_requests(ddtree_request_config)


def ddtree_request_config(original, engine_args, target_model_config, target_parallel_config):
    """vLLM's DFlash config for a DDTree request, carrying the DDTree settings; the engine arguments as given."""
    flags = {attribute: getattr(engine_args, attribute, None) for *_, attribute in SPEC_FLAGS}
    given = engine_args.speculative_config
    try:
        take_spec_flags(engine_args)
        return ddtree_speculative_config(original, engine_args, target_model_config, target_parallel_config)
    finally:  # the arguments as given: a second call gives the same config
        engine_args.speculative_config = given
        for attribute, value in flags.items():
            setattr(engine_args, attribute, value)


def ddtree_speculative_config(original, engine_args, target_model_config, target_parallel_config):
    spec = {k.replace("-", "_"): v for k, v in engine_args.speculative_config.items()}
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
    engine_args.speculative_config = dflash_spec
    spec_config = original(engine_args, target_model_config, target_parallel_config)
    draft = spec_config.draft_model_config
    depth = ddtree_config.validate_models(ddtree, target_model_config.hf_config, draft.hf_config, draft.model)
    setattr(spec_config, ddtree_config.ATTRIBUTE, {**ddtree.to_dict(), "depth": depth})
    return spec_config


def install_refusal_hook(reason: str) -> None:
    """On a vLLM DDTree cannot run on (`compat.unsupported_release`): leave vLLM as it is for every other config,
    and refuse `{"method": "ddtree"}` (or `--spec-method ddtree`) with `reason`, which names the supported releases,
    instead of vLLM's list of its own methods. Idempotent."""
    from vllm_ddtree.compat import LOGGER_NAME, init_logger

    init_logger(LOGGER_NAME).warning_once("%s vLLM runs as without the plugin.", reason)

    def refuse(*_):
        raise ValueError(reason)

    route_ddtree_requests(refuse)

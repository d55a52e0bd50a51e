"""Run vLLM's offline `LLM` on tiny models and collect outputs and spec-decode metrics."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field

SPEC_METRICS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos",
)


@dataclass
class RunResult:
    token_ids: list[list[int]]
    finish_reasons: list[str]
    metrics: dict = field(default_factory=dict)

    @property
    def acceptance_length(self) -> float:
        drafts = self.metrics.get("vllm:spec_decode_num_drafts", 0)
        accepted = self.metrics.get("vllm:spec_decode_num_accepted_tokens", 0)
        return 1.0 + accepted / drafts if drafts else 1.0


def device_kwargs() -> dict:
    """Engine settings per machine. CPU: eager. CUDA: vLLM's default CUDA graphs (a short list of capture sizes to
    keep engine start short), unless DDTREE_E2E_EAGER=1 asks for eager mode, or DDTREE_E2E_GRAPHS_ONLY=1 for full
    CUDA graphs of decode (verification) batches without vLLM's compiler: the same tree attention inside full
    graphs, without the minutes of a cold torch.compile (the float32 identity case did not start within 270 s
    on a fresh H200 in session 14)."""
    import torch

    if not torch.cuda.is_available():
        return dict(enforce_eager=True)
    # vLLM 0.26's fp32 GPU attention (TRITON_ATTN) computes its dot products in TF32 by Triton's default; seen on
    # the H200: a 5e-4 logit near-tie of the tiny target flipped in plain vLLM but not in DDTree's exact-fp32 tree
    # kernel (which matched transformers on the CPU). Make Triton's float32 dots exact so the baseline is exact too.
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
    # vLLM 0.26 reserves max_num_seqs * num_speculative_tokens scheduler slots (default 1024 sequences on GPU).
    kwargs = dict(max_num_seqs=8)
    if os.environ.get("DDTREE_E2E_EAGER") == "1":
        return dict(kwargs, enforce_eager=True)
    compilation = {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64, 128, 256]}
    if os.environ.get("DDTREE_E2E_GRAPHS_ONLY") == "1":
        compilation.update(mode=0, cudagraph_mode="FULL_DECODE_ONLY")  # CompilationMode.NONE
    return dict(kwargs, enforce_eager=False, compilation_config=compilation)


def same_runner_for_every_engine():
    """On CUDA, every engine of a test process (the plain-vLLM baseline too) starts on the model runner DDTree
    uses: vLLM's choice, or V1 with VLLM_DDTREE_RUNNER=v1. vLLM 0.26 does not take both runners' CUDA graphs in one process: a V2
    capture after a V1 engine was refused (session 14), and a V1 capture after a V2 engine hit a CUDA caching
    allocator assert (`use_count > 0`, session 15, the float32 identity test with full graphs)."""
    import contextlib
    from unittest import mock

    import torch

    from vllm_ddtree.compat import requested_runner

    if not torch.cuda.is_available() or requested_runner() != "v1":
        return contextlib.nullcontext()
    return mock.patch.dict(os.environ, {"VLLM_USE_V2_MODEL_RUNNER": "0"})


def make_llm(target: str, spec: dict | None, **engine_kwargs):
    from vllm import LLM

    kwargs = dict(
        model=target,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=512,
        distributed_executor_backend="uni",
        kv_cache_memory_bytes=64 * 2**20,
        disable_log_stats=False,
        seed=0,
    )
    kwargs.update(device_kwargs())
    kwargs.update(engine_kwargs)
    with same_runner_for_every_engine():
        return LLM(speculative_config=spec, **kwargs)


def generate(llm, prompts: list[list[int]], sampling_params) -> RunResult:
    from vllm.inputs import TokensPrompt

    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling_params, use_tqdm=False)
    metrics = {}
    for metric in llm.get_metrics():
        if metric.name in SPEC_METRICS:
            metrics[metric.name] = getattr(metric, "values", None) or getattr(metric, "value", 0)
    return RunResult(
        token_ids=[list(o.outputs[0].token_ids) for o in outputs],
        finish_reasons=[o.outputs[0].finish_reason for o in outputs],
        metrics=metrics,
    )


def metric(llm, name: str):
    """One of the engine's Prometheus metrics by name (a counter's or gauge's value)."""
    return {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}[name]


def run(target: str, spec: dict | None, prompts, sampling_params, **engine_kwargs) -> RunResult:
    from vllm_ddtree.compat import shutdown_llm

    llm = make_llm(target, spec, **engine_kwargs)
    try:
        return generate(llm, prompts, sampling_params)
    finally:
        shutdown_llm(llm)


class Engine:
    """An `LLM` no reference to which outlives `close()`: an engine collected later runs vLLM's shutdown again from
    its destructor and tears down the process groups of the engine started after it (one engine per process at a
    time). Use it where an engine lives in a fixture."""

    def __init__(self, target: str, spec: dict | None, **engine_kwargs):
        self.llm = make_llm(target, spec, **engine_kwargs)

    def close(self) -> None:
        from vllm_ddtree.compat import shutdown_llm

        llm, self.llm = self.llm, None
        shutdown_llm(llm)
        del llm
        gc.collect()

"""CUDA graphs for DDTree's per-step bookkeeping around the target's forward (experimental, Model Runner V2).

vLLM's FULL graphs hold the target's and the drafter's forward. What DDTree adds around them (the walk and the KV
compaction after the forward, the tree build after the drafter) is a few Triton launches with a dozen small tensor
ops of glue each: ~1 ms of host time per step on the H200's host, which is the whole per-step gap to vLLM's chain on
a host-bound model (docs/benchmarks.md, session 18). `StepGraphs` replays such a block from a CUDA graph per step
shape: one graph launch, and one copy per input that changes from step to step.

Off by default; `VLLM_DDTREE_BOOKKEEPING_GRAPHS=1` turns it on (uniform decode steps only, CUDA only).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Hashable

import torch

ENV = "VLLM_DDTREE_BOOKKEEPING_GRAPHS"


def bookkeeping_graphs_requested() -> bool:
    return os.environ.get(ENV, "0") == "1"


class StepGraphs:
    """One CUDA graph per key (a step shape) of a function of tensors.

    The first call of a key runs the function eagerly (Triton compiles, caches fill); the second captures it and
    replays the capture; later calls copy each input into the captured one (skipped where it is the same tensor)
    and replay. The function may read other tensors only where they stay at one address for the key (persistent
    buffers, per-shape constants), and must not synchronize with the host. Its results are the graph's own
    tensors: the next replay of the key overwrites them, so a result that outlives the step must be cloned."""

    def __init__(self):
        self._graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor], Any]] = {}
        self._seen: set[Hashable] = set()
        self._eager: set[Hashable] = set()  # keys whose capture failed: they run eagerly from then on
        self._pool = None

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, key: Hashable, fn: Callable[..., Any], inputs: dict[str, torch.Tensor]) -> Any:
        entry = self._graphs.get(key)
        if entry is None:
            if key not in self._seen or key in self._eager:
                self._seen.add(key)
                return fn(**inputs)
            try:
                entry = self._graphs[key] = self._capture(fn, inputs)
            except RuntimeError as error:  # a capture that fails must not take the engine down
                from vllm_ddtree.compat import LOGGER_NAME, init_logger

                init_logger(LOGGER_NAME).warning("DDTree: CUDA graph capture of %s failed (%s); it runs eagerly.",
                                                 key, error)  # fmt: skip
                self._eager.add(key)
                return fn(**inputs)
        graph, static_inputs, outputs = entry
        for name, value in inputs.items():
            static = static_inputs[name]
            if value.data_ptr() != static.data_ptr():
                static.copy_(value)
        graph.replay()
        return outputs

    def _capture(self, fn: Callable[..., Any], inputs: dict[str, torch.Tensor]):
        static_inputs = {name: value.clone() for name, value in inputs.items()}
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: vLLM's other threads may use CUDA meanwhile (a capture syncs once per new shape).
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            outputs = fn(**static_inputs)
        return graph, static_inputs, outputs


def step_graphs(device: torch.device) -> StepGraphs | None:
    """A `StepGraphs` where the switch is on and the device is CUDA, else None (the callers run eagerly)."""
    if torch.device(device).type != "cuda" or not bookkeeping_graphs_requested():
        return None
    return StepGraphs()

"""DDTree's tree metrics on `vllm serve`'s /metrics, in vLLM's naming style.

| metric | type | meaning |
| --- | --- | --- |
| `vllm:ddtree_num_verified_nodes_total` | counter | tree nodes the target scored, roots included: B + 1 per full tree |
| `vllm:ddtree_accepted_depth` | histogram, buckets 0..D | per verified tree, the depth its accepted path reached (0: no draft node accepted, only the root's bonus token) |

Labels `model_name` and `engine`, as vLLM's own counters. Only when the speculative config is DDTree's.

Route: /metrics is served by the API server, whose `PrometheusStatLogger` receives every engine step's
`SchedulerStats` and hands `spec_decoding_stats` (the scheduler's per-step `SpecDecodingStats`) to an instance of
its class attribute `_spec_decoding_cls` (vLLM's `SpecDecodingProm`). `install_metrics` sets that attribute to a
subclass which does everything `SpecDecodingProm` does and also feeds the tree counters from the same stats. No
new data crosses a process boundary; both metrics are exact functions of those stats:

- nodes verified = draft tokens + drafts (each verified tree is its root plus its draft nodes; vLLM counts the
  draft nodes, minus any it invalidated, as `num_draft_tokens`);
- trees whose accepted path reached depth >= d = `num_accepted_tokens_per_pos[d - 1]` (a node is accepted only
  after its parent, so "accepted at position d - 1" is "accepted path at least d deep"), so exactly d deep =
  `per_pos[d - 1] - per_pos[d]`, with `per_pos[-1]` = drafts.

Same in vLLM 0.26 and 0.32 (`compat.metrics_loggers`). `register()` runs in the API server too, before it builds
its stat loggers, so installing there is early enough.
"""

from __future__ import annotations

from vllm_ddtree import config as ddtree_config

VERIFIED_NODES = "vllm:ddtree_num_verified_nodes"
ACCEPTED_DEPTH = "vllm:ddtree_accepted_depth"


def accepted_depth_counts(num_drafts: int, accepted_per_pos: list[int], depth: int) -> list[int]:
    """[n_0, ..., n_depth]: how many of the step's trees had an accepted path exactly d deep."""
    reached = [num_drafts] + [accepted_per_pos[d] if d < len(accepted_per_pos) else 0 for d in range(depth + 1)]
    return [reached[d] - reached[d + 1] for d in range(depth + 1)]


class TreeMetrics:
    """The tree counters of one stat logger, per engine."""

    def __init__(self, depth: int, labelnames: list[str], per_engine_labelvalues: dict, counter_cls=None):
        import prometheus_client

        counter_cls = counter_cls or prometheus_client.Counter
        self.depth = depth
        nodes = counter_cls(
            name=VERIFIED_NODES,
            documentation="Number of draft tree nodes scored by the target model in verification, the roots "
            "included (B + 1 per full tree).",
            labelnames=labelnames,
        )
        accepted_depth = prometheus_client.Histogram(
            name=ACCEPTED_DEPTH,
            documentation="Depth reached in the draft tree by the accepted path of each verified tree "
            "(0: no draft node accepted).",
            labelnames=labelnames,
            buckets=[float(d) for d in range(depth + 1)],
        )
        self.nodes = {idx: nodes.labels(*values) for idx, values in per_engine_labelvalues.items()}
        self.accepted_depth = {idx: accepted_depth.labels(*values) for idx, values in per_engine_labelvalues.items()}

    def observe(self, stats, engine_idx: int = 0) -> None:
        if stats.num_drafts == 0:
            return
        self.nodes[engine_idx].inc(stats.num_draft_tokens + stats.num_drafts)
        histogram = self.accepted_depth[engine_idx]
        counts = accepted_depth_counts(stats.num_drafts, stats.num_accepted_tokens_per_pos, self.depth)
        for d, count in enumerate(counts):
            for _ in range(count):
                histogram.observe(d)


def install_metrics() -> None:
    """Make vLLM's Prometheus stat logger export the tree metrics for DDTree configs. Idempotent."""
    from vllm_ddtree.compat import metrics_loggers

    logger_cls, _ = metrics_loggers()
    base = logger_cls._spec_decoding_cls
    if getattr(base, "_ddtree_metrics", False):
        return

    class DDTreeSpecDecodingProm(base):
        """vLLM's spec-decode counters, plus the tree metrics when the speculative config is DDTree's."""

        _ddtree_metrics = True

        def __init__(self, speculative_config, labelnames, per_engine_labelvalues, *args, **kwargs):
            super().__init__(speculative_config, labelnames, per_engine_labelvalues, *args, **kwargs)
            settings = ddtree_config.settings_of(speculative_config)
            self.ddtree_metrics = None
            if settings is not None:
                self.ddtree_metrics = TreeMetrics(
                    settings["depth"], list(labelnames), per_engine_labelvalues, getattr(self, "_counter_cls", None)
                )

        def observe(self, spec_decoding_stats, engine_idx: int = 0):
            super().observe(spec_decoding_stats, engine_idx)
            if self.ddtree_metrics is not None:
                self.ddtree_metrics.observe(spec_decoding_stats, engine_idx)

    DDTreeSpecDecodingProm.__qualname__ = DDTreeSpecDecodingProm.__name__
    logger_cls._spec_decoding_cls = DDTreeSpecDecodingProm

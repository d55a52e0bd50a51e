"""The spec-decode counters and DDTree's tree metrics of a server's /metrics (`Server.metrics()`), and the identities
that tie them together (docs/serving.md, Metrics)."""

from __future__ import annotations

from tests.serve.pair import BUDGET, DEPTH


def spec_counters(metrics: dict[str, float]) -> tuple[float, float, float, list[float]]:
    """(drafts, draft tokens, accepted tokens, accepted per position 0..B-1): vLLM's spec-decode counters."""
    per_position = [metrics[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'] for i in range(BUDGET)]
    return (
        metrics["vllm:spec_decode_num_drafts_total"],
        metrics["vllm:spec_decode_num_draft_tokens_total"],
        metrics["vllm:spec_decode_num_accepted_tokens_total"],
        per_position,
    )


def tree_metrics(metrics: dict[str, float]) -> tuple[float, list[float], float, float]:
    """(nodes verified, accepted-depth histogram buckets le=0..DEPTH, its count, its sum)."""
    buckets = [metrics[f'vllm:ddtree_accepted_depth_bucket{{le="{float(d)}"}}'] for d in range(DEPTH + 1)]
    return (
        metrics["vllm:ddtree_num_verified_nodes_total"],
        buckets,
        metrics["vllm:ddtree_accepted_depth_count"],
        metrics["vllm:ddtree_accepted_depth_sum"],
    )


def minus(after, before):
    """after - before, elementwise through lists."""
    if isinstance(after, (list, tuple)):
        return [minus(a, b) for a, b in zip(after, before)]
    return after - before


def check_tree_metrics(spec, tree) -> None:
    """The tree metrics are what the spec-decode counters say about the same trees (either totals or deltas)."""
    drafts, draft_tokens, accepted, per_position = spec
    nodes, buckets, count, total = tree
    assert nodes == draft_tokens + drafts <= (BUDGET + 1) * drafts  # each tree: its root + its draft nodes
    assert count == drafts and total == accepted  # one depth per verified tree; accepted nodes = path depths
    # Paths at most d deep = all trees - paths that reach depth d + 1 (per position d); none deeper than the tree.
    assert buckets == [drafts - per_position[d] for d in range(DEPTH)] + [drafts], (buckets, per_position)

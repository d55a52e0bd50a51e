"""vLLM's own serving benchmark against the DDTree server: `vllm bench serve` measures DDTree like any other
speculative method (throughput, TTFT/TPOT, and acceptance from the server's /metrics counters).

The numbers it reports for DDTree mean: acceptance length = 1 + accepted / drafts (the mean accepted tree path
+ 1, the figure to compare with the chain); draft tokens = B per draft (every tree node besides the root), so its
"acceptance rate" = accepted / (drafts x B) falls as the budget grows and is not comparable with a chain's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.serve.pair import BUDGET, DEPTH, TARGET
from tests.serve.server import MODEL_NAME

ROOT = Path(__file__).resolve().parents[2]
NUM_PROMPTS = 24

pytestmark = pytest.mark.slow


def counter(metrics: dict, name: str) -> float:
    return metrics.get(f"vllm:spec_decode_{name}_total", metrics.get(f"vllm:spec_decode_{name}", 0.0))


def test_vllm_bench_serve_reports_ddtree_acceptance(ddtree_server, tmp_path):
    before = ddtree_server.settle()
    command = [
        sys.executable, str(ROOT / "scripts" / "vllm_cpu_cli.py"), "bench", "serve",
        "--base-url", ddtree_server.root, "--model", MODEL_NAME, "--tokenizer", str(TARGET),
        "--dataset-name", "random", "--random-input-len", "24", "--random-output-len", "40", "--ignore-eos",
        "--num-prompts", str(NUM_PROMPTS), "--max-concurrency", "8", "--temperature", "0", "--seed", "0",
        "--save-result", "--result-dir", str(tmp_path), "--result-filename", "bench.json",
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "Speculative" in run.stdout, run.stdout[-3000:]  # its printed report has the spec-decode section
    result = json.loads((tmp_path / "bench.json").read_text())
    after = ddtree_server.settle()

    assert result["completed"] == NUM_PROMPTS
    assert result["total_output_tokens"] == NUM_PROMPTS * 40
    # The benchmark's figures are the server's counters, differenced around its run (settle() adds one
    # single-token request after the run, which drafts nothing).
    drafts = counter(after, "num_drafts") - counter(before, "num_drafts")
    accepted = counter(after, "num_accepted_tokens") - counter(before, "num_accepted_tokens")
    assert result["spec_decode_num_drafts"] == drafts > 0
    assert result["spec_decode_accepted_tokens"] == accepted
    assert result["spec_decode_draft_tokens"] == drafts * BUDGET
    assert result["spec_decode_acceptance_length"] == pytest.approx(1 + accepted / drafts)
    assert 1.0 < result["spec_decode_acceptance_length"] <= DEPTH + 1
    assert result["spec_decode_acceptance_rate"] == pytest.approx(100 * accepted / (drafts * BUDGET))
    per_depth = result["spec_decode_per_position_acceptance_rates"]
    assert len(per_depth) <= BUDGET and all(a >= b for a, b in zip(per_depth, per_depth[1:]))  # one per depth
    assert not any(per_depth[DEPTH:])  # no path is deeper than the drafter's block
    assert sum(per_depth) == pytest.approx(accepted / drafts)  # fractions of drafts

"""scripts/benchmark.py runs a row's prompts with `batch` requests in flight (continuous batching), on the real engine:
every prompt's answer comes back in prompt order, identical to `LLM.generate`'s, and the engine never holds more
than `batch` requests while it keeps that many running until the prompts run out. With --interleave its engines
run side by side (each in its own process) and take turns, row by row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.engine import make_llm
from tests.e2e.test_tiny_pair_ddtree import DRAFTER, ENGINE, TARGET, ddtree, greedy, prompts  # noqa: F401 (fixture)
from tests.unit.test_benchmark_script import load_benchmark
from vllm_ddtree.compat import shutdown_llm

pytestmark = pytest.mark.slow


def test_requests_in_flight_stay_at_the_batch_size_and_answers_match_generate(prompts):
    bench = load_benchmark()
    llm = make_llm(TARGET, ddtree(11), **ENGINE)
    try:
        params = greedy(24, stop_token_ids=[prompts[0][1]])  # a stop token: answers of different lengths
        expected = [list(o.outputs[0].token_ids) for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts[:7]], params, use_tqdm=False)]  # fmt: skip
        assert len({len(t) for t in expected}) > 1

        engine = llm.llm_engine
        in_flight = []
        step = engine.step

        def counted_step():
            in_flight.append(engine.get_num_unfinished_requests())
            return step()

        engine.step = counted_step
        outputs = bench.generate_at_concurrency(llm, [{"prompt_token_ids": p} for p in prompts[:7]], 3, params)
        engine.step = step
        once = bench.measure(llm, [{"prompt_token_ids": p} for p in prompts[:7]], 3, 0.0, 24, 1, True)
        repeated = bench.measure(llm, [{"prompt_token_ids": p} for p in prompts[:7]], 3, 0.0, 24, 1, True,
                                 min_seconds=4 * once["seconds"])  # fmt: skip (CI ran a 1.5x pass in one, session 21)
        alone = bench.measure(llm, [{"prompt_token_ids": p} for p in prompts[:3]], 1, 0.0, 24, 1, True)
    finally:
        shutdown_llm(llm)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    # Kept at 3 (a finished request is replaced at once) until the prompts run out, then drained: never below 3 and
    # back up again, as consecutive groups of 3 would be.
    assert in_flight[0] == 3 and max(in_flight) == 3
    assert all(a >= b for a, b in zip(in_flight, in_flight[1:])), in_flight
    # A measurement's prompts run again until its minimum time has passed: the same answers, tokens counted per pass.
    assert once["passes"] == 1 and once["output_tokens"] == 7 * 24
    assert repeated["passes"] >= 2 and repeated["output_tokens"] == repeated["passes"] * 7 * 24
    assert repeated["token_ids"] == once["token_ids"]
    assert repeated["acceptance_length"] == pytest.approx(once["acceptance_length"])
    # Requests that ran alone are timed one by one (tokens, ms), for `request_cost_fit`; batched ones are not.
    assert [t for t, _ in alone["request_times"]] == [24, 24, 24] and min(ms for _, ms in alone["request_times"]) > 0
    assert sum(ms for _, ms in alone["request_times"]) <= alone["seconds"] * 1e3 and "request_times" not in once


def test_interleaved_rounds_run_every_method_in_turn_on_engines_started_together(tmp_path):
    """`benchmark.py --interleave 2` on the real engine, each method's engine in its own engine-core process (as on
    the GPU): every row is measured once per round, the rows' and the methods' order turn between rounds, the greedy
    answers of DDTree equal no speculation's (float32), and the combined rows are the rounds' totals."""
    repo = Path(__file__).resolve().parents[2]
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["copy: abc =", "count from five to nine:", "3 days from friday:", "spell dog:"]))
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["PYTHONPATH"] = os.pathsep.join([str(repo), env.get("PYTHONPATH", "")])
    out = tmp_path / "out"
    command = [sys.executable, str(repo / "scripts/benchmark.py"), "--target", TARGET, "--drafter", DRAFTER,
               "--dtype", "float32", "--eager", "--methods", "ddtree-B5", "none", "--budgets", "5",
               "--batch-sizes", "2", "--temperatures", "0", "1", "--max-tokens", "12", "--min-prompts", "4",
               "--max-model-len", "512", "--prompts-file", str(prompts), "--interleave", "2", "--out", str(out),
               "--cpus", ",".join(map(str, sorted(os.sched_getaffinity(0))))]  # fmt: skip
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    order = [(r["round"], r["temperature"], r["method"]) for r in results["round_rows"]]
    assert order == [(0, 0.0, "ddtree-B5"), (0, 0.0, "none"), (0, 1.0, "ddtree-B5"), (0, 1.0, "none"),
                     (1, 1.0, "none"), (1, 1.0, "ddtree-B5"), (1, 0.0, "none"), (1, 0.0, "ddtree-B5")]
    # Each engine counts its own acceptance, also the one started before the last (vLLM's Prometheus registry
    # holds only the last engine's counters: session 22's first interleaved run lost every other method's).
    for row in results["round_rows"]:
        assert (row["acceptance_length"] is not None) == (row["method"] == "ddtree-B5"), row["method"]
        assert len(row["host_probe_ms"]) == 2 and min(row["host_probe_ms"]) > 0
    for row in results["rows"]:
        key = (row["method"], row["temperature"])
        rounds = [r for r in results["round_rows"] if (r["method"], r["temperature"]) == key]
        assert row["rounds"] == 2 and row["output_tokens"] == sum(r["output_tokens"] for r in rounds) >= 2 * 4 * 12
        assert row["output_tokens_per_s"] == pytest.approx(row["output_tokens"] / sum(r["seconds"] for r in rounds))
        if row["method"] == "ddtree-B5":
            assert row["acceptance_length"] == 1 + sum(r["accepted"] for r in rounds) / sum(r["drafts"] for r in rounds)
            assert row["acceptance_length"] > 1 and len(row["acceptance_per_depth"]) == 5
    greedy = json.loads((out / "greedy_tokens.json").read_text())
    assert greedy["ddtree-B5|batch2"] == greedy["none|batch2"]
    table = (out / "table.md").read_text()
    assert "Within each round" in table and "| ddtree-B5 | 0.0 | 2 |" in table
    # --resume with every method measured (gpu_bench_pair.sh always resumes): nothing to run, results kept.
    again = subprocess.run(command + ["--resume"], env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((out / "results.json").read_text())["round_rows"] == results["round_rows"]

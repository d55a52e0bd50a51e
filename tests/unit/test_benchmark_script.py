"""scripts/benchmark.py: its CUDA-graph capture sizes, and its report of how far greedy answers drift from no
speculation's (issue 3's bf16 check)."""

import importlib.util
import os
from pathlib import Path
from unittest import mock

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script(name: str):
    """scripts/`name` as a module; the environment variables it sets for itself (vLLM's switches) are undone."""
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py") + "_script", SCRIPTS / name)
    module = importlib.util.module_from_spec(spec)
    with mock.patch.dict(os.environ):
        spec.loader.exec_module(module)
    return module


def load_benchmark():
    return load_script("benchmark.py")


def test_first_difference_is_the_first_differing_index_or_the_shorter_length():
    bench = load_benchmark()
    assert bench.first_difference([1, 2, 3], [1, 2, 3]) == 3
    assert bench.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert bench.first_difference([1, 2], [1, 2, 7, 8]) == 2  # one answer stopped earlier
    assert bench.first_difference([], [4]) == 0


def test_greedy_agreement_compares_each_method_with_no_speculation_and_the_chain_at_the_same_batch():
    bench = load_benchmark()
    rows = [
        {"method": m, "temperature": t, "batch": b}
        for m in ("none", "dflash", "ddtree-B16") for t in (0.0, 1.0) for b in (1, 4)
    ]
    base = [[1, 2, 3, 4], [5, 6, 7, 8]]
    tokens = {
        bench.greedy_key("none", 1): base,
        bench.greedy_key("none", 4): [[1, 2, 3, 9], [5, 6, 7, 8]],
        bench.greedy_key("dflash", 1): base,  # identical
        bench.greedy_key("dflash", 4): [[1, 2, 3, 9], [5, 6, 0, 0]],  # second prompt differs at 2
        bench.greedy_key("ddtree-B16", 1): [[1, 0, 3, 4], [5, 6, 7]],  # differ at 1; stops early at 3
    }  # ddtree-B16 at batch 4 missing: no line
    lines = bench.greedy_agreement(rows, tokens).splitlines()
    assert lines[2:] == [
        "| dflash | none | 1 | 2 / 2 | 4.0 | 4.0 |",
        "| dflash | none | 4 | 1 / 2 | 3.0 | 4.0 |",
        "| ddtree-B16 | none | 1 | 0 / 2 | 2.0 | 4.0 |",
        "| ddtree-B16 | dflash | 1 | 0 / 2 | 2.0 | 4.0 |",  # and against the chain's answers
    ]
    assert bench.greedy_agreement(rows, {}) == ""  # no T = 0 answers of a baseline: no table
    without_none = {k: v for k, v in tokens.items() if not k.startswith("none|")}  # a run without no speculation
    assert bench.greedy_agreement(rows, without_none).splitlines()[2:] == [
        "| ddtree-B16 | dflash | 1 | 0 / 2 | 2.0 | 4.0 |"]


def test_capture_sizes_hold_every_request_counts_uniform_step_exactly():
    """Model Runner V2 replays a uniform batch's FULL graph only when the smallest capture size at or above its token
    count is a multiple of the tokens per request; with every r x (B + 1) in the list that size is the step itself.
    Budgets that do not divide a power of two (B + 1 = 65, 17) are the case power-of-two lists got wrong; with a
    budget per batch size (`--schedules`) each request count's own step is in the list."""
    bench = load_benchmark()
    schedule = {"num_speculative_tokens": 64,
                "num_speculative_tokens_per_batch_size": bench.parse_schedule("1-4:64,5-64:16")}
    cases = [(64, 16), (16, 16), (15, 16), (0, 0)]
    for spec, block in [({"num_speculative_tokens": b}, block) for b, block in cases] + [(schedule, 16)]:
        drafts = bench.drafts_by_batch_size(spec if spec["num_speculative_tokens"] else None, 64)
        sizes = bench.capture_sizes(drafts, block)
        assert sizes == sorted(set(sizes))
        for r in range(1, 65):
            step = r * (drafts[r] + 1)
            assert min(s for s in sizes if s >= step) == step, (spec, r)
        powers = [s for s in sizes if s & (s - 1) == 0]
        assert powers[-1] >= max(r * (drafts[r] + 1) for r in range(1, 65)) and 1 in powers  # prefills
        if block:
            assert block * 64 in sizes  # the drafter's largest uniform step
    assert bench.drafts_by_batch_size(schedule, 64)[1:] == [64] * 4 + [16] * 60  # vLLM's own lookup


def test_schedules_become_ddtree_methods():
    bench = load_benchmark()
    plan = dict(bench.methods("/d", 16, [64], ["1-4:64,5-64:15"]))
    assert plan["ddtree-1-4:64,5-64:15"] == {
        "method": "ddtree", "model": "/d", "num_speculative_tokens": 64,
        "num_speculative_tokens_per_batch_size": [[1, 4, 64], [5, 64, 15]],
    }


def test_method_names_take_the_switch_and_runner_suffixes():
    bench = load_benchmark()
    by_name = dict(bench.methods("/d", 16, [32]))
    b32 = {"method": "ddtree", "model": "/d", "num_speculative_tokens": 32}
    assert bench.spec_of_name("ddtree-B32", by_name) == b32
    assert bench.spec_of_name("ddtree-B32-v2", by_name) == b32
    assert bench.spec_of_name("ddtree-B32-ingraph", by_name) == {**b32, "tree_in_graph": True}
    assert bench.spec_of_name("ddtree-B32-ingraph-v2", by_name) == {**b32, "tree_in_graph": True}
    both = {**b32, "tree_in_graph": True, "layout_in_graph": True}
    assert bench.spec_of_name("ddtree-B32-ingraph-layoutgraph", by_name) == both
    assert bench.spec_of_name("ddtree-B32-layoutgraph-ingraph-v2", by_name) == both
    assert bench.spec_of_name("ddtree-B32-hostlayout", by_name) == {**b32, "layout_in_graph": False}
    assert bench.spec_of_name("ddtree-B32-treeafter", by_name) == {**b32, "tree_in_graph": False}
    assert bench.spec_of_name("ddtree-B32-chaintree-layoutgraph", by_name) == {**b32, "max_topk": 1,
                                                                               "layout_in_graph": True}
    assert "tree_in_graph" not in by_name["ddtree-B32"]  # the plan's own spec is not changed
    assert bench.spec_of_name("none", by_name) is None
    assert bench.spec_of_name("dflash-v1", by_name) == by_name["dflash"]
    for unknown in ["dflash-ingraph", "ddtree-B16", "ddtree-B32-v2-ingraph", "none-ingraph",
                    "ddtree-B32-ingraph-ingraph", "ddtree-B32-treeafter-ingraph"]:
        assert bench.spec_of_name(unknown, by_name) is KeyError, unknown


def test_fastest_by_batch_names_the_best_budget_against_chain_and_none():
    bench = load_benchmark()
    speed = {("none", 1): 100, ("dflash", 1): 120, ("ddtree-B64", 1): 160, ("ddtree-B16", 1): 130,
             ("none", 16): 1000, ("dflash", 16): 900, ("ddtree-B64", 16): 700, ("ddtree-B16", 16): 950}
    rows = [{"method": m, "temperature": 0.0, "batch": b, "output_tokens_per_s": v} for (m, b), v in speed.items()]
    lines = bench.fastest_by_batch(rows).splitlines()
    assert lines[2:] == [
        "| 0.0 | 1 | ddtree-B64 | ddtree-B64 | 1.33x | 1.60x |",
        "| 0.0 | 16 | none | ddtree-B16 | 1.06x | 0.95x |",  # the smaller budget wins at the larger batch
    ]
    assert bench.fastest_by_batch([r for r in rows if not r["method"].startswith("ddtree")]) == ""


def test_suggested_schedule_takes_the_fastest_fixed_budget_per_batch_range():
    """Per temperature, the fastest `ddtree-B<n>` at each measured batch size becomes a budget range (up to the
    geometric midpoint to the next measured size; equal neighbours merge), written as vLLM's schedule and in the
    `--schedules` form; schedule rows and non-DDTree rows do not count."""
    bench = load_benchmark()
    speed = {(0.0, 1, "ddtree-B64"): 700, (0.0, 1, "ddtree-B16"): 580, (0.0, 1, "dflash"): 900,
             (0.0, 4, "ddtree-B64"): 1700, (0.0, 4, "ddtree-B16"): 1600,
             (0.0, 16, "ddtree-B64"): 6000, (0.0, 16, "ddtree-B16"): 6100, (0.0, 16, "ddtree-1-64:8"): 9999,
             (0.0, 64, "ddtree-B64"): 13000, (0.0, 64, "ddtree-B16"): 19000,
             (1.0, 1, "ddtree-B64"): 400, (1.0, 1, "ddtree-B16"): 470, (1.0, 16, "ddtree-B16"): 2500}
    rows = [{"method": m, "temperature": t, "batch": b, "output_tokens_per_s": v} for (t, b, m), v in speed.items()]
    lines = bench.suggested_schedules(rows).splitlines()
    assert lines[2:] == [
        "| 0.0 | `1-8:64,9-64:16` | `[[1, 8, 64], [9, 64, 16]]` |",  # 1 and 4 merge; 4 covers up to isqrt(64)
        "| 1.0 | `1-16:16` | `[[1, 16, 16]]` |",
    ]
    schedule = bench.parse_schedule("1-8:64,9-64:16")  # the --schedules form reads back as the same schedule
    assert schedule == [[1, 8, 64], [9, 64, 16]]
    assert bench.suggested_schedules([r for r in rows if r["method"] == "dflash"]) == ""


def test_rounds_of_a_row_add_up_and_their_ratios_are_taken_within_each_round():
    """--interleave: a row measured in several rounds reports all its tokens over all its seconds and its summed
    spec-decode counts; the ratio table divides by the baseline of the same round only (the host's speed drifts
    between rounds), and the methods' order turns from round to round."""
    bench = load_benchmark()

    def row(method, n, tokens, seconds, drafts=0, accepted=0, per_pos=()):
        return {"method": method, "temperature": 0.0, "batch": 4, "round": n, "passes": 1, "prompts": 16,
                "host_probe_ms": [1.0 + n, 1.5 + n], **bench.speed_and_acceptance(tokens, seconds, 4, drafts, accepted,
                                                                                   list(per_pos))}  # fmt: skip

    rows = [row("dflash", 0, 1000, 1.0, 100, 150, [80, 70]), row("ddtree-B16", 0, 1200, 1.0, 80, 200, [70, 130]),
            row("dflash", 1, 1000, 2.0, 100, 150, [80, 70]), row("ddtree-B16", 1, 1000, 1.0, 70, 210, [60, 150]),
            row("dflash", 2, 1000, 1.0, 100, 150, [80, 70]), row("ddtree-B16", 2, 1100, 1.0, 75, 200, [65, 135])]
    tree = next(r for r in bench.combine_rounds(rows) if r["method"] == "ddtree-B16")
    assert tree["rounds"] == 3 and tree["passes"] == 3 and "round" not in tree and "host_probe_ms" not in tree
    assert tree["round_host_probe_ms"] == [[1.0, 1.5], [2.0, 2.5], [3.0, 3.5]]  # each round's, before and after
    assert tree["output_tokens_per_s"] == 3300 / 3.0 and tree["round_tokens_per_s"] == [1200, 1000, 1100]
    assert tree["acceptance_length"] == 1 + 610 / 225
    assert tree["acceptance_per_depth"] == [round(195 / 225, 4), round(415 / 225, 4)]
    chain = next(r for r in bench.combine_rounds(rows) if r["method"] == "dflash")
    assert chain["output_tokens_per_s"] == 3000 / 4.0
    # Within rounds: 1.2, 2.0 (the chain's slow round 1 against DDTree's own round 1), 1.1 -> median 1.2.
    assert bench.round_ratios(rows).splitlines()[2:] == ["| ddtree-B16 | 0.0 | 4 | 1.20x (1.10-2.00, 3 rounds) |"]
    assert bench.round_ratios([r for r in rows if r["method"] != "dflash"]) == ""  # no baseline: no table
    assert bench.rotated(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert bench.rotated(["a", "b", "c"], 4) == ["b", "c", "a"]
    single = bench.combine_rounds([{"method": "none", "temperature": 1.0, "batch": 1, "output_tokens_per_s": 9.0}])
    assert single == [{"method": "none", "temperature": 1.0, "batch": 1, "output_tokens_per_s": 9.0, "passes": 1,
                       "rounds": 1, "round_tokens_per_s": [9.0], "round_host_probe_ms": [None]}]  # pre-rounds row
    old = [{"method": "none", "temperature": 1.0, "batch": 1, "output_tokens": 100 * n, "seconds": 1.0, "passes": 1,
            "output_tokens_per_s": 100.0 * n, "acceptance_length": None} for n in (1, 2)]  # two old files' rows
    assert bench.combine_rounds(old)[0]["output_tokens_per_s"] == 150.0


def test_batch_one_requests_split_into_a_fixed_cost_and_a_cost_per_token():
    """Requests that ran alone: least squares recovers a fixed cost and a per-token cost exactly from times that
    follow them, rounds' requests are pooled, and the table shows the fit beside the mean answer."""
    bench = load_benchmark()
    times = [[tokens, 40.0 + 2.5 * tokens] for tokens in (50, 120, 256, 80)]
    fit = bench.request_cost_fit(times)
    assert fit["fixed_ms"] == pytest.approx(40.0) and fit["ms_per_token"] == pytest.approx(2.5)
    assert fit["requests"] == 4
    assert bench.request_cost_fit(times[:2]) is None  # too few requests to trust
    assert bench.request_cost_fit([[64, 10.0], [64, 11.0], [64, 12.0]]) is None  # equal lengths: no split

    def row(n, request_times):
        return {"method": "ddtree-B32", "temperature": 0.0, "batch": 1, "round": n, "run": "r",
                "request_times": request_times, **bench.speed_and_acceptance(100, 1.0, 1, 10, 20, [10])}

    combined = bench.combine_rounds([row(0, times[:2]), row(1, times[2:])])[0]
    assert combined["request_times"] == times and combined["request_cost"] == fit
    table = bench.request_cost_table([combined]).splitlines()
    assert table[2] == "| ddtree-B32 | 0.0 | 4 | 40.0 | 2.500 | 126 |"
    assert bench.request_cost_table([bench.combine_rounds([{**row(0, []), "batch": 4}])[0]]) == ""


def test_each_round_opens_with_another_row_and_another_method():
    """--interleave: every round measures every (temperature, batch) row once for every method; across rounds each
    row opens a round once (none always follows the previous round's largest rows) and the methods take turns."""
    bench = load_benchmark()
    rounds = [bench.round_order(["chain", "tree"], [0.0, 1.0], [1, 4], r) for r in range(4)]
    for order in rounds:
        assert sorted(order) == sorted((t, b, e) for t in (0.0, 1.0) for b in (1, 4) for e in ("chain", "tree"))
    assert [order[0][:2] for order in rounds] == [(0.0, 1), (0.0, 4), (1.0, 1), (1.0, 4)]
    assert [order[0][2] for order in rounds] == ["chain", "tree", "chain", "tree"]
    assert rounds[1][:4] == [(0.0, 4, "tree"), (0.0, 4, "chain"), (1.0, 1, "tree"), (1.0, 1, "chain")]


def test_every_results_write_draws_the_plots_too(tmp_path):
    """A run cut by its time limit keeps its plots: `write_results` (after every method, or every round of an
    interleaved run) draws them; the interleaved run's writes after each row (`plots=False`) write the rest."""
    pytest.importorskip("matplotlib")
    from argparse import Namespace

    bench = load_benchmark()
    rows = [{"method": m, "temperature": t, "batch": b, "prompts": 16, "passes": 1,
             **bench.speed_and_acceptance(1000 * b, 1.0, b, 100, accepted, [accepted])}
            for m, accepted in (("dflash", 100), ("ddtree-B32", 200)) for t in (0.0, 1.0) for b in (1, 4)]  # fmt: skip
    bench.write_results(tmp_path, Namespace(interleave=0), rows, plots=False)
    assert (tmp_path / "results.json").exists() and not list(tmp_path.glob("*.png"))
    bench.write_results(tmp_path, Namespace(interleave=0), rows)
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["throughput_T0.0.png", "throughput_T1.0.png"]
    assert (tmp_path / "table.md").read_text().startswith("| method")


def test_cpu_lists_read_as_taskset_writes_them_and_the_host_probe_times_fixed_work():
    bench = load_benchmark()
    assert bench.parse_cpus("0-3,8") == {0, 1, 2, 3, 8}
    assert bench.parse_cpus("5") == {5}
    assert 0 < bench.host_probe_ms() < 1000


def test_rounds_of_different_runs_neither_combine_nor_compare():
    """Rows of two benchmark.py runs (--resume adding methods, --plot-from of two files) pair only within their own
    run's rounds: a ratio across runs would carry the host drift the rounds exist to avoid. The baselines are
    compared with each other too."""
    bench = load_benchmark()

    def row(method, run, n, tok_s):
        return {"method": method, "temperature": 0.0, "batch": 1, "run": run, "round": n, "passes": 1,
                **bench.speed_and_acceptance(tok_s, 1.0, 1, 0, 0, [])}

    rows = [row("dflash", "a", 0, 100), row("none", "a", 0, 50), row("dflash", "a", 1, 100), row("none", "a", 1, 80),
            row("ddtree-B32", "b", 0, 300), row("dflash", "b", 0, 200)]  # fmt: skip
    lines = bench.round_ratios(rows).splitlines()[2:]
    assert lines == ["| dflash | 0.0 | 1 | - | 1.62x (1.25-2.00, 2 rounds) |",
                     "| none | 0.0 | 1 | 0.65x (0.50-0.80, 2 rounds) | - |",
                     "| ddtree-B32 | 0.0 | 1 | 1.50x (1.50-1.50, 1 rounds) | - |"]  # against run b's chain only
    chains = [r for r in bench.combine_rounds(rows) if r["method"] == "dflash"]
    assert [(r["run"], r["rounds"], r["output_tokens_per_s"]) for r in chains] == [("a", 2, 100.0), ("b", 1, 200.0)]


def test_a_row_runs_batch_times_prompts_per_batch_prompts_at_least_min_prompts():
    from types import SimpleNamespace

    benchmark = load_benchmark()
    args = SimpleNamespace(prompts_per_batch=4, min_prompts=16)
    assert [benchmark.prompts_per_row(b, args) for b in (1, 4, 16, 64)] == [16, 16, 64, 256]
    args = SimpleNamespace(prompts_per_batch=1, min_prompts=16)  # the default: as many prompts as the batch
    assert [benchmark.prompts_per_row(b, args) for b in (1, 4, 16, 64)] == [16, 16, 16, 64]

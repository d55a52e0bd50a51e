"""scripts/benchmark.py's report of how far greedy answers drift from no speculation's (issue 3's bf16 check)."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "benchmark.py"


def load_benchmark():
    spec = importlib.util.spec_from_file_location("benchmark_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_first_difference_is_the_first_differing_index_or_the_shorter_length():
    bench = load_benchmark()
    assert bench.first_difference([1, 2, 3], [1, 2, 3]) == 3
    assert bench.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert bench.first_difference([1, 2], [1, 2, 7, 8]) == 2  # one answer stopped earlier
    assert bench.first_difference([], [4]) == 0


def test_greedy_agreement_compares_each_method_with_no_speculation_at_the_same_batch():
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
        "| dflash | 1 | 2 / 2 | 4.0 | 4.0 |",
        "| dflash | 4 | 1 / 2 | 3.0 | 4.0 |",
        "| ddtree-B16 | 1 | 0 / 2 | 2.0 | 4.0 |",
    ]
    assert bench.greedy_agreement(rows, {}) == ""  # no T = 0 answers of none: no table

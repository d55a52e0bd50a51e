"""Host cost of structured output with DDTree: time in vLLM's `grammar_bitmask` per scheduler step, and acceptance,
for vLLM's DFlash chain and DDTree at a few budgets, on the e2e test's constrained prompts (SmolLM2 pair, greedy).

DDTree gives every tree node the grammar mask of its own path (vllm_ddtree/structured.py): one walk down the tree,
a fill, an accept and a rollback per node; the chain fills one mask and accepts one token per draft. Prints a table
and writes JSON.

    python scripts/bench_structured_output.py [--budgets 8 16 32 64] [--out docs/results/session-41/so_bench.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the scheduler in this process, to time it
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def timed_grammar_bitmask(times: list[float]):
    """Time every `grammar_bitmask` call into `times`; returns the method it wraps, to put back."""
    from vllm_ddtree.compat import StructuredOutputManager

    wrapped = StructuredOutputManager.grammar_bitmask

    def grammar_bitmask(self, *args, **kwargs):
        start = time.perf_counter()
        result = wrapped(self, *args, **kwargs)
        times.append(time.perf_counter() - start)
        return result

    StructuredOutputManager.grammar_bitmask = grammar_bitmask
    return wrapped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--out", default="docs/results/session-41/so_bench.json")
    args = parser.parse_args()

    import vllm_ddtree

    vllm_ddtree.register()  # the hooks first: the timer wraps DDTree's grammar_bitmask
    from transformers import AutoTokenizer

    from tests.e2e import test_structured_output as cases
    from tests.e2e.engine import run
    from vllm_ddtree.compat import StructuredOutputManager
    from vllm_ddtree.drafters import default_drafter_dir
    from vllm_ddtree.models.smollm2 import convert_smollm2

    target = str(convert_smollm2(Path.home() / ".cache/vllm-ddtree/SmolLM2-135M-Instruct-fp32", dtype="float32"))
    drafter = str(default_drafter_dir())
    tokenizer = AutoTokenizer.from_pretrained(target)
    constrained = [i for i, (_, constraint) in enumerate(cases.CASES) if constraint is not None]
    prompts = [cases.encode(tokenizer, cases.CASES[i][0]) for i in constrained]
    params = [cases.sampling_params(0.0)[i] for i in constrained]

    methods = [("dflash (15 tokens)", {"method": "dflash", "model": drafter, "num_speculative_tokens": cases.DEPTH})]
    methods += [(f"ddtree B={b}", {"method": "ddtree", "model": drafter, "num_speculative_tokens": b})
                for b in args.budgets]  # fmt: skip
    rows = []
    for name, spec in methods:
        times: list[float] = []
        wrapped = timed_grammar_bitmask(times)
        try:
            result = run(target, spec, prompts, params, **cases.ENGINE)
        finally:
            StructuredOutputManager.grammar_bitmask = wrapped
        rows.append({
            "method": name,
            "acceptance_length": round(result.acceptance_length, 3),
            "steps": len(times),
            "grammar_bitmask_ms_median": round(1e3 * statistics.median(times), 3),
            "grammar_bitmask_ms_mean": round(1e3 * statistics.fmean(times), 3),
            "grammar_bitmask_ms_max": round(1e3 * max(times), 3),
        })  # fmt: skip
        print(rows[-1], flush=True)

    print(f"\n{len(prompts)} constrained requests in one batch, greedy, {cases.MAX_TOKENS} tokens; ms per scheduler step")
    print("| method | acceptance | steps | grammar_bitmask median | mean | max |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(f"| {row['method']} | {row['acceptance_length']:.2f} | {row['steps']} | "
              f"{row['grammar_bitmask_ms_median']:.2f} | {row['grammar_bitmask_ms_mean']:.2f} | "
              f"{row['grammar_bitmask_ms_max']:.2f} |")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "prompts": len(prompts)}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

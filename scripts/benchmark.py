"""Benchmark: no speculation vs vLLM's DFlash chain vs DDTree, side by side in one run.

For each method one engine (same target, prompts and engine settings; CUDA graphs on unless --eager), then for
each temperature and batch size: run the prompts with `batch` requests in flight at a time, generate `--max-tokens`
tokens each, and record output tokens/s, time per output token, acceptance length and acceptance per depth (from
vLLM's spec-decode counters, differenced around the run). Writes JSON, a markdown table and PNG plots to --out.

    python scripts/benchmark.py --target DIR --drafter DIR [--budgets 8 16 32] [--batch-sizes 1 4 16 64]
        [--temperatures 0 1] [--max-tokens 128] [--load-format dummy] [--out bench-out]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import statistics
import time
from pathlib import Path

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def methods(
    drafter: str | None, block_size: int, budgets: list[int], schedules: list[str] = ()
) -> list[tuple[str, dict | None]]:
    out: list[tuple[str, dict | None]] = [("none", None)]
    if drafter:
        chain = {"method": "dflash", "model": drafter, "num_speculative_tokens": block_size - 1}
        out += [("dflash", chain), ("dflash-v1", chain)]  # -v1: on the V1 runner, DDTree's (see compat)
        for b in budgets:
            out.append((f"ddtree-B{b}", {"method": "ddtree", "model": drafter, "num_speculative_tokens": b}))
        for text in schedules:
            schedule = parse_schedule(text)
            out.append((f"ddtree-{text}", {"method": "ddtree", "model": drafter,
                                           "num_speculative_tokens": max(n for _, _, n in schedule),
                                           "num_speculative_tokens_per_batch_size": schedule}))  # fmt: skip
    return out


# DDTree's keys by method-name suffix, e.g. ddtree-B32-treeafter-hostlayout (Model Runner V2), ddtree-B15-chaintree.
SWITCH_SUFFIXES = {
    "-ingraph": ("tree_in_graph", True),  # the default since session 23 (named so in its commands)
    "-treeafter": ("tree_in_graph", False),  # the tree built after the drafter's pass
    "-layoutgraph": ("layout_in_graph", True),  # the default since session 35 (named so in its commands)
    "-hostlayout": ("layout_in_graph", False),  # each step laid out from the host (the default before session 35)
    # One token per depth: with B = block - 1 the tree is the chain's own drafts, verified by DDTree's path (same
    # acceptance as `dflash`, so speed and bf16 drift differences are the tree machinery's alone).
    "-chaintree": ("max_topk", 1),
}


def spec_of_name(name: str, by_name: dict[str, dict | None]):
    """The speculative config of a --methods name: a `methods` name, then (DDTree only) any SWITCH_SUFFIXES, then
    optionally a runner suffix (-v1 / -v2, `compat.model_runner_for`); KeyError (the class) for unknown names."""
    from vllm_ddtree.compat import method_without_runner

    base, switches = method_without_runner(name), {}
    while base.startswith("ddtree-") and base not in by_name:
        suffix = next((s for s in SWITCH_SUFFIXES if base.endswith(s) and SWITCH_SUFFIXES[s][0] not in switches), None)
        if suffix is None:
            break
        key, value = SWITCH_SUFFIXES[suffix]
        base, switches[key] = base.removesuffix(suffix), value
    spec = by_name.get(base, KeyError)
    return {**spec, **switches} if switches and spec is not KeyError else spec


def parse_cpus(text: str) -> set[int]:
    """"0-3,8" -> {0, 1, 2, 3, 8} (taskset's list form)."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def parse_schedule(text: str) -> list[list[int]]:
    """"1-4:64,5-64:16" -> [[1, 4, 64], [5, 64, 16]]: DDTree's budget per batch-size range
    (`num_speculative_tokens_per_batch_size`)."""
    schedule = []
    for part in text.split(","):
        sizes, nodes = part.split(":")
        first, last = sizes.split("-")
        schedule.append([int(first), int(last), int(nodes)])
    return schedule


def drafts_by_batch_size(spec: dict | None, max_num_seqs: int) -> list[int]:
    """[max_num_seqs + 1] drafts per request that vLLM's scheduler asks for at each request count (index 0 unused)."""
    from types import SimpleNamespace

    from vllm_ddtree.compat import drafts_by_batch_size as lookup

    if spec is None:
        return [0] * (max_num_seqs + 1)
    return lookup(SimpleNamespace(**{k: spec.get(k) for k in ("num_speculative_tokens",
                                                              "num_speculative_tokens_per_batch_size")}), max_num_seqs)


def capture_sizes(drafts: list[int], drafter_block: int = 0) -> list[int]:
    """CUDA-graph capture sizes under which every method's decode steps replay their graphs at every request count.

    - Every uniform step size r x (drafts[r] + 1), r = 1..max_num_seqs (`drafts_by_batch_size`). Model Runner V2
      replays a FULL graph for a uniform batch only if the smallest capture size at or above its token count is a
      multiple of the tokens per request (vLLM's V1 runner rounds the sizes so; V2 does not). With powers of two
      alone, DDTree's 65 or 17 tokens per request fell to piecewise graphs (tree attention eager between the
      pieces) whenever the request count was not a power of two: 3 requests of B = 64 are 195 tokens, whose bucket
      is 256 (session 17: DDTree at batches 4-64 ran at 0.4-0.7x of the chain, whose 16 tokens divide every power
      of two from 16 on).
    - Powers of two up to the largest decode step, for prefills (vLLM's default list stops at 512 tokens).
    - The drafter's largest step (block x max_num_seqs): its FULL graphs are uniform too.
    """
    max_num_seqs = len(drafts) - 1
    sizes = {r * (drafts[r] + 1) for r in range(1, max_num_seqs + 1)}
    largest = max(sizes)
    power = 1
    while power < largest:
        sizes.add(power)
        power *= 2
    sizes.add(power)
    if drafter_block:
        sizes.add(drafter_block * max_num_seqs)
    return sorted(sizes)


def counters(llm) -> dict:
    """A snapshot of this engine's spec-decode totals (`compat.spec_decode_tally`: per engine, also when several
    engines share the process, as with --interleave)."""
    from vllm_ddtree.compat import spec_decode_tally

    tally = spec_decode_tally(llm)
    return {**tally, "accepted_per_pos": list(tally["accepted_per_pos"])}


def generate_at_concurrency(llm, prompts: list, concurrency: int, params, timings: list | None = None) -> list:
    """Generate for every prompt with `concurrency` requests running at a time: an answer that ends is replaced by
    the next prompt at once (continuous batching, as a server under that load). Outputs in prompt order.

    Consecutive groups of `concurrency` prompts (this script until session 21) let each group drain to its longest
    answer, so a row's figure hung on how the few long answers fell into groups: at T = 1, where every method samples
    other answers, that moved a row by more than the methods differ (session 21, batch 4).

    `timings`, if given, receives [output tokens, ms from submission to the finished output] for every request."""
    engine = llm.llm_engine
    queue = list(enumerate(prompts))[::-1]  # pop() takes the next prompt
    index_of, submitted, outputs = {}, {}, [None] * len(prompts)

    def submit() -> None:
        index, prompt = queue.pop()
        request_id = f"bench-{next(_REQUEST_IDS)}"  # outputs carry this id (vLLM keeps its own suffixed copy inside)
        submitted[request_id] = time.perf_counter()
        engine.add_request(request_id, prompt, params)
        index_of[request_id] = index

    while queue and len(index_of) < concurrency:
        submit()
    while index_of:
        for output in engine.step():
            if output.finished:
                outputs[index_of.pop(output.request_id)] = output
                if timings is not None:
                    ms = (time.perf_counter() - submitted.pop(output.request_id)) * 1e3
                    timings.append([len(output.outputs[0].token_ids), round(ms, 3)])
                if queue:
                    submit()
    return outputs


def request_cost_fit(timings: list[list[float]]) -> dict | None:
    """Least squares of a request's wall time on its output tokens, for requests that ran alone (batch 1):
    `fixed_ms` is what a request costs besides its decode steps (tokenization, prefill, the first draft, output),
    `ms_per_token` what each output token adds. A step figure (seconds / steps) mixes the two, and a method that
    takes fewer steps per answer carries its fixed cost over fewer of them."""
    if len(timings) < 3:
        return None
    tokens = [t for t, _ in timings]
    mean_t, mean_ms = statistics.fmean(tokens), statistics.fmean(ms for _, ms in timings)
    spread = sum((t - mean_t) ** 2 for t in tokens)
    if spread == 0:
        return None  # every answer as long: the two parts cannot be told apart
    slope = sum((t - mean_t) * (ms - mean_ms) for t, ms in timings) / spread
    return {"fixed_ms": mean_ms - slope * mean_t, "ms_per_token": slope, "requests": len(timings)}


_REQUEST_IDS = itertools.count()


def measure(
    llm, prompts, batch: int, temperature: float, max_tokens: int, seed: int, ignore_eos: bool = True,
    min_seconds: float = 0.0,
) -> dict:
    """Generate for ``prompts`` with ``batch`` requests running at a time (`generate_at_concurrency`); time it. The
    same prompts run again (same seeds, so the same answers) until ``min_seconds`` have passed: session 21's rows of
    0.5-1.3 s (batches 16 and 64) differed by up to 43% between two runs."""
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=temperature, max_tokens=max_tokens, ignore_eos=ignore_eos, seed=seed, detokenize=False
    )
    before = counters(llm)
    timings = [] if batch == 1 else None  # requests that run alone: `request_cost_fit`
    start = time.perf_counter()
    outputs = generate_at_concurrency(llm, prompts, batch, params, timings)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    passes = 1
    while time.perf_counter() - start < min_seconds:
        tokens += sum(len(o.outputs[0].token_ids)
                      for o in generate_at_concurrency(llm, prompts, batch, params, timings))  # fmt: skip
        passes += 1
    seconds = time.perf_counter() - start
    after = counters(llm)
    drafts, accepted = after["drafts"] - before["drafts"], after["accepted"] - before["accepted"]
    per_pos = after["accepted_per_pos"]
    per_pos = [a - b for a, b in zip(per_pos, before["accepted_per_pos"] + [0] * len(per_pos))]
    return {
        **speed_and_acceptance(tokens, seconds, batch, drafts, accepted, per_pos),
        "passes": passes,
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],  # [prompts][tokens], the first pass
        **({"request_times": timings} if timings else {}),  # [tokens, ms] per request, batch 1 only
    }


def speed_and_acceptance(tokens: int, seconds: float, batch: int, drafts: float, accepted: float,
                         per_pos: list[float]) -> dict:  # fmt: skip
    """A row's figures from its totals (kept in the row, so that rounds of one row add up: `combine_rounds`)."""
    return {
        "output_tokens": tokens,
        "seconds": seconds,
        "output_tokens_per_s": tokens / seconds,
        "ms_per_output_token": 1000 * seconds * batch / tokens,  # per request: `batch` requests run together
        "drafts": drafts,
        "accepted": accepted,
        "accepted_per_pos": per_pos,
        "acceptance_length": 1 + accepted / drafts if drafts else None,
        "acceptance_per_depth": [round(x / drafts, 4) for x in per_pos] if drafts else None,
    }


def rotated(items: list, shift: int) -> list:
    """`items` starting at index `shift` (mod its length): each round of an interleaved run starts with another
    method, so no method always runs first or right after the same one."""
    shift %= max(len(items), 1)
    return items[shift:] + items[:shift]


def round_order(engines: list, temperatures: list, batch_sizes: list, round_index: int) -> list[tuple]:
    """(temperature, batch, engine) in the order round `round_index` of an interleaved run measures them: the rows
    rotated by one each round, so no row always opens a round (right after the previous round's largest rows and the
    results' writing), and within each row the engines rotated, so no method always runs first."""
    rows = [(temperature, batch) for temperature in temperatures for batch in batch_sizes]
    return [(temperature, batch, engine) for temperature, batch in rotated(rows, round_index)
            for engine in rotated(engines, round_index)]  # fmt: skip


def combine_rounds(rows: list[dict]) -> list[dict]:
    """One row per (run, method, temperature, batch) from the rows of every round of that run (`run`: one
    benchmark.py invocation; rows of other runs, from --resume or --plot-from, stay apart): tokens, seconds and
    spec-decode counts added up (tok/s = all tokens / all seconds), each round's tok/s and host probe kept.
    Rows from before the rounds (no `run`, no raw counts) count tokens and seconds only."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r.get("run"), r["method"], r["temperature"], r["batch"]), []).append(r)
    combined = []
    for group in groups.values():
        first = group[0]
        counted = all("accepted_per_pos" in r for r in group)
        if len(group) == 1:
            totals = {}  # the row's own figures
        elif counted:
            per_pos = [sum(values) for values in zip(*(r["accepted_per_pos"] for r in group))]
            totals = speed_and_acceptance(
                sum(r["output_tokens"] for r in group), sum(r["seconds"] for r in group), first["batch"],
                sum(r["drafts"] for r in group), sum(r["accepted"] for r in group), per_pos,
            )  # fmt: skip
        else:
            totals = speed_and_acceptance(sum(r["output_tokens"] for r in group), sum(r["seconds"] for r in group),
                                          first["batch"], 0, 0, [])  # fmt: skip
        request_times = [t for r in group for t in r.get("request_times", [])]
        combined.append({**{k: v for k, v in first.items() if k not in ("round", "host_probe_ms")}, **totals,
                         "passes": sum(r.get("passes", 1) for r in group), "rounds": len(group),
                         "round_tokens_per_s": [r["output_tokens_per_s"] for r in group],
                         "round_host_probe_ms": [r.get("host_probe_ms") for r in group],
                         **({"request_times": request_times, "request_cost": request_cost_fit(request_times)}
                            if request_times else {})})  # fmt: skip
    return combined


def request_cost_table(rows: list[dict]) -> str:
    """Markdown: batch-1 rows' `request_cost` (fixed ms per request, ms per output token), beside the mean answer."""
    lines = ["| method | temperature | requests | fixed ms per request | ms per output token | mean tokens |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in rows:
        fit = r.get("request_cost")
        if fit:
            mean = statistics.fmean(t for t, _ in r["request_times"])
            lines.append(f"| {r['method']} | {r['temperature']} | {fit['requests']} | {fit['fixed_ms']:.1f} | "
                         f"{fit['ms_per_token']:.3f} | {mean:.0f} |")  # fmt: skip
    return "\n".join(lines) if len(lines) > 2 else ""


def round_ratios(rows: list[dict], baselines: tuple[str, ...] = ("dflash", "none")) -> str:
    """Markdown: per temperature and batch, each method's tok/s over each baseline's (the chain, no speculation)
    within every round of one run, where the two ran minutes apart at most: the median and the range over the
    rounds. The device machines' host speed drifted by up to 2x between engines run one after the other (session
    22), so only ratios taken within a round are trusted."""
    speed = {(r["method"], r["temperature"], r["batch"], r.get("run"), r.get("round", 0)): r["output_tokens_per_s"]
             for r in rows}  # fmt: skip
    present = [b for b in baselines if any(key[0] == b for key in speed)]
    lines = ["| method | temperature | batch | " + " | ".join(f"vs {b}: median (range)" for b in present) + " |",
             "| --- | --- | --- |" + " --- |" * len(present)]  # fmt: skip
    for method in dict.fromkeys(key[0] for key in speed):
        cells = {}
        for temperature, batch in sorted({(t, b) for m, t, b, *_ in speed if m == method}):
            row = []
            for base in present:
                ratios = sorted(v / speed[base, t, b, run, n] for (m, t, b, run, n), v in speed.items()
                                if (m, t, b) == (method, temperature, batch)
                                and (base, t, b, run, n) in speed)  # fmt: skip
                row.append(f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f}, {len(ratios)} "
                           "rounds)" if ratios and base != method else "-")  # fmt: skip
            cells[temperature, batch] = row
        if all(c == "-" for row in cells.values() for c in row):
            continue  # the last baseline itself: nothing to compare it with
        for (temperature, batch), row in cells.items():
            lines.append(f"| {method} | {temperature} | {batch} | " + " | ".join(row) + " |")
    return "\n".join(lines) if present and len(lines) > 2 else ""


def fastest_by_batch(rows: list[dict]) -> str:
    """Markdown: per temperature and batch size, the fastest method and the best DDTree budget, against the chain
    and no speculation: where a smaller budget wins at larger batches (the input for choosing it automatically)."""
    lines = ["| temperature | batch | fastest | best DDTree | its tok/s vs dflash | vs none |",
             "| --- | --- | --- | --- | --- | --- |"]
    for temperature, batch in sorted({(r["temperature"], r["batch"]) for r in rows}):
        here = [r for r in rows if (r["temperature"], r["batch"]) == (temperature, batch)]
        same = {r["method"]: r["output_tokens_per_s"] for r in here}
        trees = {m: v for m, v in same.items() if m.startswith("ddtree")}
        if not trees:
            continue
        best_tree = max(trees, key=trees.get)

        def versus(base: str) -> str:
            return f"{trees[best_tree] / same[base]:.2f}x" if base in same else "-"

        lines.append(f"| {temperature} | {batch} | {max(same, key=same.get)} | {best_tree} | {versus('dflash')} | "
                     f"{versus('none')} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def suggested_schedules(rows: list[dict]) -> str:
    """Markdown: per temperature, the tree size per batch size that the fixed-budget rows (`ddtree-B<n>`) measured
    fastest, as vLLM's `num_speculative_tokens_per_batch_size` and in `--schedules` form (to benchmark it next).
    A measured batch size stands for the sizes up to the geometric midpoint to the next one; past the largest,
    vLLM carries the last range's budget."""
    fixed = re.compile(r"ddtree-B(\d+)$")
    lines = ["| temperature | --schedules | num_speculative_tokens_per_batch_size |", "| --- | --- | --- |"]
    for temperature in sorted({r["temperature"] for r in rows}):
        speed = {(r["batch"], int(m.group(1))): r["output_tokens_per_s"]
                 for r in rows if r["temperature"] == temperature and (m := fixed.match(r["method"]))}
        batches = sorted({b for b, _ in speed})
        if not batches:
            continue
        schedule: list[list[int]] = []
        for i, batch in enumerate(batches):
            best = max((n for b, n in speed if b == batch), key=lambda n: speed[batch, n])
            first = schedule[-1][1] + 1 if schedule else 1
            last = math.isqrt(batch * batches[i + 1]) if i + 1 < len(batches) else batch
            if schedule and schedule[-1][2] == best:
                schedule[-1][1] = last  # the same budget as the range before: one range
            else:
                schedule.append([first, last, best])
        text = ",".join(f"{first}-{last}:{n}" for first, last, n in schedule)
        lines.append(f"| {temperature} | `{text}` | `{json.dumps(schedule)}` |")
    return "\n".join(lines) if len(lines) > 2 else ""


def greedy_agreement(rows: list[dict], tokens: dict[str, list[list[int]]]) -> str:
    """Markdown: at T = 0, how far each speculative method's answers stay identical to no speculation's and to the
    chain's (same prompts, same batch): prompts identical to the end, and the mean index of the first differing
    token. In bf16 every speculative method computes its verified rows with other kernels than one-token decoding,
    so near-tied argmaxes may flip; DDTree should drift no more than vLLM's chain (issue 3). Against the chain,
    `-chaintree` (the chain's own drafts through DDTree's path) isolates DDTree's kernels."""
    lines = ["| method | against | batch | identical prompts | mean first difference (tokens) | mean answer length |",
             "| --- | --- | --- | --- | --- | --- |"]
    for baseline in ("none", "dflash"):
        for r in rows:
            base = tokens.get(greedy_key(baseline, r["batch"]))
            ours = tokens.get(greedy_key(r["method"], r["batch"]))
            if r["temperature"] != 0 or r["method"] in ("none", baseline) or base is None or ours is None:
                continue
            firsts = [first_difference(a, b) for a, b in zip(ours, base)]
            same = sum(a == b for a, b in zip(ours, base))
            lines.append(f"| {r['method']} | {baseline} | {r['batch']} | {same} / {len(base)} | "
                         f"{sum(firsts) / len(firsts):.1f} | {sum(map(len, base)) / len(base):.1f} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def first_difference(a: list[int], b: list[int]) -> int:
    """Index of the first token where two answers differ (the shorter one's length if one extends the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def greedy_key(method: str, batch: int) -> str:
    return f"{method}|batch{batch}"


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| method | temperature | batch | tok/s | ms/token | acceptance length | speedup vs none | vs dflash "
        "| vs dflash-v1 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    def ratio(r: dict, method: str) -> str:
        base = [b for b in rows if b["method"] == method and (b["temperature"], b["batch"]) == (r["temperature"], r["batch"])]
        return f"{r['output_tokens_per_s'] / base[0]['output_tokens_per_s']:.2f}x" if base else "-"

    for r in rows:
        acc = "-" if r["acceptance_length"] is None else f"{r['acceptance_length']:.2f}"
        lines.append(
            f"| {r['method']} | {r['temperature']} | {r['batch']} | {r['output_tokens_per_s']:.1f} | "
            f"{r['ms_per_output_token']:.2f} | {acc} | {ratio(r, 'none')} | {ratio(r, 'dflash')} | "
            f"{ratio(r, 'dflash-v1')} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if not getattr(plot, "warned", False):
            plot.warned = True
            print("matplotlib is not installed: no plots")
        return
    methods = list(dict.fromkeys(r["method"] for r in rows))
    colors = {m: f"C{i % 10}" for i, m in enumerate(methods)}  # one color per method in both panels
    for temperature in sorted({r["temperature"] for r in rows}):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for method in methods:
            sel = [r for r in rows if r["method"] == method and r["temperature"] == temperature]
            if not sel:  # e.g. a run cut before this temperature's rows of the method
                continue
            batches = [r["batch"] for r in sel]
            style = dict(marker="o", label=method, color=colors[method])
            axes[0].plot(batches, [r["output_tokens_per_s"] for r in sel], **style)
            if sel[0]["acceptance_length"] is not None:
                axes[1].plot(batches, [r["acceptance_length"] for r in sel], **style)
        axes[0].set(xscale="log", xlabel="batch size", ylabel="output tokens/s", title=f"throughput, T={temperature}")
        axes[1].set(xscale="log", xlabel="batch size", ylabel="acceptance length", title="acceptance length")
        for ax in axes:
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / f"throughput_T{temperature}.png", dpi=120)
        plt.close(fig)


def prompts_per_row(batch: int, args) -> int:
    """Prompts a row of `batch` requests in flight runs: `batch` x --prompts-per-batch, at least --min-prompts.
    With as many prompts as requests in flight, every request starts at once and the batch drains as answers end;
    with more, a finished answer's place goes to the next prompt, so the row runs at `batch` most of the time."""
    return max(batch * args.prompts_per_batch, args.min_prompts)


def load_prompts(args, tokenizer) -> list:
    n = max(prompts_per_row(b, args) for b in args.batch_sizes)
    if args.load_format == "dummy":  # random weights: random token ids will do
        import random

        from vllm.inputs import TokensPrompt

        rng = random.Random(0)
        return [TokensPrompt(prompt_token_ids=[rng.randrange(1000, 30000) for _ in range(128)]) for _ in range(n)]
    if args.prompts_file:
        texts = json.loads(Path(args.prompts_file).read_text())
    else:
        from vllm_ddtree.drafter.data import SOURCES, heldout_prompts

        by_source = [heldout_prompts(source, limit=n) for source in SOURCES]  # interleaved: every batch mixes them
        texts = [p.text for group in itertools.zip_longest(*by_source) for p in group if p is not None]
    texts = (texts * (n // len(texts) + 1))[:n]
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return [
            tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
            for t in texts
        ]
    return texts


def main() -> None:
    from tqdm import tqdm

    from vllm_ddtree.compat import shutdown_llm

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", help="Hugging Face folder of the target (required unless --plot-from)")
    parser.add_argument("--drafter", default=None)
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--schedules", nargs="+", default=[], metavar="RANGES",
                        help="DDTree budgets per batch size (num_speculative_tokens_per_batch_size), each as "
                             "'1-4:64,5-64:16'; runs as method ddtree-<RANGES>")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--load-format", default="auto", help="'dummy' for timing without weights")
    parser.add_argument("--prompts-file", default=None, help="JSON list of prompt strings")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs / torch.compile")
    parser.add_argument("--stop-at-eos", action="store_true", help="end answers at EOS (default: fixed length)")
    parser.add_argument("--methods", nargs="+", default=None,
                        help="method names to run, in this order (none, dflash, dflash-v1, ddtree-B<budget>, "
                             "ddtree-<RANGES> of --schedules; a -v2 suffix runs DDTree on Model Runner V2, e.g. "
                             "ddtree-B32-v2)")
    parser.add_argument("--min-prompts", type=int, default=16,
                        help="prompts per measurement at least, `batch` of them in flight at a time")
    parser.add_argument("--prompts-per-batch", type=int, default=1,
                        help="a row runs batch x this many prompts (at least --min-prompts): above 1, the batch "
                             "stays full while prompts are left instead of draining from the start")
    parser.add_argument("--min-row-seconds", type=float, default=0.0,
                        help="run a measurement's prompts again (the same answers) until this long has passed")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                        help="for each engine; with --interleave, for all of them together (an equal share each)")
    parser.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                        help="start every method's engine (one after another) before measuring, then measure "
                             "each row for all methods in turn, ROUNDS times (see run_interleaved); needs "
                             "engine-core processes "
                             "(VLLM_ENABLE_V1_MULTIPROCESSING unset or 1)")
    parser.add_argument("--cpus", default=None, metavar="LIST",
                        help="run this process and its engines on these CPU cores only, e.g. '0-7' or '0,2,4'")
    parser.add_argument("--cudagraph-capture-sizes", type=int, nargs="+", default=None,
                        help="token counts CUDA graphs are captured for (default: every request count's decode step "
                             "of each method, and powers of two; see capture_sizes)")
    parser.add_argument("--resume", action="store_true", help="keep --out's results.json and skip methods it has")
    parser.add_argument("--plot-from", nargs="+", default=None, metavar="RESULTS_JSON",
                        help="no engines: merge the rows of earlier results.json files into --out's table and plots")
    parser.add_argument("--out", default="bench-out")
    args = parser.parse_args()
    if args.plot_from:
        saved = [json.loads(Path(path).read_text()) for path in args.plot_from]
        rows = [{"run": path, **r} for path, results in zip(args.plot_from, saved)
                for r in results.get("round_rows", results["rows"])]  # files without run ids: one run each
        greedy = [Path(path).with_name(GREEDY_TOKENS) for path in args.plot_from]
        greedy_tokens = {k: v for path in greedy if path.is_file() for k, v in json.loads(path.read_text()).items()}
        Path(args.out).mkdir(parents=True, exist_ok=True)
        write_results(Path(args.out), args, rows, greedy_tokens)
        print(markdown_table(combine_rounds(rows)))
        return
    if not args.target:
        parser.error("--target is required (or --plot-from)")
    args.run_id = time.strftime("%Y%m%dT%H%M%S")  # rows of this invocation: rounds combine and compare within it
    if args.cpus:
        os.sched_setaffinity(0, parse_cpus(args.cpus))  # engine-core processes started later inherit it
    if args.interleave and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0":
        parser.error("--interleave keeps several engines at once, each in its own engine-core process: unset "
                     "VLLM_ENABLE_V1_MULTIPROCESSING=0 (in-process engines share one CUDA-graph pool)")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    block_size = json.loads((Path(args.drafter) / "config.json").read_text())["block_size"] if args.drafter else 0
    plan = methods(args.drafter, block_size, args.budgets, args.schedules)
    if args.methods:  # in the order asked for (a call cut by its time limit keeps the first ones)
        by_name = dict(plan)
        unknown = [m for m in args.methods if spec_of_name(m, by_name) is KeyError]
        if unknown:
            switches = ", ".join(f"{suffix} ({key}={value})" for suffix, (key, value) in SWITCH_SUFFIXES.items())
            parser.error(f"unknown --methods {unknown}; known: {list(by_name)}; DDTree's take the suffixes "
                         f"{switches} (speculative-config switches), then all take an optional -v1 / -v2 for the "
                         "model runner (budgets come from --budgets)")
        plan = [(m, spec_of_name(m, by_name)) for m in args.methods]
    rows: list[dict] = []  # one per (method, temperature, batch, round)
    greedy_tokens: dict[str, list[list[int]]] = {}  # T = 0 answers by greedy_key, for `greedy_agreement`
    if args.resume and (out / "results.json").is_file():
        saved = json.loads((out / "results.json").read_text())
        rows = saved.get("round_rows", saved["rows"])
        if (out / GREEDY_TOKENS).is_file():
            greedy_tokens = json.loads((out / GREEDY_TOKENS).read_text())
        plan = [m for m in plan if m[0] not in {r["method"] for r in rows}]
    rounds = max(args.interleave, 1)
    progress = tqdm(total=len(plan) * len(args.temperatures) * len(args.batch_sizes) * rounds, desc="benchmark")
    if args.interleave:
        run_interleaved(plan, args, block_size, out, rows, greedy_tokens, progress)
    else:
        prompts = None
        for name, spec in plan:
            llm, init_s = start_engine(name, spec, args, block_size, args.gpu_memory_utilization)
            prompts = prompts or load_prompts(args, llm.get_tokenizer() if args.load_format != "dummy" else None)
            warm_up(llm, prompts, args)
            for temperature in args.temperatures:
                for batch in args.batch_sizes:
                    rows.append(measure_row(llm, name, init_s, prompts, temperature, batch, args, greedy_tokens))
                    show_progress(progress, rows[-1])
            shutdown_llm(llm)  # its GPU memory goes back before the next method's engine starts
            del llm
            write_results(out, args, rows, greedy_tokens)  # after every method: a run cut short keeps what it measured
    progress.close()
    combined = combine_rounds(rows)
    print(markdown_table(combined))
    print(greedy_agreement(combined, greedy_tokens))
    if args.interleave:
        print(round_ratios(rows))


def start_engine(name: str, spec: dict | None, args, block_size: int, memory_utilization: float):
    """(LLM, seconds it took to start) for one method, with the run's engine settings."""
    from vllm import LLM

    from vllm_ddtree.compat import model_runner_for

    start = time.perf_counter()
    # At least 16: vLLM 0.26's Model Runner V2 (no speculation, the chain) hit an illegal memory access in
    # CUDA-graph capture with max_num_seqs = 1 (H200, 2026-11-30); 16 ran in session 12.
    max_num_seqs = max(*args.batch_sizes, 16)
    draft_slots = (spec["num_speculative_tokens"] + 2) if spec else 0
    drafts = drafts_by_batch_size(spec, max_num_seqs)
    graph_sizes = args.cudagraph_capture_sizes or capture_sizes(drafts, block_size)
    with model_runner_for(name):
        llm = LLM(
            model=args.target, speculative_config=spec, dtype=args.dtype, max_model_len=args.max_model_len,
            load_format=args.load_format, enforce_eager=args.eager, disable_log_stats=False,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=8192 + max_num_seqs * draft_slots,
            gpu_memory_utilization=memory_utilization, seed=0,
            skip_tokenizer_init=args.load_format == "dummy",
            compilation_config=None if args.eager else {"cudagraph_capture_sizes": graph_sizes},
        )
    return llm, time.perf_counter() - start


def warm_up(llm, prompts: list, args) -> None:
    """Warm-up at every measured batch size and temperature, and at every request count up to the largest (a batch
    shrinks through all of them as answers end at EOS): first-time work (Triton compiles for a new shape, lazily
    built sampling paths) must not land in the timed runs (seen on the H200 in session 12: DDTree B=16 at T=0,
    batch 16, the first batch-16 run, took 1.7x longer than at T=1; session 18: vLLM's JIT monitor saw DDTree's
    kernels compile after the engine's own warm-up)."""
    for temperature in args.temperatures:
        for batch in args.batch_sizes:
            measure(llm, prompts[:batch], batch, temperature, 32, seed=0)
        for count in range(1, max(args.batch_sizes) + 1):
            measure(llm, prompts[:count], count, temperature, 8, seed=0)


def measure_row(llm, name: str, init_s: float, prompts: list, temperature: float, batch: int, args,
                greedy_tokens: dict, round_index: int = 0) -> dict:  # fmt: skip
    """One row: `batch` requests in flight over at least --min-prompts prompts (`measure`); the T = 0 answers of
    the first round go into `greedy_tokens`."""
    group = prompts[: prompts_per_row(batch, args)]
    probe_ms = host_probe_ms()
    result = measure(llm, group, batch, temperature, args.max_tokens, 1, not args.stop_at_eos, args.min_row_seconds)
    token_ids = result.pop("token_ids")
    if temperature == 0 and round_index == 0:
        greedy_tokens[greedy_key(name, batch)] = token_ids
    return {"method": name, "temperature": temperature, "batch": batch, "prompts": len(group), "init_s": init_s,
            "run": args.run_id, "round": round_index, "host_probe_ms": [probe_ms, host_probe_ms()],
            **result}  # fmt: skip


def host_probe_ms() -> float:
    """Milliseconds this process takes for a fixed piece of pure-Python work (~1 ms on the H200 machines' hosts),
    taken before and after every row: how fast the host ran around it. The H200 machines' host speed drifts by
    up to ~2x (session 22), which a small model's host-bound decode steps follow."""
    start = time.perf_counter()
    total = 0
    for i in range(20000):
        total += i * i
    return (time.perf_counter() - start) * 1e3


def show_progress(progress, row: dict) -> None:
    progress.update()
    progress.set_postfix(method=row["method"], T=row["temperature"], batch=row["batch"],
                         tok_s=round(row["output_tokens_per_s"], 1))  # fmt: skip


def run_interleaved(plan: list, args, block_size: int, out: Path, rows: list, greedy_tokens: dict, progress) -> None:
    """--interleave ROUNDS: every method's engine is started first (each in its own engine-core process, with an
    equal share of --gpu-memory-utilization), then each round measures every (temperature, batch) row for all
    methods one after the other, the rows' and the methods' order rotated from round to round (`round_order`).
    Methods are then compared within minutes of each other, not one engine's lifetime apart: on the H200 machines
    the host ran one engine's whole profile at half the speed of the engine before it (session 22), which no later
    engine could undo."""
    from vllm_ddtree.compat import shutdown_llm

    if not plan:
        return  # --resume: every method is measured already
    engines = []
    try:
        for name, spec in plan:
            llm, init_s = start_engine(name, spec, args, block_size, args.gpu_memory_utilization / len(plan))
            engines.append((name, llm, init_s))
        prompts = load_prompts(args, engines[0][1].get_tokenizer() if args.load_format != "dummy" else None)
        for _, llm, _ in engines:
            warm_up(llm, prompts, args)
        for round_index in range(args.interleave):
            order = round_order(engines, args.temperatures, args.batch_sizes, round_index)
            for i, (temperature, batch, (name, llm, init_s)) in enumerate(order, 1):
                rows.append(measure_row(llm, name, init_s, prompts, temperature, batch, args, greedy_tokens,
                                        round_index))  # fmt: skip
                show_progress(progress, rows[-1])
                if i % len(engines) == 0:  # a row done for every method: a run cut short keeps it (session 25's
                    # first round alone made it into results.json, 12 rows of its second only into the log)
                    write_results(out, args, rows, greedy_tokens, plots=i == len(order))
    finally:
        for _, llm, _ in engines:
            shutdown_llm(llm)


GREEDY_TOKENS = "greedy_tokens.json"


def write_results(out: Path, args, round_rows: list[dict], greedy_tokens: dict | None = None,
                  plots: bool = True) -> None:  # fmt: skip
    """results.json (`rows`: one per method, temperature and batch, its rounds combined; `round_rows`: as measured),
    table.md (with each round's ratios to the chain when the run had rounds), greedy_tokens.json, the plots unless
    `plots` is false (so a run cut by its time limit keeps them too: session 23's was, and wrote none)."""
    switches = {k: v for k, v in os.environ.items() if k.startswith("VLLM_DDTREE_")}  # e.g. VLLM_DDTREE_BACKEND_ROWS
    setup = {**vars(args), "environment": switches}
    rows = combine_rounds(round_rows)
    (out / "results.json").write_text(json.dumps({"setup": setup, "rows": rows, "round_rows": round_rows}, indent=2))
    table = markdown_table(rows) + "\n"
    interleaved = getattr(args, "interleave", 0) or any(r.get("round", 0) for r in round_rows)
    ratios = round_ratios(round_rows) if interleaved else ""
    table += f"\nWithin each round, tok/s over the baselines':\n\n{ratios}\n" if ratios else ""
    costs = request_cost_table(rows)
    if costs:
        table += f"\nBatch 1, one request at a time: wall time = fixed + per output token (least squares):\n\n{costs}\n"
    fastest = fastest_by_batch(rows)
    table += f"\nFastest per temperature and batch:\n\n{fastest}\n" if fastest else ""
    schedules = suggested_schedules(rows)
    if schedules:
        table += f"\nDDTree budget per batch size, fastest measured (fixed budgets only):\n\n{schedules}\n"
    if greedy_tokens:
        (out / GREEDY_TOKENS).write_text(json.dumps(greedy_tokens))
        agreement = greedy_agreement(rows, greedy_tokens)
        table += f"\nT = 0 answers against no speculation's and the chain's:\n\n{agreement}\n" if agreement else ""
    (out / "table.md").write_text(table)
    if plots:
        plot(rows, out)


if __name__ == "__main__":
    main()

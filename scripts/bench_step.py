"""Per-step decode time at Qwen3-8B shape (dummy weights): no speculation vs in-tree DFlash vs DDTree.

One engine per method (engine start dominates: ~1-3 min each at this size), reused for every batch size; several
methods run one process each. With dummy weights acceptance is ~0, so every step is one draft + one verification
of B + 1 tokens per request: the cost the method adds per step. Per-step time = (time to generate 1 + S tokens -
time to generate 1 token) / steps, steps counted from vLLM's spec-decode metrics (S for no speculation). For
DDTree and the V2 chain (`dflash`) a second, profiled pass (VLLM_DDTREE_PROFILE, one sync per step) gives the
per-phase breakdown, the chain's with the same phase names where the two share a phase.

    python scripts/bench_step.py --methods none,dflash --out /tmp/step.json
    python scripts/bench_step.py --methods ddtree --out /tmp/step.json   # merges into the same file
    python scripts/bench_step.py --target T --drafter D --methods none,dflash,dflash-v1,ddtree --torch-profile

`ddtree` and `dflash` run on the model runner vLLM picks (Model Runner V2 on vLLM 0.26's GPU build); `dflash-v1` and
`ddtree-v1` force the V1 runner, `ddtree-v2` forces V2 (VLLM_DDTREE_RUNNER), so a ratio can be split into runner
and tree costs. `--torch-profile` also prints the GPU time per step of DDTree's bookkeeping kernels.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: the profiler switch is an env var
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "vocab_size": 151936, "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
    "torch_dtype": "bfloat16", "attention_bias": False,
}  # fmt: skip
DRAFTER_LAYERS = 5
DRAFT_BLOCK = 16


def write_models(root: Path) -> tuple[str, str]:
    target, drafter = root / "qwen3-8b-shape", root / "dflash-qwen3-8b-shape"
    for folder, config in (
        (target, QWEN3_8B),
        (drafter, {
            **QWEN3_8B, "architectures": ["DFlashDraftModel"], "num_hidden_layers": DRAFTER_LAYERS,
            "block_size": DRAFT_BLOCK, "num_target_layers": 36,
            "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
        }),
    ):  # fmt: skip
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config, indent=1))
    return str(target), str(drafter)


def benchmark_script():
    """scripts/benchmark.py, this script's neighbour: capture sizes and method names come from there."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import benchmark

    return benchmark


def spec_for(method: str, drafter: str, budget: int, chain_tokens: int | None = None):
    """A method name's speculative config: `none`, `dflash` or `ddtree`, DDTree's with `benchmark.py`'s switch
    suffixes (`ddtree-ingraph-layoutgraph`), all with an optional "-v1" / "-v2" suffix that only picks the model
    runner (`compat.model_runner_for`). DDTree gets the node budget, the chain `chain_tokens` drafts (default: the
    budget)."""
    spec_of_name = benchmark_script().spec_of_name
    chain_drafts = budget if chain_tokens is None else chain_tokens
    chain = {"method": "dflash", "model": drafter, "num_speculative_tokens": chain_drafts}
    ddtree = {"method": "ddtree", "model": drafter, "num_speculative_tokens": budget}
    spec = spec_of_name(method, {"none": None, "dflash": chain, "ddtree": ddtree})
    if spec is KeyError:
        raise ValueError(f"unknown method {method!r}: none, dflash or ddtree (+ benchmark.SWITCH_SUFFIXES), + -v1/-v2")
    return spec


def num_drafts(llm) -> int:
    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_drafts":
            return int(getattr(metric, "value", 0))
    return 0


def timed_generate(llm, prompts, max_tokens: int) -> tuple[float, int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    drafts = num_drafts(llm)
    start = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, num_drafts(llm) - drafts


def random_prompts(rng, batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(100, vocab) for _ in range(prompt_len)] for _ in range(batch)]


def measure(llm, method: str, batch: int, prompt_len: int, steps: int, repeats: int, vocab: int) -> dict:
    import random

    rng = random.Random(batch)
    per_step = []
    for r in range(repeats + 1):  # the first round warms up this batch size
        prompts = random_prompts(rng, batch, prompt_len, vocab)
        t_prefill, _ = timed_generate(llm, prompts, 1)
        prompts = random_prompts(rng, batch, prompt_len, vocab)
        t_all, drafts = timed_generate(llm, prompts, 1 + steps)
        num_steps = decode_steps(method, batch, steps, drafts)
        if r:
            per_step.append((t_all - t_prefill) / num_steps * 1e3)
    return {
        "method": method, "batch": batch, "prompt_len": prompt_len, "decode_tokens": steps,
        "step_ms_median": statistics.median(per_step), "step_ms_all": per_step,
        "steps_per_run": num_steps, "accepted_per_step": steps / num_steps - 1,
    }  # fmt: skip


def decode_steps(method: str, batch: int, tokens: int, drafts: int) -> float:
    """Decode steps of a run of `tokens` decode tokens per request: one per token without speculation, else one per
    draft (vLLM counts one draft per request and step)."""
    return tokens if method == "none" else max(drafts / batch, 1)


def profile_pass(llm, batch: int, prompt_len: int, steps: int, path: Path) -> dict:
    os.environ["VLLM_DDTREE_PROFILE"] = str(path)
    try:
        timed_generate(llm, [[7 + i] * prompt_len for i in range(batch)], 1 + steps)
    finally:
        del os.environ["VLLM_DDTREE_PROFILE"]
        timed_generate(llm, [[5] * 8], 2)  # a step with the switch off flushes the profile file
    return json.loads(path.read_text()) if path.exists() else {}


def graph_capture_sizes(spec: dict | None, max_num_seqs: int, drafter: str | None) -> list[int]:
    """`benchmark.py`'s capture sizes, so every uniform verification step replays a FULL graph. Powers of two alone
    left a batch-1 step of B = 64 (65 tokens, bucket 128) piecewise with tree attention eager: session 21's batch-1
    profile ran 23 of its 24 DDTree steps so (11 ms a step)."""
    benchmark = benchmark_script()
    capture_sizes, drafts_by_batch_size = benchmark.capture_sizes, benchmark.drafts_by_batch_size

    block_size = 0  # no drafter graphs without speculation
    if spec is not None and drafter is not None:
        block_size = json.loads((Path(drafter) / "config.json").read_text())["block_size"]
    return capture_sizes(drafts_by_batch_size(spec, max_num_seqs), block_size)


def device_settings(capture_sizes: list[int]) -> dict:
    """The H200: bf16, CUDA graphs; a CPU (trying the script out): float32, eager, a small KV cache."""
    import torch

    if not torch.cuda.is_available():
        return dict(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=256 * 2**20)
    return dict(dtype="bfloat16", gpu_memory_utilization=0.8,
                compilation_config={"cudagraph_capture_sizes": capture_sizes})  # fmt: skip


# DDTree's own per-step kernels besides the tree attention (verification) and the drafter pass: tree layout, FULL-graph
# tree inputs and masks, walk, KV compaction, tree build (Triton kernel names).
BOOKKEEPING_KERNELS = ("_tree_step_layout_kernel", "_padded_tree_inputs_kernel", "_ancestor_mask_kernel",
                       "_walk_kernel", "_compact_kv_kernel", "_best_first_kernel")  # fmt: skip


def torch_profile(llm, batch: int, prompt_len: int, steps: int, vocab: int, path: Path) -> dict:
    """torch.profiler over one run of `steps` decode steps (the engine runs in this process): the ops with the
    most host time and the most GPU time, and host time grouped by the Python call stack, as text in `path`.
    Returns the GPU time per step of all kernels and of DDTree's bookkeeping kernels (`BOOKKEEPING_KERNELS`, by
    name): the bookkeeping share of a step without the profiler's one-sync-per-step phase timer."""
    import random

    import torch
    from torch.profiler import ProfilerActivity, profile

    prompts = random_prompts(random.Random(batch + 1), batch, prompt_len, vocab)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, with_stack=True) as prof:
        timed_generate(llm, prompts, 1 + steps)
    device_key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    averages = prof.key_averages()
    path.write_text("\n\n".join([
        f"{steps} decode steps, batch {batch}",
        averages.table(sort_by="self_cpu_time_total", row_limit=40),
        averages.table(sort_by=device_key, row_limit=25),
        prof.key_averages(group_by_stack_n=6).table(sort_by="cpu_time_total", row_limit=40),
    ]))  # fmt: skip
    return kernel_times_per_step(averages, steps)


def python_profile(run, path: Path) -> dict:
    """cProfile over `run()`, which runs an engine in this process and returns how many decode steps it ran: the
    functions with the most own time and the most cumulative time, as text in `path`. Returns the own (tottime)
    milliseconds per decode step (the run's prefill step counted in) of the plugin's functions (files under
    vllm_ddtree/), of vLLM's and of all, under cProfile (which inflates Python time): where a step's host time goes
    that the torch profiler's op table does not show (session 22: the chain's and DDTree's ops took the same host
    time, but DDTree's steps ~0.45 ms more)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    steps = profiler.runcall(run)
    stats = pstats.Stats(profiler)
    own_ms: dict[str, float] = {"vllm_ddtree": 0.0, "vllm": 0.0, "all": 0.0}
    for (filename, _, _), (_, _, tottime, _, _) in stats.stats.items():
        part = "vllm_ddtree" if "vllm_ddtree" in filename else "vllm" if "/vllm/" in filename else None
        if part:
            own_ms[part] += tottime * 1e3 / steps
        own_ms["all"] += tottime * 1e3 / steps
    text = io.StringIO()
    for order in ("tottime", "cumulative"):
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(40)
    path.write_text(f"{steps:.1f} decode steps; own ms per step: {own_ms}\n{text.getvalue()}")
    return own_ms


def kernel_times_per_step(averages, steps: int) -> dict:
    """{"all_kernels_us", "bookkeeping_us", "bookkeeping_kernels_us": {name: us}} per decode step from a profile's
    key averages (device time of kernels, CUDA-graph replays included)."""
    def device_us(event) -> float:
        return float(getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0))

    kernels = [e for e in averages if getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type)]
    ours = {name: sum(device_us(e) for e in kernels if name in e.key) / steps for name in BOOKKEEPING_KERNELS}
    return {
        "all_kernels_us": sum(device_us(e) for e in kernels) / steps,
        "bookkeeping_us": sum(ours.values()),
        "bookkeeping_kernels_us": {k: v for k, v in ours.items() if v},
    }


def sync_report(llm, batch: int, prompt_len: int, steps: int, vocab: int, path: Path) -> None:
    """Every host-device synchronization during one run of `steps` decode steps (torch's sync debug mode), by
    call site with its count, as text in `path`: the decode step of a speculative method should have none but
    vLLM's own output copy."""
    import collections
    import random
    import traceback
    import warnings

    import torch

    if not torch.cuda.is_available():
        return
    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        stack = [f for f in traceback.extract_stack()[:-1] if "warnings.py" not in f.filename][-8:]
        sites["".join(traceback.format_list(stack))] += 1

    prompts = random_prompts(random.Random(batch + 2), batch, prompt_len, vocab)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            timed_generate(llm, prompts, 1 + steps)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    lines = [f"{steps} decode steps, batch {batch}: {sum(sites.values())} synchronizations at {len(sites)} sites"]
    lines += [f"--- {count} x\n{stack}" for stack, count in sites.most_common(30)]
    path.write_text("\n".join(lines))


def run_method(method: str, target: str, drafter: str, args) -> list[dict]:
    from vllm import LLM

    from vllm_ddtree.compat import model_runner_for

    start = time.perf_counter()
    spec, max_num_seqs = spec_for(method, drafter, args.budget, args.chain_tokens), max(args.batches)
    if method == "dflash":  # the chain on Model Runner V2 gets DDTree's phase marks (runner_v2._mark_chain_phases)
        os.environ["VLLM_DDTREE_PROFILE_CHAIN"] = "1"
    with model_runner_for(method):
        llm = LLM(
            model=target, speculative_config=spec, load_format=args.load_format,
            skip_tokenizer_init=True, max_model_len=args.prompt_len + 2 * args.steps + 64,
            max_num_seqs=max_num_seqs, disable_log_stats=False, seed=0,
            **device_settings(graph_capture_sizes(spec, max_num_seqs, drafter)),
        )  # fmt: skip
    init_s = time.perf_counter() - start
    vocab = llm.llm_engine.model_config.get_vocab_size()
    print(f"[{method}] engine init {init_s:.0f} s", flush=True)
    rows = []
    for batch in args.batches:
        row = measure(llm, method, batch, args.prompt_len, args.steps, args.repeats, vocab)
        row["engine_init_s"] = init_s
        if method.startswith("ddtree") or method == "dflash":  # per-phase timer (profiling.py)
            row["profile"] = profile_pass(llm, batch, args.prompt_len, args.steps, Path(args.out).with_suffix(
                f".{method}.profile{batch}.json"))  # fmt: skip
        if args.torch_profile:
            row["kernels"] = torch_profile(llm, batch, args.prompt_len, min(args.steps, 16), vocab,
                                           Path(args.out).with_suffix(f".{method}.torch{batch}.txt"))  # fmt: skip
        if args.python_profile:
            import random

            prompts = random_prompts(random.Random(batch + 3), batch, args.prompt_len, vocab)
            tokens = min(args.steps, 16)

            def run() -> float:  # decode steps of one run (its prefill step counted in `python_profile`'s figures)
                return decode_steps(method, batch, tokens, timed_generate(llm, prompts, 1 + tokens)[1])

            row["python_ms"] = python_profile(run, Path(args.out).with_suffix(f".{method}.python{batch}.txt"))
        if args.sync_report:
            sync_report(llm, batch, args.prompt_len, min(args.steps, 16), vocab,
                        Path(args.out).with_suffix(f".{method}.syncs{batch}.txt"))
        print(f"[{method}] batch {batch}: {row['step_ms_median']:.2f} ms/step", flush=True)
        rows.append(row)
    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if engine_core is not None and hasattr(engine_core, "shutdown"):
        engine_core.shutdown()
    del llm
    gc.collect()
    return rows


def print_table(rows: list[dict]) -> None:
    by = {(r["method"], r["batch"]): r for r in rows}
    methods = list(dict.fromkeys(r["method"] for r in rows))
    trees = [m for m in methods if m.startswith("ddtree")]
    pairs = [(t, c) for t in trees for c in ("dflash", "dflash-v1") if c in methods]
    print("\n| batch | " + " | ".join(f"{m} ms/step" for m in methods) + "".join(f" | {t} / {c}" for t, c in pairs) + " |")
    print("| ---: " * (len(methods) + len(pairs) + 1) + "|")
    for b in sorted({r["batch"] for r in rows}):
        ms = {m: by.get((m, b), {}).get("step_ms_median") for m in methods}
        ratios = [f"{ms[t] / ms[c]:.3f}" if ms.get(t) and ms.get(c) else "-" for t, c in pairs]
        print(f"| {b} | " + " | ".join(f"{ms[m]:.2f}" if ms[m] else "-" for m in methods) + "".join(f" | {x}" for x in ratios) + " |")
    for r in rows:
        prof = r.get("profile", {})
        for kind in ("gpu_ms", "host_ms"):
            if prof.get(kind):
                phases = ", ".join(f"{k} {v:.3f}" for k, v in prof[kind].items())
                print(f"{r['method']} batch {r['batch']} {kind} per phase: {phases}")
        if prof.get("counts"):
            print(f"{r['method']} batch {r['batch']} counts: {prof['counts']}")  # e.g. the target's CUDA-graph mode
        kernels = r.get("kernels")
        if kernels and kernels["all_kernels_us"]:
            share = kernels["bookkeeping_us"] / 10 / r["step_ms_median"]  # percent of the step
            print(f"{r['method']} batch {r['batch']} kernels per step: all {kernels['all_kernels_us']:.0f} us, DDTree "
                  f"bookkeeping {kernels['bookkeeping_us']:.1f} us = {share:.2f}% of the {r['step_ms_median']:.2f} ms "
                  f"step ({kernels['bookkeeping_kernels_us']})")
        if r.get("python_ms"):
            own = ", ".join(f"{k} {v:.3f}" for k, v in r["python_ms"].items())
            print(f"{r['method']} batch {r['batch']} Python own ms per step (cProfile): {own}")
    for kind in ("host_ms", "gpu_ms"):
        table = phase_table(rows, kind)
        if table:
            print(table)


def phase_table(rows: list[dict], kind: str = "host_ms") -> str:
    """Markdown: per batch size, each profiled method's ms per phase side by side (`kind`: host_ms or gpu_ms),
    phases in step order, "-" where a method has no such phase (the chain has no tree layout, DDTree no rejection
    sampler), and the step's total: where a DDTree step's extra time goes against the chain's."""
    lines = []
    for batch in sorted({r["batch"] for r in rows}):
        profiled = [r for r in rows if r["batch"] == batch and r.get("profile", {}).get(kind)]
        if len(profiled) < 2:
            continue
        phases: list[str] = []  # each method's phases in its order, a new one before the next known one
        for r in profiled:
            names = list(r["profile"][kind])
            for i, name in enumerate(names):
                if name not in phases:
                    after = next((phases.index(n) for n in names[i + 1 :] if n in phases), len(phases))
                    phases.insert(after, name)
        lines += [f"\nbatch {batch}, {kind} per step:", "| phase | " + " | ".join(r["method"] for r in profiled) + " |",
                  "| --- " + "| ---: " * len(profiled) + "|"]  # fmt: skip
        for name in phases + ["total"]:
            values = [sum(r["profile"][kind].values()) if name == "total" else r["profile"][kind].get(name)
                      for r in profiled]  # fmt: skip
            lines.append(f"| {name} | " + " | ".join("-" if v is None else f"{v:.3f}" for v in values) + " |")
    return "\n".join(lines)


def argv_with_methods(argv: list[str], method: str) -> list[str]:
    """`argv` with its --methods value replaced by `method`."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--methods":
            skip = True
        elif not arg.startswith("--methods="):
            kept.append(arg)
    return kept + ["--methods", method]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--methods", default="none,dflash,ddtree")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--budget", type=int, default=15)
    parser.add_argument("--chain-tokens", type=int, default=None,
                        help="the chain's num_speculative_tokens (default: --budget); a DFlash drafter drafts at most "
                        "its block size - 1")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models-dir", default="/tmp/bench-models")
    parser.add_argument("--out", default="bench_step.json")
    parser.add_argument("--target", default=None, help="a real target folder instead of the Qwen3-8B dummy shape")
    parser.add_argument("--drafter", default=None, help="its DFlash drafter (with --target)")
    parser.add_argument("--load-format", default="auto",
                        help="with --target: 'dummy' times a shape only (e.g. configs/smollm2-135m-shape)")
    parser.add_argument("--torch-profile", action="store_true",
                        help="also write a torch.profiler table per method and batch (OUT.<method>.torch<batch>.txt)")
    parser.add_argument("--python-profile", action="store_true",
                        help="also write a cProfile table per method and batch (OUT.<method>.python<batch>.txt)")
    parser.add_argument("--sync-report", action="store_true",
                        help="also list the host-device synchronizations of a run by call site (OUT.<method>.syncs<batch>.txt)")
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if args.target:
        target, drafter = args.target, args.drafter
    else:
        (target, drafter), args.load_format = write_models(Path(args.models_dir)), "dummy"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    methods = args.methods.split(",")
    if len(methods) > 1:
        # One process per method: vLLM 0.26's CUDA-graph capture guard is process-wide, and a Model Runner V2 engine
        # (`dflash`) started after a V1 one (`ddtree`) in the same process refused to capture (H200, session 14).
        for method in methods:
            run = subprocess.run([sys.executable, __file__, *argv_with_methods(sys.argv[1:], method)])
            print(f"[{method}] exit status {run.returncode}", flush=True)
        print_table(json.loads(out.read_text())["rows"] if out.exists() else [])
        return
    result = json.loads(out.read_text()) if out.exists() else {"rows": []}
    for method in methods:
        rows = run_method(method, target, drafter, args)
        result["rows"] = [r for r in result["rows"] if r["method"] != method] + rows
        out.write_text(json.dumps(result, indent=1))
    print_table(result["rows"])


if __name__ == "__main__":
    main()

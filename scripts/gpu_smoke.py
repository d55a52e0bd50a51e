"""Quick end-to-end check on the GPU: DDTree greedy output vs plain vLLM on tiny float32 models.

Runs plain vLLM once, then DDTree for a few (budget, drafter block size, mode) settings; on a mismatch it repeats
that setting with async scheduling off and in eager mode, to tell which part is at fault. Prints one line per run
and writes JSON to --out.

    python scripts/gpu_smoke.py --out /tmp/smoke.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from vllm import SamplingParams

    from tests.e2e.engine import run
    from tests.e2e.test_greedy_identity import prompts
    from tests.tiny_models import make_tiny_dflash_drafter, make_tiny_target

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="smoke.json")
    parser.add_argument("--settings", default="7:4:eager,16:16:graphs,31:16:eager")
    args = parser.parse_args()
    root = Path("/tmp/ddtree-smoke")
    target = str(make_tiny_target(root / "target"))
    drafters = {bs: str(make_tiny_dflash_drafter(root / f"drafter{bs}", block_size=bs)) for bs in (4, 16)}
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, detokenize=False)
    results = []

    def one(label, spec, **kwargs):
        start = time.perf_counter()
        try:
            res = run(target, spec, prompts(), params, **kwargs)
            row = {"label": label, "token_ids": res.token_ids, "acceptance_length": res.acceptance_length}
        except Exception as exc:  # keep going: the point is a full report from one device call
            import traceback

            traceback.print_exc()
            row = {"label": label, "error": repr(exc)[:500]}
        row["seconds"] = time.perf_counter() - start
        results.append(row)
        Path(args.out).write_text(json.dumps(results, indent=1))
        return row

    base = one("plain (eager)", None, enforce_eager=True)
    for setting in args.settings.split(","):
        budget, block, mode = setting.split(":")
        spec = {"method": "ddtree", "model": drafters[int(block)], "num_speculative_tokens": int(budget)}
        eager = {"enforce_eager": True} if mode == "eager" else {}
        row = one(f"ddtree B={budget} block={block} {mode}", spec, **eager)
        same = row.get("token_ids") == base.get("token_ids")
        row["identical"] = same
        print(f"SMOKE {row['label']}: identical={same} acceptance={row.get('acceptance_length')} "
              f"{row['seconds']:.0f}s {row.get('error', '')}", flush=True)  # fmt: skip
        if not same:
            for label, kwargs in (("sync", {"async_scheduling": False}), ("eager+sync", {"async_scheduling": False,
                                                                                      "enforce_eager": True})):
                retry = one(f"{row['label']} {label}", spec, **{**eager, **kwargs})
                retry["identical"] = retry.get("token_ids") == base.get("token_ids")
                print(f"SMOKE {retry['label']}: identical={retry['identical']} {retry.get('error', '')}", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

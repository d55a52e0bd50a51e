"""bfloat16: how far greedy DDTree and in-tree DFlash drift from plain vLLM on the same prompts (tiny models).

In bf16, any speculative method computes the verified rows with other kernels and batch shapes than one-token
decoding, so near-tied argmaxes can flip. DDTree should drift no more than vLLM's own DFlash chain does.
Reports, per method, the mean index of the first differing token (max_tokens if none) and the fraction of
prompts that match exactly. Writes JSON to --out.

    python scripts/bf16_divergence.py --out /tmp/bf16.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmark import first_difference  # noqa: E402  (scripts/ is this script's own folder)


def main() -> None:
    from vllm import SamplingParams

    from tests.e2e.engine import run
    from tests.tiny_models import make_tiny_dflash_drafter, make_tiny_target

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bf16.json")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=32)
    args = parser.parse_args()
    root = Path("/tmp/ddtree-bf16")
    target = str(make_tiny_target(root / "target"))
    drafter = str(make_tiny_dflash_drafter(root / "drafter16", block_size=16))
    prompts = [[(37 * i + 11 * j) % 500 + 3 for j in range(5 + 3 * i)] for i in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)
    kwargs = {"dtype": "bfloat16"}
    plain = run(target, None, prompts, params, **kwargs).token_ids
    report = {}
    for method in ("dflash", "ddtree"):
        spec = {"method": method, "model": drafter, "num_speculative_tokens": 15}
        result = run(target, spec, prompts, params, **kwargs)
        firsts = [first_difference(a, b) for a, b in zip(plain, result.token_ids)]
        report[method] = {
            "mean_first_difference": sum(firsts) / len(firsts),
            "exact_match_fraction": sum(f == args.max_tokens for f in firsts) / len(firsts),
            "acceptance_length": result.acceptance_length,
        }
        print(f"BF16 {method}: {report[method]}", flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

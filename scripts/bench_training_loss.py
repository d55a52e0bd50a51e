#!/usr/bin/env python
"""The drafter training loss's LM head + cross-entropy, forward and backward, side by side in one run: autograd
through float32 logits (`lm_head_cross_entropy_reference`, the loss before session 48) against the fused path
(`lm_head_cross_entropy`: the Triton row kernel on CUDA, or its torch reference with VLLM_DDTREE_LOSS_KERNEL=torch).

    python scripts/bench_training_loss.py --out /tmp/loss.json      # gpu_train.sh's step: 15,360 x 576 -> 49,152

Under bf16 autocast as the training step runs it (hidden states float32, the frozen head bf16). Per method: the
median of --iters timed forward + backward calls (bench_tree.median_ms: CUDA events, after warm-up), the peak memory of one call above
what the inputs hold, and the loss and gradient's difference from the reference. Prints a markdown table and
writes JSON. On a CPU it runs a small shape (a smoke test, not a timing).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_tree import median_ms  # noqa: E402  (scripts/ is this script's folder)
from vllm_ddtree.drafter.lm_head_loss import lm_head_cross_entropy, lm_head_cross_entropy_reference  # noqa: E402

METHODS = {"reference (float32 logits)": lm_head_cross_entropy_reference, "fused": lm_head_cross_entropy}


def inputs(rows: int, hidden_size: int, vocab: int, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, hidden_size, generator=g).to(device)  # [N, H] float32, as the drafter's final norm
    head = (torch.randn(vocab, hidden_size, generator=g) / hidden_size**0.5).to(device, torch.bfloat16)  # [V, H]
    labels = torch.randint(0, vocab, (rows,), generator=g)
    labels[torch.rand(rows, generator=g) < 0.1] = -100  # blocks past a sequence's end
    weights = torch.rand(rows, generator=g)
    return hidden, head, labels.to(device), (weights / weights.sum()).to(device)


def run(method, hidden, head, labels, weights) -> tuple[torch.Tensor, torch.Tensor]:
    x = hidden.detach().requires_grad_()
    with torch.autocast(hidden.device.type, dtype=torch.bfloat16):
        loss, _ = method(x, head, labels, weights)
    loss.backward()
    return loss.detach(), x.grad


def timed_ms(fn, iters: int, cuda: bool) -> float:
    if cuda:
        return median_ms(fn, iters)
    began = time.perf_counter()  # the CPU smoke test: one call
    fn()
    return (time.perf_counter() - began) * 1e3


def peak_gib(fn, cuda: bool) -> float | None:
    if not cuda:
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=32 * 32 * 15, help="block positions a step (batch x anchors x 15)")
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default="training_loss_bench.json")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda:  # smoke test
        args.rows, args.vocab, args.iters = min(args.rows, 256), min(args.vocab, 2048), min(args.iters, 3)
    hidden, head, labels, weights = inputs(args.rows, args.hidden, args.vocab, "cuda" if cuda else "cpu")
    reference_loss, reference_grad = run(lm_head_cross_entropy_reference, hidden, head, labels, weights)
    rows = []
    for name, method in METHODS.items():
        loss, grad = run(method, hidden, head, labels, weights)
        rows.append({
            "method": name,
            "ms": timed_ms(lambda: run(method, hidden, head, labels, weights), args.iters, cuda),
            "peak_gib": peak_gib(lambda: run(method, hidden, head, labels, weights), cuda),
            "loss": loss.item(),
            "loss_diff": abs(loss.item() - reference_loss.item()),
            "grad_rel_diff": ((grad - reference_grad).norm() / reference_grad.norm()).item(),
        })  # fmt: skip
    device = torch.cuda.get_device_name() if cuda else "cpu (smoke test, not a timing)"
    print(f"{args.rows} rows x {args.hidden} -> {args.vocab}, bf16 autocast, {device}\n")
    print("| method | forward + backward (ms) | peak memory (GiB) | loss | loss diff | gradient rel. diff |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        print(f"| {r['method']} | {r['ms']:.2f} | {peak} | {r['loss']:.4f} | {r['loss_diff']:.1e} | "
              f"{r['grad_rel_diff']:.1e} |")
    Path(args.out).write_text(json.dumps({"device": device, "args": vars(args), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()

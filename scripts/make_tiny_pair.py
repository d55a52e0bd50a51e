#!/usr/bin/env python
"""Build the tiny target/drafter pair in tests/fixtures/tiny_pair and check it in vLLM.

    python scripts/make_tiny_pair.py [--out tests/fixtures/tiny_pair] [--device cpu|cuda] [--verify-only]

1. A byte-level tokenizer (256 byte tokens + <|pad|> <|bos|> <|eos|> <|mask|>), built with `tokenizers`.
2. A tiny Qwen3 target (hidden 64, 2 layers, 4 heads / 2 KV heads, head_dim 32), trained on a synthetic task
   language (copy / count / days / spell / story; each answer ends in <|eos|>), so its greedy answers depend on
   the prompt and are neither random nor a loop.
3. A DFlash drafter (1 layer, block_size 8) trained with vllm_ddtree.drafter on the target's own greedy answers
   to 2,000 task prompts (seed 1); 32 held-out prompts (seed 3) go to prompts.json.
4. vLLM (CPU, in-tree dflash, greedy): output identical to no speculation; prints the acceptance length.

The committed fixture was built with `--device cuda --target-steps 6000 --drafter-steps 3000` (4.7 min on one
H200, float32 throughout); `--device cpu` (the default) runs the same steps on a CPU: not timed here, the
shared two-core machine was saturated by other jobs.
"""

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SPECIALS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|mask|>"]
PAD, BOS, EOS, MASK = range(4)
VOCAB_SIZE = 264  # 4 specials + 256 bytes, padded to a multiple of 8
BLOCK_SIZE = 8

NAMES = ["anna", "ben", "clara", "david", "emma", "felix", "grace", "henry"]
ANIMALS = ["cat", "dog", "horse", "bird", "fox", "rabbit"]
COLORS = ["red", "blue", "green", "yellow", "black", "white"]
THINGS = ["apples", "books", "coins", "letters", "stones", "shells"]
PLACES = ["garden", "forest", "river", "market", "village", "kitchen"]
NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]
DAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]


def sentence(rng: random.Random) -> str:
    kind = rng.randrange(6)
    name, animal, color = rng.choice(NAMES), rng.choice(ANIMALS), rng.choice(COLORS)
    if kind == 0:
        return f"{name} has {rng.choice(NUMBERS[:6])} {rng.choice(THINGS)} in the {rng.choice(PLACES)}."
    if kind == 1:
        return f"the {color} {animal} runs to the {rng.choice(PLACES)} and sleeps."
    if kind == 2:
        start = rng.randrange(len(NUMBERS) - 4)
        return "we count " + " ".join(NUMBERS[start : start + rng.randrange(3, 6)]) + "."
    if kind == 3:
        start = rng.randrange(len(DAYS))
        return "after " + DAYS[start] + " comes " + DAYS[(start + 1) % len(DAYS)] + "."
    if kind == 4:
        return f"{name} likes the {color} {animal} and the {rng.choice(COLORS)} {rng.choice(ANIMALS)}."
    return f"in the {rng.choice(PLACES)} {name} finds {rng.choice(THINGS)}."


NUMBER_WORDS = NUMBERS + ["thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]


def task(rng: random.Random) -> tuple[str, str]:
    """One (prompt, answer) pair. Answers are fixed by the prompt (copying, counting, spelling), except for
    story continuations, so the target's greedy answers are neither random nor a loop."""
    kind = rng.randrange(5)
    if kind == 0:
        text = sentence(rng)
        return f"copy: {text} =", f" {text}"
    if kind == 1:
        start = rng.randrange(len(NUMBER_WORDS) - 3)
        stop = rng.randrange(start + 2, min(len(NUMBER_WORDS), start + 9))
        answer = " " + " ".join(NUMBER_WORDS[start : stop + 1]) + "."
        return f"count from {NUMBER_WORDS[start]} to {NUMBER_WORDS[stop]}:", answer
    if kind == 2:
        start, n = rng.randrange(len(DAYS)), rng.randrange(2, 6)
        days = [DAYS[(start + i) % len(DAYS)] for i in range(n + 1)]
        return f"{n} days from {days[0]}:", " " + " ".join(days) + "."
    if kind == 3:
        word = rng.choice(NAMES + ANIMALS + COLORS + THINGS + PLACES)
        return f"spell {word}:", " " + "-".join(word) + "."
    text = sentence(rng)
    cut = rng.randrange(len(text) // 3, 2 * len(text) // 3)
    return f"story: {text[:cut]}", text[cut:]


def document(rng: random.Random, num_tasks: int) -> str:
    return "".join(prompt + answer + "<|eos|>" for prompt, answer in (task(rng) for _ in range(num_tasks)))


def build_tokenizer(out_dir: Path):
    """Byte-level BPE without merges: every byte is a token (ids 4..259), specials 0..3."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = byte_level_chars()
    assert set(byte_chars) == set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({c: len(SPECIALS) + i for i, c in enumerate(byte_chars)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>", eos_token="<|eos|>", mask_token="<|mask|>",
        clean_up_tokenization_spaces=False, model_max_length=2048,
    )
    fast.save_pretrained(out_dir)
    return fast


def byte_level_chars() -> list[str]:
    """The character that the ByteLevel pre-tokenizer uses for each byte 0..255: printable Latin-1 bytes stand
    for themselves, the others are moved to code points 256 and up, in byte order."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    chars, shifted = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return chars


def train_target(out_dir: Path, tokenizer, steps: int, minutes: float, device: str, seed: int = 0):
    """Tiny Qwen3 trained as a byte-level LM on the synthetic language (``steps`` or ``minutes``, the sooner)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=True, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
    )
    config.architectures = ["Qwen3ForCausalLM"]
    model = Qwen3ForCausalLM(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100) * max(0.05, 1 - s / steps))
    rng, seq_len, batch = random.Random(seed), 192, 32
    deadline, step = time.time() + minutes * 60, 0
    while step < steps and time.time() < deadline:
        texts = [document(rng, 8) for _ in range(batch)]
        ids = torch.tensor([tokenizer(t)["input_ids"][:seq_len] for t in _pad_texts(texts, tokenizer, seq_len)])
        ids = ids.to(device)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        step += 1
        if step % 100 == 0:
            print(f"target step {step} loss {loss.item():.3f}", flush=True)
    model.eval().cpu()
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD}, indent=2) + "\n"
    )
    return model


def _pad_texts(texts, tokenizer, seq_len):
    # Documents are longer than seq_len tokens, so every row is cut to exactly seq_len tokens.
    return [t if len(t) >= seq_len else t + " " * (seq_len - len(t)) for t in texts]


def make_prompts(seed: int, n: int) -> list[str]:
    """Task prompts (the target answers them and stops with <|eos|>)."""
    rng = random.Random(seed)
    return [task(rng)[0] for _ in range(n)]


def train_drafter(out: Path, steps: int, device: str):
    import tempfile

    from transformers import AutoTokenizer

    from vllm_ddtree.drafter.train import TrainConfig, train

    tokenizer = AutoTokenizer.from_pretrained(out / "target")
    train_ids = [tokenizer(p)["input_ids"] for p in make_prompts(seed=1, n=2000)]
    eval_ids = [tokenizer(p)["input_ids"] for p in make_prompts(seed=2, n=32)]
    cfg = TrainConfig(
        target=str(out / "target"), out=tempfile.mkdtemp(prefix="tiny_pair_work_"), block_size=BLOCK_SIZE, num_layers=1,
        target_layer_ids=[0, 1], mask_token_id=MASK, max_new_tokens=96, steps=steps, batch_size=16,
        anchors_per_seq=24, lr=3e-3, warmup_steps=50, save_every=500, eval_prompts=32, device=device, dtype="float32",
        gen_batch_size=128,
    )
    final = train(cfg, prompt_ids=train_ids, eval_prompt_ids=eval_ids)
    for line in (Path(cfg.out) / "responses.jsonl").read_text().splitlines()[:6]:
        seq = json.loads(line)
        print("target sample:", repr(tokenizer.decode(seq["prompt"]) + " |" + tokenizer.decode(seq["response"])))
    drafter_dir = out / "drafter"
    drafter_dir.mkdir(exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        (drafter_dir / name).write_bytes((final / name).read_bytes())
    return json.loads((Path(cfg.out) / "report.json").read_text())


def verify_in_vllm(out: Path, num_prompts: int = 32, max_tokens: int = 96) -> dict:
    """Greedy outputs with and without dflash (identical?) and vLLM's mean acceptance length."""
    prompts = json.loads((out / "prompts.json").read_text())[:num_prompts]
    plain, _ = _vllm_generate(out, prompts, max_tokens, None)
    spec = {"method": "dflash", "model": str(out / "drafter"), "num_speculative_tokens": BLOCK_SIZE - 1}
    outs, counters = _vllm_generate(out, prompts, max_tokens, spec)
    drafts = counters.get("vllm:spec_decode_num_drafts", 0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0)
    return {
        "identical": [list(o.outputs[0].token_ids) for o in outs] == [list(o.outputs[0].token_ids) for o in plain],
        "acceptance_length": 1 + accepted / drafts if drafts else None,
        "drafts": drafts,
        "accepted": accepted,
        "samples": [p + "|" + o.outputs[0].text for p, o in zip(prompts[:4], outs)],
    }


def _vllm_generate(out: Path, prompts: list[str], max_tokens: int, spec: dict | None):
    import gc

    from vllm import LLM, SamplingParams

    llm = LLM(
        str(out / "target"), speculative_config=spec, dtype="float32", max_model_len=512, seed=0,
        kv_cache_memory_bytes=64 * 2**20, distributed_executor_backend="uni", enforce_eager=True,
        disable_log_stats=False,
    )
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
        counters = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    finally:
        llm.llm_engine.engine_core.shutdown()  # a second engine in this process hangs while the first lives
        del llm
        gc.collect()
    return outs, counters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "tiny_pair")
    parser.add_argument("--target-steps", type=int, default=6000)
    parser.add_argument("--target-minutes", type=float, default=10.0, help="stop target training after this long")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the fixture was made on CPU-scale settings)")
    parser.add_argument("--drafter-steps", type=int, default=3000)
    parser.add_argument("--verify-only", action="store_true")
    parser.add_argument("--skip-verify", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest on a busy box)")
    args = parser.parse_args()
    out = args.out
    import torch

    torch.set_num_threads(args.threads)
    if not args.verify_only:
        (out / "target").mkdir(parents=True, exist_ok=True)
        tokenizer = build_tokenizer(out / "target")
        train_target(out / "target", tokenizer, args.target_steps, args.target_minutes, args.device)
        (out / "prompts.json").write_text(json.dumps(make_prompts(seed=3, n=32), indent=1) + "\n")
        print("drafter report:", train_drafter(out, args.drafter_steps, args.device))
    if not args.skip_verify:
        print("vllm:", json.dumps(verify_in_vllm(out)))


if __name__ == "__main__":
    main()

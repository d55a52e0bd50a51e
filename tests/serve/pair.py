"""The model pair the server tests serve, and the server settings that go with it.

tests/fixtures/tiny_pair (scripts/make_tiny_pair.py): a byte-level tokenizer, a trained 2-layer Qwen3 target
(answers end in <|eos|>) and a trained DFlash drafter (block size 8). The tokenizer has no chat template; the
servers get chat_template.jinja (the user's text as is, which is what the target was trained on).
"""

from __future__ import annotations

import json
from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "tiny_pair"
TARGET = FIXTURE / "target"
DRAFTER = FIXTURE / "drafter"
CHAT_TEMPLATE = Path(__file__).resolve().parent / "chat_template.jinja"
BUDGET = 16  # num_speculative_tokens: tree nodes per step besides the root
DEPTH = json.loads((DRAFTER / "config.json").read_text())["block_size"] - 1  # tree depth: 7
BLOCK_SIZE = 32  # KV block size (CPU_ATTN: a multiple of 32); small blocks make trees straddle blocks
SERVER_ARGS = ["--chat-template", str(CHAT_TEMPLATE), "--block-size", str(BLOCK_SIZE)]
SPECULATIVE_CONFIG = {"method": "ddtree", "model": str(DRAFTER), "num_speculative_tokens": BUDGET}


def prompts() -> list[str]:
    """The tiny pair's 32 held-out prompts ("count from five to nine:", "spell dog:", ...)."""
    return json.loads((FIXTURE / "prompts.json").read_text())

"""Prompts the target writes itself, for more distinct training answers than the data packages hold.

The target continues its chat template's text up to where a user message begins (system prompt and user header),
sampled at temperature 1, and writes a user turn ending with its end-of-turn token (the Magpie recipe). SmolLM2-135M
writes questions such as "Is there a way to share data securely using SQL?". Session 37 found the shipped drafter
accepts ~15% more on ShareGPT prompts whose answers it was trained on than on held-out ones: it has partly
memorised them, and the packages' ~53k distinct training turns are all in use.

OUT/self_prompts.jsonl keeps every sample in order (sample i is drawn with seed ``SEED + i``), so a rerun goes on
from it and a banked answer file stays valid: the answers' plan depends on these texts. With ``self_prompts_from``
K > 0 the samples are K, K + 1, ... (seeds ``SEED + K + i``), kept in OUT/self_prompts-from-K.jsonl.
"""

from __future__ import annotations

import json
from pathlib import Path

SEED = 1_000_003  # sample i's seed: SEED + i, apart from the answers' seeds (seed + answer index)
TEMPERATURE = 1.0
MIN_CHARS = 10  # shorter texts ("Hi", "Thanks") are not questions to answer


def user_turn_opening(tokenizer) -> list[int]:
    """Token ids of the chat template's text before a user message's content (system prompt included)."""
    mark = "\x00USER-MESSAGE\x00"
    template = getattr(tokenizer, "chat_template", None)
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False) if template else ""
    if mark not in text:
        raise ValueError("self_prompts needs a tokenizer with a chat template that places the user's message; this "
                         "target's has none: train without self_prompts")
    return tokenizer(text[: text.index(mark)], add_special_tokens=False)["input_ids"]


def normalised(text: str) -> str:
    return " ".join(text.lower().split())


def usable_prompts(samples: list[str | None], refused: set[str]) -> list[str]:
    """The samples to answer, in order: complete ones (None: the turn did not end within the length), of at least
    MIN_CHARS, each text once (case and spacing aside), none whose normalised text is in ``refused``."""
    kept, seen = [], set(refused)
    for text in samples:
        key = normalised(text) if text is not None else ""
        if len(key) >= MIN_CHARS and key not in seen:
            seen.add(key)
            kept.append(text.strip())
    return kept


def written_prompts(cfg, tokenizer, eos_ids: set[int], generator, deadline: float | None = None) -> list[str]:
    """``cfg.self_prompts`` user turns sampled from the target (`usable_prompts` of them, held-out prompts of
    ``cfg.sources`` refused), generated with vLLM as the answers are; the samples already in OUT/self_prompts.jsonl
    are kept, written by `generator` (the run's `VllmGenerator`). Past ``deadline`` the samples so far are kept and
    `AnswersIncomplete` names the rerun."""
    from vllm_ddtree.drafter import data
    from vllm_ddtree.drafter.train import AnswersIncomplete

    first = cfg.self_prompts_from
    path = Path(cfg.out) / ("self_prompts.jsonl" if first == 0 else f"self_prompts-from-{first}.jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    samples = [json.loads(line)["text"] for line in path.read_text().splitlines()] if path.exists() else []
    samples = samples[: cfg.self_prompts]
    todo = cfg.self_prompts - len(samples)
    if todo > 0:
        opening = user_turn_opening(tokenizer)
        chunks = generator.answer([opening] * todo, cfg.max_prompt_len, [TEMPERATURE] * todo,
                                  SEED + first + len(samples), deadline=deadline)  # fmt: skip
        for chunk in chunks:
            texts = [tokenizer.decode(ids, skip_special_tokens=True) if ids and ids[-1] in eos_ids else None
                     for ids in chunk]  # fmt: skip
            with path.open("a") as f:
                f.writelines(json.dumps({"text": text}) + "\n" for text in texts)
            samples += texts
    if len(samples) < cfg.self_prompts:
        raise AnswersIncomplete(
            f"time limit ({cfg.time_limit_s or 0:.0f} s) reached while the target wrote its own prompts: "
            f"{len(samples)} of {cfg.self_prompts} are in {path}; run the same command again (with --resume) to "
            "write the rest, answer them and train"
        )
    return usable_prompts(samples, _heldout_turns(data, cfg.sources))


def _heldout_turns(data, sources) -> set[str]:
    """Every user turn of the held-out records (normalised): a written prompt equal to one is not trained on."""
    turns = set()
    for source in sources:
        try:
            records = data.heldout_prompts(source)
        except ValueError as missing:  # no package: no held-out prompts of that source to measure on either
            print(f"self_prompts: {missing}")
            continue
        turns.update(normalised(turn) for p in records for turn in (p.turns or (p.text,)))
    return turns

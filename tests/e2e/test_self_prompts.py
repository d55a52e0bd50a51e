"""Prompts written by the target itself (`TrainConfig.self_prompts`) with the real SmolLM2-135M-Instruct and
vLLM's CPU build: the samples are user turns (the chat template's user opening is a prefix of a templated prompt),
a rerun keeps them and appends, and their answers come after every other answer."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


def test_the_user_opening_is_where_a_templated_user_message_begins(tokenizer):
    from vllm_ddtree.drafter.self_prompts import user_turn_opening

    opening = user_turn_opening(tokenizer)
    templated = tokenizer.apply_chat_template([{"role": "user", "content": "How do I sort a list?"}],
                                              return_dict=True)["input_ids"]  # as encode_prompts encodes
    assert len(opening) > 3 and list(templated[: len(opening)]) == opening
    assert tokenizer.decode(opening).endswith("user\n")


def test_written_prompts_are_kept_across_reruns_and_answered_last(smollm2, tokenizer, tmp_path):
    from vllm_ddtree.drafter.self_prompts import normalised, written_prompts
    from vllm_ddtree.drafter.train import TrainConfig, encode_prompts, train, vllm_generator

    def written(cfg: TrainConfig) -> list[str]:  # as train() calls it, with engines of its own
        with vllm_generator(cfg, {tokenizer.eos_token_id}) as generator:
            return written_prompts(cfg, tokenizer, {tokenizer.eos_token_id}, generator)

    cfg = dict(target=smollm2, out=str(tmp_path / "run"), generator="vllm", max_prompt_len=96, max_new_tokens=8,
               block_size=4, num_layers=1, steps=0, eval_every=0, eval_prompts=0, device="cpu", sources=("mtbench",))
    path = tmp_path / "run" / "self_prompts.jsonl"
    first = written(TrainConfig(**cfg, self_prompts=6))
    samples = [json.loads(line)["text"] for line in path.read_text().splitlines()]
    assert len(samples) == 6 and 3 <= len(first) <= 6  # SmolLM2 ends most turns within 96 tokens
    assert len({normalised(t) for t in first}) == len(first) and all(t.strip() == t for t in first)
    assert all(text is None or text.strip() in first or len(normalised(text)) < 10 for text in samples)
    print(first)

    prompts = [[1, 9690, 198, 2683], [1, 9690, 198, 2684]]  # any token ids: answered first
    train(TrainConfig(**cfg, self_prompts=8), prompt_ids=prompts)  # two more samples, then every answer
    assert [json.loads(line)["text"] for line in path.read_text().splitlines()][:6] == samples
    answers = [json.loads(line) for line in (tmp_path / "run" / "responses.jsonl").read_text().splitlines()]
    again = written(TrainConfig(**cfg, self_prompts=8))
    assert again[: len(first)] == first
    assert [a["prompt"] for a in answers] == prompts + encode_prompts(tokenizer, again, True, 96)
    later = written(TrainConfig(**cfg, self_prompts=2, self_prompts_from=6))  # samples 6 and 7, in a file of their own
    kept_path = tmp_path / "run" / "self_prompts-from-6.jsonl"
    kept = [json.loads(line)["text"] for line in kept_path.read_text().splitlines()]
    assert kept == [json.loads(line)["text"] for line in path.read_text().splitlines()][6:8]
    assert set(later) <= {t.strip() for t in kept if t is not None}  # samples 6, 7 of the run above: same seeds
    with pytest.raises(ValueError, match="self_prompts=4 with generator='hf'"):
        train(TrainConfig(**dict(cfg, generator="hf"), self_prompts=4), prompt_ids=prompts)
    with pytest.raises(ValueError, match="self_prompts_from=-1"):
        train(TrainConfig(**cfg, self_prompts=2, self_prompts_from=-1), prompt_ids=prompts)

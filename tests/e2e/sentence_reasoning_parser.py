"""A reasoning parser for tests (vLLM's `reasoning_parser_plugin`): the assistant turn's first sentence is its
reasoning. Reasoning starts at `<|im_start|>` (the assistant turn's opening in SmolLM2's chat template, so a prompt
never ends reasoning) and ends at the first "." token; structured output constrains what follows. SmolLM2's
tokenizer has no think tokens, and this gives a real reasoning-to-grammar switch inside generated text."""

from vllm.reasoning import ReasoningParserManager
from vllm.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser

NAME = "ddtree-test-first-sentence"


@ReasoningParserManager.register_module(NAME)
class FirstSentenceReasoningParser(DeepSeekR1ReasoningParser):
    @property
    def start_token(self) -> str:
        return "<|im_start|>"

    @property
    def end_token(self) -> str:
        return "."

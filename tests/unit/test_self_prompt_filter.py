"""Which prompts written by the target are answered (`self_prompts.usable_prompts`); the whole path with the real
target is in tests/e2e/test_self_prompts.py."""

from vllm_ddtree.drafter.self_prompts import MIN_CHARS, normalised, usable_prompts


def test_complete_new_and_long_enough_samples_are_kept_in_order():
    samples = [
        "  Can you explain recursion?\n",
        None,  # the turn did not end within the length
        "can you   EXPLAIN recursion?",  # the first one again, case and spacing aside
        "Hi!",  # too short to be a question
        "What is the capital of France?",  # a held-out prompt
        "How do I sort a list in Python?",
    ]
    assert len(normalised("Hi!")) < MIN_CHARS <= len(normalised("How do I sort a list in Python?"))
    refused = {normalised("What is the  capital of France?")}
    assert usable_prompts(samples, refused) == ["Can you explain recursion?", "How do I sort a list in Python?"]
    assert usable_prompts([], refused) == [] and usable_prompts([None, None], set()) == []

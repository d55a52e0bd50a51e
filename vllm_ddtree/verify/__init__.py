"""Verification of draft trees inside vLLM's model runner: the step's layout and the scorer."""

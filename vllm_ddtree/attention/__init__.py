"""Tree verification attention: per-request ancestor masks over vLLM's paged KV cache."""

"""Which tree-attention path a layer takes on CUDA (`attention.layers._split_attention_applies`): the split design
(FA3 context pass + tree part) for batches of two or more tree requests, the one-pass kernel for one request (as
fast or faster there, session 15 on the H200), VLLM_DDTREE_SPLIT_ATTENTION=0/1 to force either."""

from types import SimpleNamespace

import pytest
import torch

from vllm_ddtree.attention.layers import _split_attention_applies

FA3 = SimpleNamespace(vllm_flash_attn_version=3)


def _tree(num_reqs: int, covers_all_tokens: bool = True):
    return SimpleNamespace(covers_all_tokens=covers_all_tokens, cu_seqlens_q=torch.zeros(num_reqs + 1),
                           num_tree_reqs=num_reqs)  # fmt: skip


@pytest.mark.parametrize(
    "env, num_reqs, expected",
    [(None, 1, False), (None, 2, True), (None, 32, True), ("1", 1, True), ("0", 8, False), ("auto", 4, True)],
)
def test_split_for_batches_one_pass_for_one_request(monkeypatch, env, num_reqs, expected):
    if env is None:
        monkeypatch.delenv("VLLM_DDTREE_SPLIT_ATTENTION", raising=False)
    else:
        monkeypatch.setenv("VLLM_DDTREE_SPLIT_ATTENTION", env)
    query = torch.zeros(1, dtype=torch.bfloat16)
    assert _split_attention_applies(FA3, query, _tree(num_reqs)) is expected


def test_split_needs_fa3_16_bit_and_an_all_tree_batch(monkeypatch):
    monkeypatch.setenv("VLLM_DDTREE_SPLIT_ATTENTION", "1")
    bf16, fp32 = torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1)
    assert not _split_attention_applies(FA3, fp32, _tree(4))
    assert not _split_attention_applies(SimpleNamespace(vllm_flash_attn_version=2), bf16, _tree(4))
    assert not _split_attention_applies(FA3, bf16, _tree(4, covers_all_tokens=False))

"""Model Runner V2 hands the scheduler the trees' parents with the drafts on steps with structured output
(`runner_v2.hand_tree_parents_to_scheduler`), through vLLM's own `DraftTokensHandler` and CUDA streams.

Oracle: the parents written into the speculator's request slots, gathered by hand. Skipped without CUDA (the
handler makes a CUDA stream); the engine-level check is tests/e2e/test_structured_output.py run under V2.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def handler_and_speculator(max_reqs: int = 6, width: int = 5):
    utils = pytest.importorskip("vllm.v1.worker.gpu.spec_decode.utils")
    from vllm_ddtree.runner_v2 import hand_tree_parents_to_scheduler

    handler = utils.DraftTokensHandler(torch.device("cuda"))
    generator = torch.Generator().manual_seed(0)
    parents = torch.stack([
        torch.tensor([-1] + [int(torch.randint(node, (1,), generator=generator)) for node in range(1, width)])
        for _ in range(max_reqs + 1)
    ]).cuda()  # [max_reqs + 1, width]: a random tree in each request slot
    speculator = SimpleNamespace(tree_parents=parents)
    hand_tree_parents_to_scheduler(handler, speculator)
    return handler, parents


def batch(slots: list[int], structured: bool):
    return SimpleNamespace(
        req_ids=[f"r{slot}" for slot in slots],
        idx_mapping=torch.tensor(slots, dtype=torch.int32, device="cuda"),
        has_structured_output_reqs=structured,
    )


def test_parents_follow_the_drafts_by_request_slot_on_structured_output_steps():
    from vllm_ddtree.structured import ATTRIBUTE

    handler, parents = handler_and_speculator()
    slots = [4, 0, 2]
    drafts = torch.arange(len(slots) * 4, device="cuda").view(len(slots), 4)  # [R, B]
    handler.set_draft_tokens(batch(slots, structured=True), drafts)
    out = handler.get_draft_tokens()

    assert out.req_ids == ["r4", "r0", "r2"]
    assert out.draft_token_ids == drafts.tolist()
    expected = {f"r{slot}": parents[slot].tolist() for slot in slots}
    assert getattr(out, ATTRIBUTE) == expected


def test_steps_without_structured_output_copy_nothing_and_carry_no_parents():
    from vllm_ddtree.structured import ATTRIBUTE

    handler, _ = handler_and_speculator()
    handler.set_draft_tokens(batch([1, 3], structured=True), torch.zeros(2, 4, dtype=torch.int64, device="cuda"))
    handler.get_draft_tokens()
    handler.set_draft_tokens(batch([1, 3], structured=False), torch.zeros(2, 4, dtype=torch.int64, device="cuda"))
    out = handler.get_draft_tokens()

    assert out.draft_token_ids == [[-1] * 4, [-1] * 4]  # vLLM's placeholders: nothing was copied
    assert getattr(out, ATTRIBUTE, None) is None

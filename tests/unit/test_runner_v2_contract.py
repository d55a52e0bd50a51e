"""DDTree on Model Runner V2 (VLLM_DDTREE_RUNNER=v2), the parts that run without a GPU.

V2 runs on CUDA only, so the end-to-end checks are GPU tests (tests/e2e with VLLM_DDTREE_RUNNER=v2 on the H200).
Here: the V2 names and parameters the hooks rely on exist in the installed vLLM (a contract that fails on the
upgrade that breaks it), the drafter's in-graph top-K against `top_tokens`, and the verifier's logprob rows against
the V1 scorer's (`output_logprobs`: output token j of a request comes from its path node j's logits row).
"""

import inspect
from types import SimpleNamespace

import numpy as np
import pytest
import torch


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_v2_names_the_hooks_use_exist():
    from vllm_ddtree import compat

    module = compat.v2_model_runner_module()
    runner = module.GPUModelRunner
    for name in ("__init__", "load_model", "initialize_kv_cache", "execute_model", "prepare_attn"):
        assert callable(getattr(runner, name)), name
    assert _params(runner.prepare_attn)[:2] == ["self", "input_batch"]
    assert _params(module.init_speculator)[:2] == ["vllm_config", "device"]
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    assert "for_capture" in _params(DefaultModelState.prepare_attn)
    speculator = compat.v2_dflash_speculator_class()
    assert _params(speculator.propose)[:9] == [
        "self", "input_batch", "attn_metadata", "slot_mappings", "last_hidden_states", "aux_hidden_states",
        "num_sampled", "num_rejected", "last_sampled",
    ]  # fmt: skip
    assert _params(speculator.sample_draft)[:2] == ["self", "hidden_states"]
    assert _params(speculator.load_model)[:2] == ["self", "target_model"]
    v2 = compat.v2_sampling()
    assert _params(v2.compute_topk_scores)[:4] == ["logits", "num_logprobs", "sampled_token_ids", "cu_num_logits"]
    assert "logits_mode" in _params(v2.compute_topk_scores)
    assert {"num_sampled", "seq_lens", "cu_num_logits", "idx_mapping", "prefill_len"} <= set(
        _params(v2.get_num_sampled_and_rejected)
    )
    assert {"sampled_token_ids", "logprobs_tensors", "num_nans", "num_sampled", "num_rejected"} <= set(
        inspect.signature(v2.SamplerOutput).parameters
    )


def test_init_speculator_is_ddtrees_only_for_ddtree_configs():
    from vllm_ddtree import compat
    from vllm_ddtree.runner_v2 import install_v2_runner_hooks

    module = compat.v2_model_runner_module()
    install_v2_runner_hooks()
    install_v2_runner_hooks()  # idempotent
    assert module.GPUModelRunner._ddtree_hooked
    seen = []
    hooked = module.init_speculator
    # A non-DDTree config goes to vLLM's own init_speculator (whatever it returns or raises).
    config = SimpleNamespace(speculative_config=SimpleNamespace(method="ngram"))
    try:
        seen.append(hooked(config, torch.device("cpu")))
    except Exception as error:  # vLLM's own: it refuses methods it has no speculator for
        seen.append(type(error).__name__)
    assert seen and not type(seen[0]).__name__.startswith("DDTree")


def test_drafter_keeps_each_positions_top_tokens_and_returns_the_argmax():
    from vllm_ddtree.speculator_v2 import DDTreeSpeculator
    from vllm_ddtree.tree.build import top_tokens

    torch.manual_seed(0)
    rows, vocab, hidden, k = 6, 50, 8, 4
    head = torch.randn(hidden, vocab)
    speculator = object.__new__(DDTreeSpeculator)
    speculator.model = SimpleNamespace(compute_logits=lambda h: h @ head)
    speculator.topk = k
    speculator.top_token_ids = torch.full((10, k), -7, dtype=torch.int64)
    speculator.top_log_probs = torch.full((10, k), 7.0)
    states = torch.randn(rows, hidden)

    chain = speculator.sample_draft(states, torch.zeros(rows), torch.zeros(rows), None, None, None, None)

    ids, lps = top_tokens(states @ head, k)
    assert torch.equal(speculator.top_token_ids[:rows], ids)
    assert torch.equal(speculator.top_log_probs[:rows], lps)
    assert torch.equal(chain, (states @ head).argmax(dim=-1))
    assert (speculator.top_token_ids[rows:] == -7).all()  # rows past the batch untouched


def test_verifier_logprob_rows_are_the_path_nodes_rows():
    from vllm_ddtree.tree import build_draft_tree
    from vllm_ddtree.verify.scorer import node_tokens, output_logprobs, walk_and_moves_
    from vllm_ddtree.verify.step import build_tree_step
    from vllm_ddtree.verify.verifier_v2 import TreeVerifier

    torch.manual_seed(1)
    budget, depth, vocab = 5, 3, 12
    draft = torch.randn(2, depth, vocab) * 3
    tree = build_draft_tree(draft, torch.tensor([1, 2]), budget=budget)
    # Request 0 verifies its tree, request 1 decodes without drafts, request 2 verifies request 1's tree.
    num_drafts = [budget, 0, budget]
    prev_rows = [0, -1, 1]
    input_ids = torch.cat([tree.token_ids[0], torch.tensor([4]), tree.token_ids[1]])
    num_tokens = input_ids.shape[0]
    step = build_tree_step(num_drafts, torch.arange(num_tokens), tree.parents, tree.depths, prev_rows, budget + 1)
    logits = torch.randn(num_tokens, vocab)
    tokens = node_tokens(step, input_ids)
    choices = tokens.new_zeros(num_tokens)  # the target agrees along the first child of each node
    for r in (0, 2):
        for node in range(budget + 1):
            kids = (step.parents[r] == node).nonzero()
            if kids.numel():
                choices[step.node_rows[r, node]] = tokens[r, kids[0, 0]]
    walk, _, output = walk_and_moves_(step, choices, tokens, depth, torch.zeros(num_tokens, dtype=torch.int64))
    assert walk.num_accepted.tolist()[0] >= 1

    seen = {}

    def compute_topk_scores(source, num_logprobs, sampled, cu_num_logits, logits_mode=False):
        seen.update(source=source, sampled=sampled, cu=cu_num_logits)
        return "logprobs"

    v2 = SimpleNamespace(NO_LOGPROBS=-1, compute_topk_scores=compute_topk_scores)
    cu = np.cumsum([0] + [n + 1 for n in num_drafts])
    local = torch.cat([torch.arange(n + 1) for n in num_drafts])
    batch = SimpleNamespace(idx_mapping_np=np.arange(3), expanded_local_pos=local, cu_num_logits_np=cu)
    sampler = SimpleNamespace(
        sampling_states=SimpleNamespace(max_num_logprobs=lambda idx: 2), logprobs_mode="raw_logprobs"
    )
    verifier = TreeVerifier(sampler, state=None, speculator=None)
    assert verifier._logprobs(v2, logits, logits, batch, step, walk, output) == "logprobs"

    # V1's scorer picks the same logits row for every output token on the path.
    ids, values, ranks = output_logprobs(logits, step, walk, output, 2, as_logprobs=False)
    width = output.shape[1]
    for r in range(3):
        for j in range(int(walk.num_accepted[r]) + 1):
            row = int(cu[r]) + j
            v1_row_values = values.view(3, width, -1)[r, j, 1:]  # V1's top-2 logits of that row
            assert torch.equal(seen["source"][row].topk(2).values, v1_row_values)
            assert int(seen["sampled"][row]) == int(output[r, j])
    assert seen["cu"] == cu.tolist()


@pytest.mark.parametrize("env, expected", [(None, False), ("v1", False), ("v2", True), ("V2", True)])
def test_v2_runner_is_opt_in(monkeypatch, env, expected):
    from vllm_ddtree.compat import v2_runner_requested

    if env is None:
        monkeypatch.delenv("VLLM_DDTREE_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_DDTREE_RUNNER", env)
    assert v2_runner_requested() is expected


def test_v2_penalties_state_is_what_the_tree_penalties_read():
    from vllm.v1.worker.gpu.sample.penalties import PenaltiesState
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    if hasattr(PenaltiesState, "apply_penalties"):  # 0.26
        assert _params(PenaltiesState.apply_penalties)[:5] == [
            "self", "logits", "expanded_idx_mapping", "idx_mapping_np", "input_ids",
        ]  # fmt: skip
        assert "self.penalties_state.apply_penalties(" in inspect.getsource(Sampler.apply_sampling_params)
    else:  # 0.32: apply(logits, ctx), ctx a LogitsContext
        assert _params(PenaltiesState.apply) == ["self", "logits", "ctx"]
        source = inspect.getsource(PenaltiesState.apply)
        for field in ("ctx.idx_mapping_np", "ctx.expanded_idx_mapping", "ctx.input_ids"):
            assert field in source, field
    init = inspect.getsource(PenaltiesState.__init__)
    for name in ("output_bin_counts", "prompt_bin_mask", "repetition_penalty", "frequency_penalty",
                 "presence_penalty", "use_penalty"):  # fmt: skip
        assert f"self.{name}" in init, name

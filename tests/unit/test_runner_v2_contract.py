"""DDTree on Model Runner V2 (VLLM_DDTREE_RUNNER=v2), the parts that run without a GPU.

V2 runs on CUDA only, so the end-to-end checks are GPU tests (tests/e2e with VLLM_DDTREE_RUNNER=v2 on the H200).
Here: the V2 names and parameters the hooks rely on exist in the installed vLLM (a contract that fails on the
upgrade that breaks it); the drafter's in-graph top-K against `top_tokens`; the verifier's logprob rows against
the V1 scorer's (`output_logprobs`: output token j of a request comes from its path node j's logits row); the
glue with fakes for V2's objects: tree metadata on the target's layers (runtime and capture), and the speculator's
path move, tree build and per-slot tree state.
"""

import inspect
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_ddtree.profiling import step_timer


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
    assert _params(speculator.sample_draft)[3] == "idx_mapping"  # the in-graph tree build reads args[1]
    assert _params(runner.capture_model)[:1] == ["self"]  # layout_in_graph's capture hook
    assert _params(speculator.load_model)[:2] == ["self", "target_model"]
    v2 = compat.v2_sampling()
    assert _params(v2.compute_topk_scores)[:4] == ["logits", "num_logprobs", "sampled_token_ids", "cu_num_logits"]
    assert "logits_mode" in _params(v2.compute_topk_scores)
    assert _params(v2.get_num_nans) == ["logits"] and compat.v2_sampling() is v2  # built once
    assert {"num_sampled", "seq_lens", "cu_num_logits", "idx_mapping", "prefill_len"} <= set(
        _params(v2.get_num_sampled_and_rejected)
    )
    assert {"sampled_token_ids", "logprobs_tensors", "num_nans", "num_sampled", "num_rejected"} <= set(
        inspect.signature(v2.SamplerOutput).parameters
    )


def test_roots_buffer_of_the_in_graph_tree_build():
    """The in-graph tree build reads V2's per-slot last sampled tokens ([max_reqs, 1] -> [max_reqs], the tensor
    `propose` gets as `last_sampled`); a V2 without the buffer builds after the pass (None)."""
    from vllm.v1.worker.gpu import states

    from vllm_ddtree import compat

    assert "self.last_sampled_tokens = " in inspect.getsource(states)  # this vLLM's V2 keeps it
    buffer = torch.arange(4)[:, None]
    roots = compat.v2_last_sampled_tokens(SimpleNamespace(req_states=SimpleNamespace(last_sampled_tokens=buffer)))
    assert roots.shape == (4,) and roots.data_ptr() == buffer.data_ptr()
    assert compat.v2_last_sampled_tokens(SimpleNamespace(req_states=SimpleNamespace())) is None


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
    speculator.topk, speculator.tree_in_graph = k, False
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
    walk, _, output = walk_and_moves_(step, choices, input_ids, depth, torch.zeros(num_tokens, dtype=torch.int64))
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


@pytest.mark.parametrize("env, expected", [(None, "auto"), ("", "auto"), ("v1", "v1"), ("v2", "v2"), (" V2 ", "v2")])
def test_runner_choice_reads_the_environment(monkeypatch, env, expected):
    from vllm_ddtree.compat import requested_runner

    if env is None:
        monkeypatch.delenv("VLLM_DDTREE_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_DDTREE_RUNNER", env)
    assert requested_runner() == expected


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


def test_verifier_calls_v2s_apply_sampling_params_with_the_installed_signature():
    """`compat.v2_sampling().apply_sampling_params` calls the installed `Sampler.apply_sampling_params` (6 arguments
    in 0.26, 8 in 0.32): the real method, up to its first statement, which reads `idx_mapping_np`."""
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    from vllm_ddtree.compat import v2_sampling

    seen = []

    class NeedsNoProcessing:
        def __getitem__(self, key):
            seen.append(key)
            return np.zeros(len(key), dtype=bool)

    sampler = SimpleNamespace(needs_logits_processing=NeedsNoProcessing())
    sampler.apply_sampling_params = Sampler.apply_sampling_params.__get__(sampler)
    rows = 5  # two requests: 3 + 2 logits rows
    batch = SimpleNamespace(
        expanded_idx_mapping=torch.tensor([0, 0, 0, 1, 1]), idx_mapping=torch.tensor([0, 1]),
        idx_mapping_np=np.array([0, 1]), expanded_local_pos=torch.tensor([0, 1, 2, 0, 1]),
        seq_lens_cpu_upper_bound=torch.tensor([9, 7]),
    )  # fmt: skip
    logits = torch.randn(rows, 11)
    out = v2_sampling().apply_sampling_params(sampler, logits, batch, torch.arange(rows), torch.zeros(rows))
    assert out is logits  # no request needs processing: V2 returns the logits themselves
    assert len(seen) == 1 and seen[0] is batch.idx_mapping_np


def test_v2_masks_min_tokens_stop_tokens_by_position():
    """min_tokens on V2 needs nothing of DDTree's own: V2 masks a row's stop tokens while its position + 1 is below
    prompt length + min_tokens, and the tree verifier passes each node's tree position (root + depth), the position
    plain decoding gives that token. (V1: `verify/sampling.mask_stop_tokens_below_min_tokens`.)"""
    from vllm.v1.worker.gpu.sample import logit_bias

    source = inspect.getsource(logit_bias)
    assert "min_len = prompt_len + min_tokens" in source
    assert "pos + 1 < min_len" in source


def test_target_metadata_gets_this_steps_tree_at_runtime_and_a_chain_at_capture():
    from vllm_ddtree.attention.metadata import ATTRIBUTE, PersistentTreeBuffers, TreeAttentionMetadataBuilder
    from vllm_ddtree.runner_v2 import DDTreeV2State, _wrap_model_state_prepare_attn
    from vllm_ddtree.tree import ancestor_mask, build_draft_tree
    from vllm_ddtree.verify.step import build_tree_step

    budget, num_reqs = 4, 2
    width = budget + 1
    state = DDTreeV2State(budget=budget, depth=3)
    state.timer = step_timer(torch.device("cpu"))  # the no-op timer
    state.attention = TreeAttentionMetadataBuilder(
        {"target.0"}, PersistentTreeBuffers.allocate(8, width, torch.device("cpu"))
    )

    def backend():
        return SimpleNamespace(
            seq_lens=torch.tensor([20, 30], dtype=torch.int32),
            query_start_loc=torch.tensor([0, width, 2 * width], dtype=torch.int32),
            max_seq_len=30, block_table=torch.zeros(2, 4, dtype=torch.int32),
        )  # fmt: skip

    model_state = SimpleNamespace(prepare_attn=lambda batch, *a, for_capture=False, **k: {
        "target.0": backend(), "drafter.0": backend()})  # fmt: skip
    _wrap_model_state_prepare_attn(model_state, state, torch.device("cpu"))
    uniform = SimpleNamespace(num_tokens=num_reqs * width, num_reqs=num_reqs,
                              num_scheduled_tokens=np.array([width] * num_reqs))  # fmt: skip

    captured = model_state.prepare_attn(uniform, "FULL", for_capture=True)
    tree = getattr(captured["target.0"], ATTRIBUTE)
    assert tree.covers_all_tokens and tree.node_mask.data_ptr() == state.attention.persistent.node_mask.data_ptr()
    assert torch.equal(tree.node_mask[0].bool(), torch.ones(width, width).tril().bool())  # a chain
    assert getattr(captured["drafter.0"], ATTRIBUTE, None) is None  # only the target's layers

    draft = torch.randn(num_reqs, 3, 30, generator=torch.Generator().manual_seed(0)) * 3
    kept = build_draft_tree(draft, torch.tensor([1, 2]), budget=budget)
    state.step = build_tree_step([budget] * num_reqs, torch.arange(num_reqs * width), kept.parents, kept.depths,
                                 [0, 1], width)  # fmt: skip
    runtime = model_state.prepare_attn(uniform, "FULL")
    tree = getattr(runtime["target.0"], ATTRIBUTE)
    assert torch.equal(tree.node_mask[:num_reqs].bool(), ancestor_mask(kept.parents))
    state.step = None  # no drafts, but n tokens a request (prefill chunks): V2 may replay the tree graph, so chains
    chains = getattr(model_state.prepare_attn(uniform, "FULL")["target.0"], ATTRIBUTE)
    assert torch.equal(chains.node_mask[:num_reqs].bool(), torch.ones(num_reqs, width, width).tril().bool())
    assert torch.equal(chains.context_lens, torch.tensor([20 - width, 30 - width], dtype=torch.int32))
    mixed = SimpleNamespace(num_tokens=7, num_reqs=num_reqs, num_scheduled_tokens=np.array([5, 2]))
    assert getattr(model_state.prepare_attn(mixed, "FULL")["target.0"], ATTRIBUTE, None) is None  # no tree graph


def test_speculator_keeps_each_requests_tree_in_its_slot_and_returns_its_nodes(monkeypatch):
    from vllm_ddtree import speculator_v2
    from vllm_ddtree.speculator_v2 import DDTreeSpeculator
    from vllm_ddtree.tree.build import top_tokens, tree_from_top_tokens

    budget, depth, vocab, k, max_reqs = 5, 3, 30, 5, 6
    logits = torch.randn(2 * depth, vocab, generator=torch.Generator().manual_seed(2)) * 3
    seen = {}

    def dflash_propose(self, input_batch, attn_metadata, slot_mappings, last_hidden, aux, num_sampled,
                       num_rejected, last_sampled, *args, **kwargs):  # fmt: skip
        seen["context"] = self.model.combine_hidden_states(torch.cat(aux, dim=-1)).clone()
        self.sample_draft(logits)  # what the drafter's graph does: top-K kept, argmax returned

    monkeypatch.setattr(speculator_v2.DFlashSpeculator, "propose", dflash_propose)
    spec = object.__new__(DDTreeSpeculator)
    spec.model = SimpleNamespace(compute_logits=lambda h: h, combine_hidden_states=lambda h: h * 1.0)
    spec.budget, spec.depth, spec.topk, spec.timer = budget, depth, k, step_timer(torch.device("cpu"))
    spec.tree_in_graph = False
    spec.top_token_ids = torch.zeros(max_reqs * depth, k, dtype=torch.int64)
    spec.top_log_probs = torch.zeros(max_reqs * depth, k)
    spec.tree_parents = torch.full((max_reqs, budget + 1), -7, dtype=torch.int64)
    spec.tree_depths = torch.full((max_reqs, budget + 1), -7, dtype=torch.int64)
    # load_model's wrapper around the drafter's combine_hidden_states: the accepted paths' rows move first.
    combine = spec.model.combine_hidden_states
    spec.model.combine_hidden_states = lambda h: (lambda c: (spec._move_accepted_paths_(c), c)[1])(combine(h))
    spec.accepted_path_moves = (torch.tensor([3]), torch.tensor([1]))  # token 3's row goes to row 1
    aux = [torch.arange(8.0)[:, None].repeat(1, 2)]
    batch = SimpleNamespace(num_reqs=2, idx_mapping=torch.tensor([4, 1], dtype=torch.int32))
    last_sampled = torch.arange(max_reqs)[:, None] + 100  # [max_reqs, 1] as V2 keeps it

    drafts = spec.propose(batch, None, None, None, aux, None, None, last_sampled)

    assert seen["context"][1].tolist() == [3.0, 3.0] and seen["context"][3].tolist() == [3.0, 3.0]
    assert spec.accepted_path_moves is None
    ids, lps = top_tokens(logits, k)
    want = tree_from_top_tokens(ids.view(2, depth, k), lps.view(2, depth, k), torch.tensor([104, 101]), budget)
    assert torch.equal(drafts, want.token_ids[:, 1:])
    assert torch.equal(spec.tree_parents[[4, 1]], want.parents) and torch.equal(spec.tree_depths[[4, 1]], want.depths)
    assert (spec.tree_parents[[0, 2, 3, 5]] == -7).all()  # other slots untouched


@pytest.mark.parametrize("num_drafts", [6, 3, 1])  # the whole tree (B = 6), and prefixes of it
def test_uniform_step_layout_equals_the_general_one(num_drafts):
    """V2's decode steps take `build_uniform_tree_step` (per-shape constants, the kept trees by request slot read
    through V2's int32 idx_mapping, nothing from the host): the same TreeStep and positions as `build_tree_step`,
    also when each request verifies only its tree's first n nodes (`num_speculative_tokens_per_batch_size`)."""
    from vllm_ddtree.tree import build_draft_tree
    from vllm_ddtree.verify.step import UniformStepLayouts, build_tree_step, build_uniform_tree_step

    budget, num_reqs, num_slots = 6, 3, 5
    width, num_nodes = budget + 1, num_drafts + 1
    gen = torch.Generator().manual_seed(0)
    kept = build_draft_tree(torch.randn(num_slots, 4, 20, generator=gen) * 2, torch.arange(num_slots), budget)
    slots = torch.tensor([4, 0, 2], dtype=torch.int32)
    logits_indices = (torch.arange(num_reqs * num_nodes) + 3).to(torch.int32)  # three prefill tokens first
    general_positions = torch.randint(0, 300, (num_reqs * num_nodes + 3,), generator=gen)
    uniform_positions = general_positions.clone()
    general = build_tree_step([num_drafts] * num_reqs, logits_indices, kept.parents, kept.depths, slots.tolist(),
                              width, positions=general_positions)  # fmt: skip
    layouts = UniformStepLayouts(width, torch.device("cpu"))
    for _ in range(2):  # the second step reuses the shape's constants
        positions = uniform_positions.clone()
        uniform = build_uniform_tree_step(layouts, num_reqs, logits_indices, kept.parents, kept.depths, slots,
                                          positions=positions, num_nodes=num_nodes)  # fmt: skip
        for field in ("num_nodes", "parents", "depths", "node_rows", "node_token_index", "tree_reqs",
                      "num_walk_nodes"):  # fmt: skip
            assert torch.equal(getattr(uniform, field), getattr(general, field)), field
        assert np.array_equal(uniform.num_nodes_cpu, general.num_nodes_cpu)
        assert np.array_equal(uniform.tree_reqs_cpu, general.tree_reqs_cpu)
        assert torch.equal(positions, general_positions)


def test_capture_attaches_trees_to_every_uniform_verification_length():
    """With `num_speculative_tokens_per_batch_size`, V2 captures uniform FULL graphs for each draft length n + 1
    <= B + 1: each must hold tree attention (a graph captured without it would replay causal attention for trees).
    One-token and mixed batches hold none."""
    from vllm_ddtree.runner_v2 import uniform_verification_nodes

    def batch(tokens_per_req):
        counts = np.asarray(tokens_per_req, dtype=np.int32)
        return SimpleNamespace(num_reqs=len(counts), num_tokens=int(counts.sum()), num_scheduled_tokens=counts)

    width = 17
    assert uniform_verification_nodes(batch([17] * 4), width) == 17
    assert uniform_verification_nodes(batch([6] * 3), width) == 6
    assert uniform_verification_nodes(batch([2]), width) == 2
    assert uniform_verification_nodes(batch([1] * 8), width) is None  # plain decodes
    assert uniform_verification_nodes(batch([6, 6, 3]), width) is None  # mixed
    assert uniform_verification_nodes(batch([32, 32]), width) is None  # a prefill longer than any tree


def test_chain_profile_marks_the_phases_ddtree_marks_and_passes_everything_through(monkeypatch):
    """VLLM_DDTREE_PROFILE_CHAIN=1 (bench_step.py's `dflash` engine): the chain's attention metadata, rejection
    sampler and DFlash pass are marked with DDTree's phase names, around V2's own calls, whose results come back
    unchanged; capture-time metadata is not marked. Only vLLM's DFlash engines get it, and only on request."""
    from vllm_ddtree import runner_v2

    marks = []
    timer = SimpleNamespace(mark=marks.append)
    runner = SimpleNamespace(
        model_state=SimpleNamespace(prepare_attn=lambda batch, for_capture=False: ("metadata", batch, for_capture)),
        rejection_sampler=lambda logits, batch, draft_logits=None: ("sampled", logits),
        speculator=SimpleNamespace(propose=lambda *args, **kwargs: "draft tokens"),
    )
    runner_v2._mark_chain_phases(runner, timer)

    assert runner.model_state.prepare_attn("b", for_capture=True) == ("metadata", "b", True)
    assert marks == []
    assert runner.model_state.prepare_attn("b") == ("metadata", "b", False)
    assert runner.rejection_sampler("logits", "b", draft_logits=None) == ("sampled", "logits")
    assert runner.speculator.propose("b", last_sampled=1) == "draft tokens"
    assert marks == ["vllm_attention_metadata", "verify_forward", "rejection_sampler", "vllm_sampler_output", "draft"]
    runner_v2._mark_chain_phases(runner, timer)  # a second load_model: the speculator (kept) is not marked twice
    marks.clear()
    runner.speculator.propose("b")
    assert marks == ["vllm_sampler_output", "draft"]

    def config(method):
        return SimpleNamespace(speculative_config=None if method is None else SimpleNamespace(method=method))

    monkeypatch.setenv(runner_v2.CHAIN_PROFILE_ENV, "1")
    assert runner_v2._chain_profile_requested(config("dflash"), None)
    assert not runner_v2._chain_profile_requested(config("dflash"), {"budget": 15})  # DDTree has its own marks
    assert not runner_v2._chain_profile_requested(config("eagle3"), None)
    assert not runner_v2._chain_profile_requested(config(None), None)
    monkeypatch.delenv(runner_v2.CHAIN_PROFILE_ENV)
    assert not runner_v2._chain_profile_requested(config("dflash"), None)


def test_in_graph_tree_build_gives_the_trees_built_after_the_pass(monkeypatch):
    """"tree_in_graph": true: the tree build runs inside `sample_draft` (the drafter's graph), with each row's
    request slot from V2's sample_idx_mapping and the roots from V2's last_sampled buffer. The trees, slot rows and
    returned nodes equal the build after the pass; the graph's padding requests (slot -1) write only the scratch
    slot."""
    from vllm_ddtree import speculator_v2
    from vllm_ddtree.speculator_v2 import DDTreeSpeculator
    from vllm_ddtree.tree.build import top_tokens, tree_from_top_tokens

    budget, depth, vocab, k, max_reqs = 5, 3, 30, 5, 6
    padded = 3  # the drafter's graph for 3 requests replayed for 2: the third is padding
    logits = torch.randn(padded * depth, vocab, generator=torch.Generator().manual_seed(3)) * 3
    slots_of_rows = torch.tensor([4] * depth + [1] * depth + [-1] * depth, dtype=torch.int32)  # V2's sample_idx_mapping

    def dflash_propose(self, input_batch, *args, **kwargs):
        positions = torch.zeros(padded * depth, dtype=torch.int64)
        self.sample_draft(logits, positions, slots_of_rows, None, None, None, None)  # V2's positional call

    monkeypatch.setattr(speculator_v2.DFlashSpeculator, "propose", dflash_propose)
    spec = object.__new__(DDTreeSpeculator)
    spec.model = SimpleNamespace(compute_logits=lambda h: h)
    spec.budget, spec.depth, spec.topk, spec.timer = budget, depth, k, step_timer(torch.device("cpu"))
    spec.max_num_reqs, spec.accepted_path_moves = max_reqs, None
    spec.top_token_ids = torch.zeros(max_reqs * depth, k, dtype=torch.int64)
    spec.top_log_probs = torch.zeros(max_reqs * depth, k)
    spec.tree_parents = torch.full((max_reqs + 1, budget + 1), -7, dtype=torch.int64)
    spec.tree_depths = torch.full((max_reqs + 1, budget + 1), -7, dtype=torch.int64)
    spec.tree_in_graph, spec.roots = True, (torch.arange(max_reqs)[:, None] + 100).view(-1)  # V2's buffer, flat
    spec.roots_and_scratch = torch.zeros(max_reqs + 1, dtype=torch.int64)
    spec.tree_tokens = torch.full((max_reqs, budget + 1), -3, dtype=torch.int64)
    batch = SimpleNamespace(num_reqs=2, idx_mapping=torch.tensor([4, 1], dtype=torch.int32))

    drafts = spec.propose(batch, None, None, torch.zeros(8, 2), [], None, None, spec.roots[:, None])

    ids, lps = top_tokens(logits, k)
    want = tree_from_top_tokens(ids[: 2 * depth].view(2, depth, k), lps[: 2 * depth].view(2, depth, k),
                                torch.tensor([104, 101]), budget)  # fmt: skip
    assert torch.equal(drafts, want.token_ids[:, 1:])
    assert torch.equal(spec.tree_parents[[4, 1]], want.parents) and torch.equal(spec.tree_depths[[4, 1]], want.depths)
    assert (spec.tree_parents[[0, 2, 3, 5]] == -7).all()  # other live slots untouched
    assert (spec.tree_parents[max_reqs] != -7).any()  # the padding request's tree went to the scratch slot


@pytest.mark.parametrize("num_nodes", [7, 4])  # the whole tree (B = 6), and the first 4 nodes of each
def test_layout_in_graph_writes_what_the_host_path_writes(num_nodes, monkeypatch):
    """"layout_in_graph": true. While a uniform verification batch's FULL graph is captured, the target's forward
    first lays out the step from fixed-address buffers (`GraphStepLayouts`); a step that replays that graph only
    copies its request slots in. Replaying (here: running the same forward again) gives the TreeStep, positions and
    tree-attention inputs of the host path (`build_uniform_tree_step` + the metadata builder); padding requests get
    zero masks and node counts. A uniform batch with a prefill chunk of n tokens, laid out on the host, makes the
    graph write the host's layout too (the chunk a chain, its positions kept). Other graph modes and shapes keep
    the host path, and a PIECEWISE capture records nothing."""
    from vllm_ddtree import compat, runner_v2
    from vllm_ddtree.attention.metadata import PersistentTreeBuffers, TreeAttentionMetadataBuilder
    from vllm_ddtree.runner_v2 import DDTreeV2State, _lay_out_steps_in_target_graphs, _wrap_model_state_prepare_attn
    from vllm_ddtree.tree import build_draft_tree
    from vllm_ddtree.verify.step import GraphStepLayouts, UniformStepLayouts, build_tree_step, build_uniform_tree_step

    FULL, PIECEWISE = SimpleNamespace(name="FULL"), SimpleNamespace(name="PIECEWISE")  # V2's CUDAGraphMode
    budget, max_reqs, num_reqs, padded = 6, 8, 3, 4
    width, cpu = budget + 1, torch.device("cpu")
    gen = torch.Generator().manual_seed(5)
    kept = build_draft_tree(torch.randn(max_reqs + 1, 4, 20, generator=gen) * 2, torch.arange(max_reqs + 1), budget)
    speculator = SimpleNamespace(tree_parents=kept.parents, tree_depths=kept.depths)  # [max_reqs + 1, N] by slot
    slots = torch.tensor([5, 0, 2], dtype=torch.int32)  # V2's idx_mapping
    forward_mode = {"name": None}  # the forward context's cudagraph mode (None: no context)
    monkeypatch.setattr(compat, "forward_cudagraph_mode_name", lambda: forward_mode["name"])
    monkeypatch.setattr(runner_v2, "_stream_capturing", lambda: forward_mode["name"] == "NONE")

    def new_state():
        state = DDTreeV2State(budget=budget, depth=3)
        state.timer = step_timer(cpu)
        state.uniform_layouts = UniformStepLayouts(width, cpu)
        state.graph_layouts = GraphStepLayouts(state.uniform_layouts, max_reqs, cpu)
        buffers = PersistentTreeBuffers.allocate(max_reqs, width, cpu)
        state.attention = TreeAttentionMetadataBuilder({"target.0"}, buffers)
        return state

    seq_lens = torch.tensor([40, 55, 23, 0], dtype=torch.int32)  # V2's persistent buffer; the 4th is padding
    roots = torch.tensor([30, 45, 13, 0])
    chain = (roots[:, None] + torch.arange(num_nodes)).flatten()  # [P * n] V2's positions: root + node index
    chain[num_reqs * num_nodes:] = 777  # the padding request's tokens
    query_start_loc = torch.arange(padded + 1, dtype=torch.int32) * num_nodes
    backend = SimpleNamespace(seq_lens=seq_lens, query_start_loc=query_start_loc, max_seq_len=55,
                              block_table=torch.zeros(padded, 4, dtype=torch.int32))  # fmt: skip
    batch = SimpleNamespace(num_tokens=num_reqs * num_nodes, num_reqs=num_reqs, idx_mapping=slots,
                            num_scheduled_tokens=np.array([num_nodes] * num_reqs))  # fmt: skip

    def install(state):
        model_state = SimpleNamespace(prepare_attn=lambda batch, *a, for_capture=False, **k: {"target.0": backend})
        _wrap_model_state_prepare_attn(model_state, state, cpu)
        seen = []
        model = SimpleNamespace(forward=lambda input_ids=None, positions=None: seen.append(positions.clone()))
        _lay_out_steps_in_target_graphs(model, state, speculator)
        return model_state, model, seen

    def deferred(state, positions):  # what the runner's prepare_attn hook leaves for a uniform step
        return (state.uniform_layouts, num_reqs, torch.arange(num_reqs * num_nodes), kept.parents, kept.depths, slots,
                positions, num_nodes)  # fmt: skip

    def tree_inputs(state):
        buffers = state.attention.persistent
        return [buffers.node_mask[:padded], buffers.num_nodes[:padded], buffers.context_lens[:padded]]

    # The host path: the step and the persistent tree inputs of a PIECEWISE step.
    host = new_state()
    host_model_state, _, _ = install(host)
    host_positions = chain.clone()
    host.deferred = deferred(host, host_positions)
    host_model_state.prepare_attn(batch, PIECEWISE)
    assert not host.step_in_graph and host.deferred is None
    want_step = build_uniform_tree_step(*deferred(host, chain.clone()))

    # Captures: a PIECEWISE graph of the same shape records nothing, the uniform verification FULL graph of
    # P = 4 requests of n nodes records the layout.
    state = new_state()
    model_state, model, seen = install(state)
    positions = chain.clone()  # the persistent positions buffer
    capture = SimpleNamespace(num_tokens=padded * num_nodes, num_reqs=padded,
                              num_scheduled_tokens=np.array([num_nodes] * padded))  # fmt: skip
    model_state.prepare_attn(capture, FULL, for_capture=True)
    forward_mode["name"] = "PIECEWISE"
    model.forward(input_ids=None, positions=positions)
    assert not state.graph_layouts.captured and torch.equal(positions, chain)
    forward_mode["name"] = "NONE"  # V2 records a FULL graph running the forward in mode NONE
    model.forward(input_ids=None, positions=positions)
    assert state.graph_layouts.captured == {(padded, num_nodes)}

    # A step that replays it: slots copied in, then the graph (the same forward) lays the step out.
    positions.copy_(chain)
    state.deferred = deferred(state, positions)
    model_state.prepare_attn(batch, FULL)
    assert state.step_in_graph and state.step.parents.data_ptr() == state.graph_layouts.parents.data_ptr()
    model.forward(input_ids=None, positions=positions)
    assert torch.equal(seen[-1], host_positions)  # the forward sees the tree positions, the padding's untouched
    for field in ("num_nodes", "parents", "depths", "node_rows", "node_token_index", "tree_reqs", "num_walk_nodes"):
        assert torch.equal(getattr(state.step, field), getattr(want_step, field)), field
    for got, want in zip(tree_inputs(state), tree_inputs(host)):
        assert torch.equal(got, want)

    # A uniform batch whose second request is a prefill chunk of n tokens (no drafts), replaying the same graph:
    # laid out on the host (its tree inputs as the host path writes them), and the graph writes the same.
    mixed_positions = chain.clone()
    logits_indices = torch.cat([torch.arange(num_nodes), torch.arange(2 * num_nodes - 1, 3 * num_nodes)])  # 1 row
    mixed_step = build_tree_step([num_nodes - 1, 0, num_nodes - 1], logits_indices, kept.parents, kept.depths,
                                 slots.tolist(), width, positions=mixed_positions)  # fmt: skip
    for target_state in (host, state):
        target_state.step, target_state.step_in_graph = mixed_step, False
        (host_model_state if target_state is host else model_state).prepare_attn(batch, FULL)
    assert state.graph_layouts.slots[:padded].tolist() == [5, -2, 2, -1]
    assert torch.equal(tree_inputs(host)[0][1].bool(), torch.ones(width, width).tril().bool())  # the chunk: causal
    positions.copy_(mixed_positions)
    model.forward(input_ids=None, positions=positions)
    assert torch.equal(positions, mixed_positions)  # the chunk's positions kept, the trees' as the host set them
    for got, want in zip(tree_inputs(state), tree_inputs(host)):
        assert torch.equal(got, want)

    # A FULL step of a shape whose graph lays out nothing, and a piecewise one: the host path.
    for mode, backend.seq_lens in ((FULL, torch.cat([seq_lens, seq_lens.new_zeros(4)])), (PIECEWISE, seq_lens)):
        state.step, state.deferred = None, deferred(state, chain.clone())
        model_state.prepare_attn(batch, mode)
        assert not state.step_in_graph and state.step.parents.data_ptr() != state.graph_layouts.parents.data_ptr()

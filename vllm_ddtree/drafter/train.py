"""Train a DFlash drafter on the target's own responses, the way DFlash trains.

Stages (each a small function):
    prompts -> ``encode_prompts``       token ids (chat template when the tokenizer has one)
            -> ``generate_responses``   the target answers them (greedy or sampled); cached in OUT/responses.jsonl
            -> ``sample_blocks``        random anchors in each response; block = [anchor token, mask, ..., mask]
            -> ``target_features``      target hidden states after ``target_layer_ids`` (HF, output_hidden_states;
                                        once per answer into a ``FeatureStore`` where it fits)
            -> ``block_loss``           cross-entropy at block offsets 1..S-1 against the target's tokens
    checkpoints in OUT/checkpoints/step-N (``resume=True`` continues from the newest), the final drafter in
    OUT/drafter (vLLM: ``speculative_config={"method": "dflash", "model": "OUT/drafter", ...}``).
``simulate_acceptance`` (drafter/simulate.py) replays greedy speculative decoding in pure torch: the acceptance length
vLLM should report.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from vllm_ddtree.drafter.features import (
    FeatureStore,
    TargetOutputs,
    padded_length,
    store_budget,
    target_features,
    target_outputs,
)
from vllm_ddtree.drafter.generate import VllmGenerator, generate_responses, past
from vllm_ddtree.drafter.lm_head_loss import lm_head_cross_entropy
from vllm_ddtree.drafter.model import DFlashDrafter, DrafterConfig
from vllm_ddtree.drafter.self_prompts import written_prompts
from vllm_ddtree.drafter.simulate import simulate_acceptance

IGNORE = -100


@dataclass
class TrainConfig:
    target: str  # Hugging Face folder of the target (Llama or Qwen3 architecture)
    out: str  # output folder: responses.jsonl, checkpoints/, drafter/
    block_size: int = 16
    num_layers: int = 1
    target_layer_ids: list[int] | None = None  # default: spread over the target's depth
    mask_token_id: int | None = None  # default: tokenizer's mask/unk token, else the last id
    sources: tuple[str, ...] = ("sharegpt", "mtbench", "humaneval")
    num_prompts: int = 2000
    max_prompt_len: int = 256
    max_new_tokens: int = 256
    temperature: float = 0.0  # of the target's responses; 0 = greedy
    responses_per_prompt: int = 1  # answers per prompt (more data from few prompts); > 1 needs temperature > 0
    greedy_first: bool = False  # the first answer of each prompt greedy, the others at `temperature`
    # More answers at `temperature`: rounds of one answer per prompt, after the responses_per_prompt answers of
    # every prompt, so answers generated before (e.g. carried from an earlier session) keep their places.
    extra_answer_rounds: int = 0
    # More prompts: every later user turn of the training conversations (`data.later_turn_prompts`) answered once
    # (greedy with `greedy_first`), after all the answers above, so those keep their places too.
    later_turns: bool = False
    # More prompts still: this many user turns sampled from the target itself (`self_prompts.written_prompts`), the
    # usable ones answered once (greedy with `greedy_first`) after all the answers above. vLLM generator only.
    self_prompts: int = 0
    # The first sample's index: sample i is drawn with seed SEED + self_prompts_from + i. A later session sets it
    # past the samples the shipped drafter was trained on, so the target writes new prompts.
    self_prompts_from: int = 0
    gen_batch_size: int = 64
    generator: str = "hf"  # "hf" (transformers) or "vllm"
    # vllm generator on CUDA: decode steps replay FULL CUDA graphs (no torch.compile), prompts in waves of
    # GRAPH_WAVE (`generate.VllmGenerator`); off (the default, every run so far): eager
    gen_cuda_graphs: bool = False
    # vllm generator: engines answering side by side, each in its own process with an equal share of the GPU
    # memory; chunks go to whichever engine is free. One engine is bound by the host's work per request
    # (~30k tok/s for SmolLM2 on the H200 with or without CUDA graphs, session 36), not by the GPU.
    gen_engines: int = 1
    chat_template: bool = True
    steps: int = 2000
    batch_size: int = 16  # sequences per step
    anchors_per_seq: int = 32
    lr: float = 1e-3
    warmup_steps: int = 100
    # With `time_limit_s`: the cosine also follows the clock and reaches its floor at the time limit, so a run the
    # limit ends is annealed (`LearningRate`). Device runs stopped at 39-63% of their steps (sessions 45, 46), with
    # the learning rate still at 34-70% of its peak.
    anneal_at_time_limit: bool = False
    weight_decay: float = 0.0
    loss_decay: float | None = None  # gamma: weight of offset k is exp(-(k - 1) / gamma); None = uniform
    save_every: int = 500
    eval_every: int = 250  # held-out loss / first-offset accuracy every N steps (0: never)
    eval_prompts: int = 16
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"  # of the target: "auto" = bfloat16 on GPU, float32 on CPU
    save_dtype: str = "bfloat16"  # of the final drafter's weights (checkpoints keep float32)
    resume: bool = False
    # A saved drafter folder (e.g. the shipped one) to start from instead of random weights: its architecture
    # (block size, layers, target layers, mask token) is kept and must fit the target; `resume` wins over it.
    # A `num_layers` above its layer count adds identity-initialised layers (`DFlashDrafter.add_layers`).
    init_from: str | None = None
    # Seconds since `train` started (target loading and answer generation included) after which the loop stops
    # and the run ends as at its last step: drafter saved, held-out point, report (`stopped_at` says where).
    # For device calls with a hard time bound (scripts/gpu_train.sh). None: run every step.
    time_limit_s: float | None = None
    # Run the target over every answer once before the first step and keep the features on the device
    # (``FeatureStore``) where they fit, instead of a target forward per step.
    feature_store: bool = True
    # Soft labels: the target's `soft_labels` most probable next tokens at each label's position (renormalised) are
    # a second cross-entropy term of weight `soft_weight` (the hard label's weight is 1 - soft_weight). 0: hard only.
    soft_labels: int = 0
    soft_weight: float = 0.5
    # Profile this many training steps (after PROFILE_AFTER warm-up steps) with torch.profiler and write the
    # operators' own device (CPU: host) times to OUT/profile.txt: where a step's time goes, kernel by kernel. 0: off.
    profile_steps: int = 0
    # Run the training step's drafter forward and loss through torch.compile (dynamic shapes: one compilation for
    # every batch length). The first step compiles: ~45 s for a tiny drafter on this 2-core CPU, and on an H100
    # (session 47) no step had finished 2 min after it began. The held-out points stay eager.
    compile: bool = False


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] right-padded sequences (prompt + response)
    seq_lens: torch.Tensor  # [B]
    anchors: torch.Tensor  # [B, A] position of each block's first token
    block_ids: torch.Tensor  # [B, A, S] anchor token, then mask tokens
    labels: torch.Tensor  # [B, A, S - 1] target tokens at offsets 1..S-1 (IGNORE past the end / padded anchors)


@dataclass
class Sequence:
    prompt: list[int]
    response: list[int]
    meta: dict = field(default_factory=dict)

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.response


def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_target(path: str, device: torch.device, dtype: str = "auto"):
    """HF causal LM (frozen, eval mode; ``dtype`` "auto": bf16 on GPU, fp32 on CPU) and its tokenizer (or None)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"dtype={dtype!r}; expected 'auto', 'bfloat16' or 'float32'")
    dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval().requires_grad_(False)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        tokenizer = None
    return model, tokenizer


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """``num_features`` layer indices spread from layer 1 to the layer before last (DFlash's usual spread)."""
    if num_target_layers <= 2 or num_features == 1:
        return [max(0, (num_target_layers - 1) // 2)] if num_features == 1 else list(range(num_target_layers))
    lo, hi = 1, num_target_layers - 2
    num_features = min(num_features, hi - lo + 1)
    return sorted({round(lo + (hi - lo) * i / max(1, num_features - 1)) for i in range(num_features)})


def default_mask_token_id(tokenizer, vocab_size: int) -> int:
    for name in ("mask_token_id", "unk_token_id"):
        token_id = getattr(tokenizer, name, None) if tokenizer is not None else None
        if token_id is not None and 0 <= token_id < vocab_size:
            return token_id
    return vocab_size - 1


def make_drafter_config(target_config, cfg: TrainConfig, tokenizer) -> DrafterConfig:
    """Drafter shaped like one target layer (same hidden size, heads and MLP width); Qwen3 attention."""
    text = getattr(target_config, "text_config", None) or target_config
    num_target_layers = text.num_hidden_layers
    layer_ids = cfg.target_layer_ids or default_target_layer_ids(num_target_layers, min(5, max(1, num_target_layers)))
    rope = getattr(text, "rope_parameters", None) or {}
    rope_theta = rope.get("rope_theta") or getattr(text, "rope_theta", None) or 1_000_000.0
    heads = text.num_attention_heads
    mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else default_mask_token_id(tokenizer, text.vocab_size)
    return DrafterConfig(
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        vocab_size=text.vocab_size,
        block_size=cfg.block_size,
        mask_token_id=mask_id,
        target_layer_ids=list(layer_ids),
        num_target_layers=num_target_layers,
        rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        max_position_embeddings=getattr(text, "max_position_embeddings", 32768),
        extra={k: getattr(text, k) for k in ("bos_token_id", "eos_token_id") if getattr(text, k, None) is not None},
    )


def encode_prompts(tokenizer, prompts, chat_template: bool, max_prompt_len: int) -> list[list[int]]:
    """Token ids of each prompt (``Prompt`` records or strings); prompts longer than ``max_prompt_len`` are dropped."""
    encoded = []
    for prompt in prompts:
        text = getattr(prompt, "text", prompt)
        if chat_template and getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=True
            )["input_ids"]
        else:
            ids = tokenizer(text)["input_ids"]
        if 0 < len(ids) <= max_prompt_len:
            encoded.append(list(ids))
    return encoded


# The held-out prompts of the CPU drafter checks (scripts/compare_drafters.py, scripts/simulate_tree_acceptance.py).
CHECK_PROMPTS_PER_SOURCE = {"sharegpt": 8, "mtbench": 4, "humaneval": 4}
# The training runs' first-turn prompts (`--num-prompts` in scripts/gpu_train.sh).
TRAINED_PROMPTS = 16000


def check_prompt_ids(tokenizer, per_source: dict[str, int], max_prompt_len: int, split: str = "heldout"
                     ) -> list[list[int]]:  # fmt: skip
    """The first ``per_source[source]`` prompts of each source that fit ``max_prompt_len``, chat-templated and
    encoded as training encodes its prompts, source after source. ``split`` "heldout": held-out records (file
    order); "train": the first of the training runs' prompts (`data.train_prompts` in the order and number
    `scripts/gpu_train.sh` uses, 16,000 with seed 0), whose answers the shipped drafter was trained on. ValueError
    if a source's package is missing."""
    from vllm_ddtree.drafter.data import SOURCES, heldout_prompts, train_prompts

    if split not in ("heldout", "train"):
        raise ValueError(f"split={split!r}; expected 'heldout' or 'train'")
    trained = train_prompts(SOURCES, limit=TRAINED_PROMPTS, seed=0) if split == "train" else []
    ids = []
    for source, count in per_source.items():
        records = heldout_prompts(source) if split == "heldout" else [p for p in trained if p.source == source]
        ids += encode_prompts(tokenizer, records, True, max_prompt_len)[:count]
    return ids


def sample_blocks(
    seqs: list[Sequence], block_size: int, anchors_per_seq: int, mask_token_id: int, pad_id: int, rng: random.Random
) -> Batch:
    """Random anchors in each response (positions len(prompt) .. len - 2) and their blocks and labels.

    Labels are one gather from the padded sequences (the training loop's host work per step; it was ~1,000 small
    tensors per batch)."""
    B, S, A = len(seqs), block_size, anchors_per_seq
    T = padded_length(max(len(s.ids) for s in seqs))  # few distinct lengths: few cuDNN attention plans
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    anchors = torch.zeros((B, A), dtype=torch.long)
    has_anchor = torch.zeros((B, A), dtype=torch.bool)
    for b, seq in enumerate(seqs):
        ids = seq.ids
        input_ids[b, : len(ids)] = torch.tensor(ids)
        candidates = range(max(1, len(seq.prompt)), len(ids) - 1)
        chosen = sorted(rng.sample(candidates, min(A, len(candidates))))
        anchors[b, : len(chosen)] = torch.tensor(chosen, dtype=torch.long)
        has_anchor[b, : len(chosen)] = True
        # Padded anchors (too short a response) keep position 0 and IGNORE labels.
    seq_lens = torch.tensor([len(s.ids) for s in seqs])
    positions = anchors[:, :, None] + torch.arange(1, S)  # [B, A, S - 1] offsets 1..S-1 after each anchor
    in_sequence = (positions < seq_lens[:, None, None]) & has_anchor[:, :, None]
    labels = torch.gather(input_ids, 1, positions.clamp(max=T - 1).flatten(1)).view(B, A, S - 1)
    labels = torch.where(in_sequence, labels, IGNORE)
    block_ids = torch.full((B, A, S), mask_token_id, dtype=torch.long)
    block_ids[:, :, 0] = torch.gather(input_ids, 1, anchors)
    return Batch(input_ids, seq_lens, anchors, block_ids, labels)


def position_weights(block_size: int, gamma: float | None) -> torch.Tensor:
    """Loss weight of offsets 1..S-1: exp(-(k - 1) / gamma), or ones."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.ones_like(k) if gamma is None else torch.exp(-(k - 1) / gamma)


def block_loss(drafter: DFlashDrafter, batch: Batch, features: torch.Tensor, gamma: float | None,
               teacher: TargetOutputs | None = None, soft_weight: float = 0.0):
    """Weighted cross-entropy at offsets 1..S-1 against the labels, mixed with one against the teacher's top-k
    (``teacher``: the target's outputs for the batch's padded sequences) at weight ``soft_weight``; returns
    (loss, top-1 accuracy per offset [S - 1]). Hard labels alone go through `lm_head_cross_entropy` (no float32
    [B, A, S - 1, V] logits); the soft labels need the logits themselves."""
    device = features.device
    hidden = drafter(batch.block_ids.to(device), batch.anchors.to(device), features, batch.seq_lens.to(device))
    labels = batch.labels.to(device)
    valid = labels != IGNORE
    weights = position_weights(drafter.config.block_size, gamma).to(device) * valid  # [B, A, S - 1]
    if teacher is None or soft_weight == 0:  # hard labels: the fused LM head and cross-entropy
        shares = weights / weights.sum().clamp(min=1e-6)
        loss, correct = lm_head_cross_entropy(hidden[:, :, 1:].flatten(0, 2), drafter.lm_head_weight,
                                              labels.flatten(), shares.flatten())  # fmt: skip
        accuracy = correct.view(labels.shape).sum((0, 1)).float() / valid.sum((0, 1)).clamp(min=1)
        return loss, accuracy
    logits = drafter.logits(hidden[:, :, 1:]).float()  # [B, A, S - 1, V]
    log_z = logits.logsumexp(-1)  # [B, A, S - 1]
    ce = log_z - logits.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    ids, probs = teacher_at_labels(teacher, batch.anchors.to(device), drafter.config.block_size)  # [B, A, S - 1, k]
    q = probs / probs.sum(-1, keepdim=True).clamp(min=1e-9)
    soft_ce = log_z - (q * logits.gather(-1, ids.long())).sum(-1)
    ce = (1 - soft_weight) * ce + soft_weight * soft_ce
    loss = (ce * weights).sum() / weights.sum().clamp(min=1e-6)
    with torch.no_grad():
        correct = (logits.argmax(-1) == labels) & valid
        accuracy = correct.sum((0, 1)).float() / valid.sum((0, 1)).clamp(min=1)
    return loss, accuracy


def teacher_at_labels(teacher: TargetOutputs, anchors: torch.Tensor, block_size: int):
    """The target's top-k (ids, probs) for the token at each block offset k = 1..S-1: its prediction at position
    anchor + k - 1. [B, A, S - 1, k] each, from the batch's [B, T, k]."""
    B, A = anchors.shape
    T, k = teacher.top_ids.shape[1:]
    positions = (anchors[:, :, None] + torch.arange(block_size - 1, device=anchors.device)).clamp(max=T - 1)
    index = positions.flatten(1).unsqueeze(-1).expand(-1, -1, k)  # [B, A * (S - 1), k]
    return tuple(t.gather(1, index).view(B, A, block_size - 1, k) for t in (teacher.top_ids, teacher.top_probs))


class PhaseClock:
    """Milliseconds per phase of one training step in every `every` (0: never), with a device sync at each
    boundary of that step only, so the log says where a step's time goes (`laps` of the timed step)."""

    def __init__(self, device: torch.device, every: int):
        self.device, self.every = device, every
        self.on, self.laps, self._last = False, {}, 0.0

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self, step: int) -> None:
        self.on, self.laps = bool(self.every) and (step + 1) % self.every == 0, {}
        if self.on:
            self._last = self._now()

    def lap(self, name: str) -> None:
        if self.on:
            now = self._now()
            self.laps[name] = round((now - self._last) * 1e3, 2)
            self._last = now


PROFILE_AFTER = 20  # steps run before StepProfiler starts (compilation, allocator and autotuning warm-up)


class StepProfiler:
    """torch.profiler over training steps [first, first + steps): `tick(step)` before each step; the table of
    operators by their own device time (host time on the CPU) goes to `path` and to the log."""

    def __init__(self, device: torch.device, first: int, steps: int, path: Path):
        self.device, self.first, self.steps, self.path = device, first, steps, path
        self.profile = None

    def tick(self, step: int) -> None:
        if self.steps <= 0:
            return
        if step == self.first:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self.profile = profile(activities=activities)
            self.profile.__enter__()
        elif step == self.first + self.steps:
            self.finish(step)

    def finish(self, step: int) -> None:
        """Stop before `step` and write the table (also for a loop that ended inside the profiled steps)."""
        if self.profile is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.profile.__exit__(None, None, None)
        sort_by = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"  # kernels first
        table = self.profile.key_averages().table(sort_by=sort_by, row_limit=40, max_name_column_width=60)
        self.path.write_text(f"{step - self.first} training steps from step {self.first}, sorted by {sort_by}\n{table}")
        self.profile = None
        from tqdm.auto import tqdm

        for line in table.splitlines():
            tqdm.write(f"profile: {line}")


LR_FLOOR = 0.05  # the cosine's end, as a share of the peak learning rate


class LearningRate:
    """The learning-rate factor of each step: a linear warm-up over `warmup_steps`, then a cosine from 1 to LR_FLOOR
    over the run's progress. Progress is the step's share of `steps`; with `anneal_by` (a `clock()` deadline) it is
    the larger of that and the clock's share, which runs from the progress where `start` was called (this call's
    first step) to 1 at the deadline: a run its time limit ends still ends at the floor."""

    def __init__(self, warmup_steps: int, steps: int, anneal_by: float | None = None, clock=time.monotonic):
        self.warmup_steps, self.steps, self.anneal_by, self.clock = warmup_steps, steps, anneal_by, clock
        self.began: tuple[float, float] | None = None  # (clock, progress) where this call's training began

    def start(self, step: int) -> None:
        if self.anneal_by is not None:
            self.began = (self.clock(), self.step_progress(step))

    def step_progress(self, step: int) -> float:
        return min(1.0, max(0, step - self.warmup_steps) / max(1, self.steps - self.warmup_steps))

    def progress(self, step: int) -> float:
        progress = self.step_progress(step)
        if self.began is not None:
            began, progress_then = self.began
            share = min(1.0, (self.clock() - began) / max(self.anneal_by - began, 1e-9))
            progress = max(progress, progress_then + (1 - progress_then) * share)
        return progress

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        return LR_FLOOR + (1 - LR_FLOOR) * 0.5 * (1 + math.cos(math.pi * self.progress(step)))


def answer_plan(cfg: TrainConfig, prompt_ids: list[list[int]], later_prompt_ids: list[list[int]]
                ) -> tuple[list[list[int]], list[float]]:  # fmt: skip
    """The prompt and temperature of every answer, in the order of OUT/responses.jsonl: each prompt's
    `responses_per_prompt` answers, then the `extra_answer_rounds` rounds, then one answer per later-turn prompt.
    What is added later goes last, so a banked file stays a prefix of the plan."""
    K, rounds = cfg.responses_per_prompt, cfg.extra_answer_rounds
    temperatures = [answer_temperature(cfg, i % K) for i in range(len(prompt_ids) * K)]
    temperatures += [cfg.temperature] * (len(prompt_ids) * rounds)
    temperatures += [answer_temperature(cfg, 0)] * len(later_prompt_ids)
    return [p for p in prompt_ids for _ in range(K)] + prompt_ids * rounds + later_prompt_ids, temperatures


def _load_or_generate(cfg: TrainConfig, target, prompt_ids, later_prompt_ids, pad_id, eos_ids,
                      generator: VllmGenerator | None, deadline: float | None = None) -> list[Sequence]:  # fmt: skip
    """OUT/responses.jsonl caches the target's responses; generation resumes where the file stops. With the vLLM
    generator (`generator`, the run's engines; None with cfg.generator "hf"), a `deadline` (time.monotonic())
    reached before every answer is there raises `AnswersIncomplete`."""
    path = Path(cfg.out) / "responses.jsonl"
    seqs = []
    if path.exists():
        seqs = [Sequence(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
    prompt_ids, temperatures = answer_plan(cfg, prompt_ids, later_prompt_ids)
    stray = next((i for i, seq in enumerate(seqs) if i >= len(prompt_ids) or seq.prompt != prompt_ids[i]), None)
    if stray is not None:
        raise ValueError(
            f"{path}: answer {stray} of {len(seqs)} belongs to another prompt than this run's answer {stray} "
            f"({len(prompt_ids)} planned): the file was made with other settings (num_prompts, max_prompt_len, "
            "responses_per_prompt, extra_answer_rounds, later_turns, sources, seed); run with those, or another --out"
        )
    todo, done = prompt_ids[len(seqs) :], len(seqs)
    if todo:
        if cfg.generator == "vllm":
            _write_answers(path, seqs, todo, generator.answer(todo, cfg.max_new_tokens, temperatures[done:],
                                                              cfg.seed + done, deadline=deadline))  # fmt: skip
        else:
            if len(set(temperatures[done:])) > 1:
                raise ValueError("greedy_first with the 'hf' generator is not supported; use generator='vllm'")
            _write_answers(path, seqs, todo, [generate_responses(target, todo, cfg.max_new_tokens, temperatures[-1],
                                                                  cfg.gen_batch_size, sorted(eos_ids), pad_id)])
    if len(seqs) < len(prompt_ids):
        raise AnswersIncomplete(
            f"time limit ({cfg.time_limit_s or 0:.0f} s) reached while the target answered the training prompts: "
            f"{len(seqs)} of {len(prompt_ids)} answers are in {path}; run the same command again (with --resume) "
            "to generate the rest and train, or lower --time-limit-s's share of generation with fewer prompts"
        )
    return [s for s in seqs if len(s.response) >= 2]


def _write_answers(path: Path, seqs: list[Sequence], todo: list[list[int]], chunks) -> None:
    """Append each chunk of answers to `todo`'s prompts (after the `seqs` already there) to `seqs` and to `path`."""
    done = len(seqs)
    for responses in chunks:
        with path.open("a") as f:
            for prompt, response in zip(todo[len(seqs) - done :], responses):
                seq = Sequence(prompt, response)
                seqs.append(seq)
                f.write(json.dumps(asdict(seq)) + "\n")


def vllm_generator(cfg: TrainConfig, eos_ids) -> VllmGenerator:
    """The run's vLLM engines (started at their first answer), sized for both the prompts the target writes
    (`max_prompt_len` new tokens) and its answers to prompts of up to `max_prompt_len` tokens."""
    return VllmGenerator(cfg.target, cfg.max_prompt_len + max(cfg.max_new_tokens, cfg.max_prompt_len), eos_ids,
                         seed=cfg.seed, cuda_graphs=cfg.gen_cuda_graphs, engines=cfg.gen_engines)  # fmt: skip


class AnswersIncomplete(RuntimeError):
    """The time limit came before the target had answered every training prompt (the answers so far are kept)."""


def answer_temperature(cfg: TrainConfig, answer: int) -> float:
    """Temperature of a prompt's answer number ``answer`` (0-based): greedy for the first with ``greedy_first``."""
    return 0.0 if cfg.greedy_first and answer == 0 else cfg.temperature


def _latest_checkpoint(out: Path) -> Path | None:
    ckpts = sorted((out / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    return ckpts[-1] if ckpts else None


def _save_checkpoint(out: Path, step: int, drafter, optimizer, scheduler, rng: random.Random, curve: list) -> None:
    final = out / "checkpoints" / f"step-{step}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    drafter.save(tmp / "drafter")
    state = {"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
             "rng": rng.getstate(), "torch_rng": torch.get_rng_state(), "heldout_curve": curve}
    torch.save(state, tmp / "trainer.pt")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in sorted((out / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))[:-2]:
        shutil.rmtree(old, ignore_errors=True)  # keep the newest two


def train(cfg: TrainConfig, prompts=None, prompt_ids: list[list[int]] | None = None,
          eval_prompt_ids: list[list[int]] | None = None, later_prompt_ids: list[list[int]] | None = None) -> Path:
    """Train a drafter for ``cfg.target``; return the folder vLLM loads as a DFlash drafter (OUT/drafter).

    Prompts: ``prompt_ids`` (token ids) if given, else ``prompts`` (``Prompt`` records or strings), else
    ``cfg.num_prompts`` training prompts of ``cfg.sources``. With ``cfg.later_turns``: ``later_prompt_ids`` if
    given, else the later user turns of ``cfg.sources`` (`data.later_turn_prompts`). Evaluation (simulated
    acceptance length) runs on ``eval_prompt_ids`` or on held-out prompts.
    """
    from tqdm.auto import tqdm

    from vllm_ddtree.drafter import data

    began = time.monotonic()
    if cfg.soft_labels < 0 or not 0 <= cfg.soft_weight <= 1:
        raise ValueError(f"soft_labels={cfg.soft_labels}, soft_weight={cfg.soft_weight}: soft_labels is a number of "
                         "top tokens (>= 0; 0 = hard labels only) and soft_weight a weight in [0, 1]")
    if cfg.extra_answer_rounds < 0 or (cfg.extra_answer_rounds and cfg.temperature <= 0):
        raise ValueError(f"extra_answer_rounds={cfg.extra_answer_rounds} needs to be 0, or > 0 with temperature > 0 "
                         f"(got temperature={cfg.temperature}): greedy answers to one prompt are all the same")
    if cfg.self_prompts < 0 or (cfg.self_prompts and cfg.generator != "vllm"):
        raise ValueError(f"self_prompts={cfg.self_prompts} with generator={cfg.generator!r}: it needs to be 0, or > 0 "
                         "with generator='vllm' (the target writes its prompts with vLLM)")
    if cfg.self_prompts_from < 0:
        raise ValueError(f"self_prompts_from={cfg.self_prompts_from}: the first self-written prompt's index is >= 0")
    if cfg.gen_engines < 1 or (cfg.gen_engines > 1 and cfg.generator != "vllm"):
        raise ValueError(f"gen_engines={cfg.gen_engines} with generator={cfg.generator!r}: it needs to be 1, or > 1 "
                         "with generator='vllm' (engines side by side are vLLM engines)")
    if cfg.responses_per_prompt < 1 or (cfg.responses_per_prompt > 1 and cfg.temperature <= 0):
        raise ValueError(
            f"responses_per_prompt={cfg.responses_per_prompt} needs to be 1, or > 1 with temperature > 0 "
            f"(got temperature={cfg.temperature}): greedy answers to one prompt are all the same"
        )
    if cfg.anneal_at_time_limit and cfg.time_limit_s is None:
        raise ValueError("anneal_at_time_limit=True needs time_limit_s (the time at which the learning rate reaches "
                         "its floor); set both, or leave anneal_at_time_limit off to anneal over `steps`")
    device = pick_device(cfg.device)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    target, tokenizer = load_target(cfg.target, device, cfg.dtype)
    text_config = getattr(target.config, "text_config", None) or target.config
    pad_id, eos_ids = _special_ids(target, tokenizer)
    if prompt_ids is None and prompts is None:
        prompts = data.train_prompts(cfg.sources, limit=cfg.num_prompts, seed=cfg.seed)

    ckpt = _latest_checkpoint(out) if cfg.resume else None
    if ckpt is not None:
        drafter = DFlashDrafter.load(ckpt / "drafter", device)
    elif cfg.init_from:
        drafter = DFlashDrafter.load(cfg.init_from, device)
        _check_fits_target(drafter, text_config, cfg.init_from)
        if cfg.num_layers > len(drafter.layers):
            print(f"init_from: {len(drafter.layers)} -> {cfg.num_layers} layers (new ones start as the identity)")
            drafter.add_layers(cfg.num_layers)
    else:
        drafter = DFlashDrafter(make_drafter_config(text_config, cfg, tokenizer)).to(device)
        _init_from_target(drafter, target)
    drafter.attach_target(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    (out / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")

    deadline = None if cfg.time_limit_s is None else began + cfg.time_limit_s
    # One set of vLLM engines writes the prompts and then the answers. A run without answers yet starts them now,
    # so that they build while the prompts are encoded (~30 s for session 47's plan); otherwise at the first answer.
    with vllm_generator(cfg, eos_ids) if cfg.generator == "vllm" else contextlib.nullcontext() as generator:
        if generator is not None and not (out / "responses.jsonl").exists():
            generator.start()
        later = []
        if cfg.later_turns:
            later = later_prompt_ids if later_prompt_ids is not None else encode_prompts(
                tokenizer, data.later_turn_prompts(cfg.sources, seed=cfg.seed), cfg.chat_template, cfg.max_prompt_len)
        if prompt_ids is None:
            prompt_ids = encode_prompts(tokenizer, prompts, cfg.chat_template, cfg.max_prompt_len)
        if cfg.self_prompts:
            written = written_prompts(cfg, tokenizer, eos_ids, generator, deadline)
            later = later + encode_prompts(tokenizer, written, cfg.chat_template, cfg.max_prompt_len)
            print(f"self_prompts: {len(written)} usable of {cfg.self_prompts} written by the target", flush=True)
        seqs = _load_or_generate(cfg, target, prompt_ids, later, pad_id, eos_ids, generator, deadline)
    if not seqs:
        raise ValueError("the target produced no response of 2 or more tokens; check the prompts and EOS ids")
    eval_seqs = _eval_sequences(cfg, target, tokenizer, eval_prompt_ids, pad_id, eos_ids)

    optimizer = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    learning_rate = LearningRate(cfg.warmup_steps, cfg.steps, deadline if cfg.anneal_at_time_limit else None)
    # A plain function (not the object): LambdaLR's checkpointed state would restore an object's deadline.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: learning_rate(step))
    start = 0
    if ckpt is not None:
        state = torch.load(ckpt / "trainer.pt", weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"])
        start = state["step"]

    layer_ids = drafter.config.target_layer_ids
    use_bf16 = device.type == "cuda" and target.dtype == torch.bfloat16
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if use_bf16 else contextlib.nullcontext()
    passes_per_step = min(cfg.batch_size, len(seqs)) / len(seqs)
    passes = cfg.steps * passes_per_step
    if passes > 4:
        print(f"warning: {cfg.steps} steps x {cfg.batch_size} sequences = {passes:.0f} passes over {len(seqs)} "
              "responses: the drafter may memorise them (watch the held-out loss); add prompts or cut steps")
    heldout_batch = None
    if eval_seqs and cfg.eval_every:
        heldout_batch = sample_blocks(eval_seqs[: cfg.batch_size], drafter.config.block_size, cfg.anchors_per_seq,
                                      drafter.config.mask_token_id, pad_id, random.Random(cfg.seed + 1))
    curve: list[dict] = list(state.get("heldout_curve", [])) if ckpt is not None else []  # kept across resumes

    def heldout_point(step: int, loss: torch.Tensor | None, resumed: bool = False) -> None:
        with torch.no_grad(), autocast:
            features = target_features(target, heldout_batch.input_ids.to(device), heldout_batch.seq_lens.to(device),
                                       layer_ids)
            val_loss, val_accuracy = block_loss(drafter, heldout_batch, features, cfg.loss_decay)
        point = {"step": step, "train_loss": None if loss is None else round(loss.item(), 4),
                 "heldout_loss": round(val_loss.item(), 4), "heldout_acc1": round(val_accuracy[0].item(), 4)}
        if resumed:  # logged, not added: the checkpoint's curve has this step already
            point["resumed"] = True
        else:
            curve.append(point)
        tqdm.write(json.dumps(point))

    store = None  # no steps left (steps=0, or resumed at the end): no features needed
    if start < cfg.steps:
        store = _feature_store(cfg, target, seqs, layer_ids, pad_id, text_config.hidden_size, deadline)
    if heldout_batch is not None and start == 0 and cfg.init_from:  # where a run from a saved drafter begins
        heldout_point(0, None)
    if heldout_batch is not None and start > 0:
        # Where a resumed run begins, measured again: session 20's resumed run was 0.1 above its checkpoint's point
        # 250 steps later, and this line tells a changed measurement from a changed drafter.
        heldout_point(start, None, resumed=True)
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="training", unit="step")
    clock = PhaseClock(device, every=cfg.eval_every)
    step_loss = torch.compile(block_loss, dynamic=True) if cfg.compile else block_loss
    learning_rate.start(start)
    profiler = StepProfiler(device, start + PROFILE_AFTER, cfg.profile_steps, out / "profile.txt")
    done = start  # steps completed
    stopped = None  # when the time limit ended training
    for step in bar:
        profiler.tick(step)
        clock.start(step)
        chosen = rng.sample(range(len(seqs)), min(cfg.batch_size, len(seqs)))  # the draws of rng.sample(seqs, ...)
        batch = sample_blocks([seqs[i] for i in chosen], drafter.config.block_size, cfg.anchors_per_seq,
                              drafter.config.mask_token_id, pad_id, rng)
        clock.lap("sample_blocks")
        if store is None:
            outputs = target_outputs(target, batch.input_ids.to(device), batch.seq_lens.to(device), layer_ids,
                                     cfg.soft_labels)  # fmt: skip
        else:
            outputs = store.gather(chosen, batch.input_ids.shape[1])
        clock.lap("target_features")
        with autocast:
            loss, accuracy = step_loss(drafter, batch, outputs.features, cfg.loss_decay,
                                       outputs if cfg.soft_labels else None, cfg.soft_weight)  # fmt: skip
        clock.lap("drafter_and_loss")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        clock.lap("backward")
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        clock.lap("optimizer")
        if clock.on:
            bar.write(json.dumps({"step": step + 1, "phase_ms": clock.laps}))
        if (step + 1) % 10 == 0 or step + 1 == cfg.steps:  # reading the loss waits for the GPU: not every step
            lr = scheduler.get_last_lr()[0]
            bar.set_postfix(dict(loss=f"{loss.item():.3f}", acc1=f"{accuracy[0].item():.2f}", lr=f"{lr:.1e}"))
        done = step + 1
        out_of_time = cfg.time_limit_s is not None and time.monotonic() - began > cfg.time_limit_s
        if heldout_batch is not None and (done % cfg.eval_every == 0 or done == cfg.steps or out_of_time):
            heldout_point(done, loss)
        if out_of_time:
            stopped = time.monotonic()
            bar.write(f"time limit {cfg.time_limit_s:.0f} s reached at step {done} of {cfg.steps}: saving")
            if cfg.save_every:  # a resumed run (the next device call) goes on from this step, not the last save
                _save_checkpoint(out, done, drafter, optimizer, scheduler, rng, curve)
            break
        if cfg.save_every and done % cfg.save_every == 0 and done < cfg.steps:
            _save_checkpoint(out, done, drafter, optimizer, scheduler, rng, curve)

    profiler.finish(done)
    final = drafter.save(out / "drafter", dtype=getattr(torch, cfg.save_dtype))
    report = {"steps": done, "final_loss": loss.item() if done > start else None,
              "responses": len(seqs), "passes": round(done * passes_per_step, 2),
              "final_lr": scheduler.get_last_lr()[0],
              "heldout_curve": curve}
    if done < cfg.steps:
        report["stopped_at"] = {"step": done, "of": cfg.steps, "time_limit_s": cfg.time_limit_s}
    if eval_seqs:
        report["simulated_acceptance_length"] = simulate_acceptance(drafter, target, eval_seqs)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    if stopped is not None:  # what a time limit must leave for the end (scripts/gpu_train.sh's FINAL_S)
        print(f"after the time limit: {time.monotonic() - stopped:.0f} s (checkpoint, drafter, held-out point, "
              "simulated acceptance, report)", flush=True)
    return final


def _feature_store(cfg: TrainConfig, target, seqs: list[Sequence], layer_ids: list[int], pad_id: int,
                   hidden_size: int, deadline: float | None = None) -> FeatureStore | None:
    """The answers' features computed once, where ``cfg.feature_store`` asks for it, they fit, and (with a time
    limit, ``deadline``) the build takes at most half the time left; else None (a target forward per step).
    Steps from the store run ~2x as fast (session 37: 8-11 steps/s without it on an H100, ~18.6 with it), so a
    build pays for itself once as much time is left after it to train. Session 46's T2 built one in 131 s with
    ~132 s left and trained one step from it; session 45's T1 built one past its limit, which the call's end threw
    away (the one step still run then needs none)."""
    if not cfg.feature_store:
        return None
    if past(deadline):
        print(f"feature store: skipped, the time limit ({cfg.time_limit_s:.0f} s) is past; the same command again "
              "resumes from the answers and builds it", flush=True)
        return None
    sequences = [s.ids for s in seqs]
    device = next(target.parameters()).device
    nbytes = FeatureStore.nbytes(sequences, len(layer_ids) * hidden_size, target.dtype, cfg.soft_labels)
    on_device, on_host, why = store_budget(device)
    if nbytes > on_device + on_host:
        print(f"feature store: off ({nbytes / 2**30:.1f} GiB against {why}); the target runs at every step")
        return None
    began = time.perf_counter()
    now = time.monotonic()
    build_by = None if deadline is None else now + (deadline - now) / 2
    store = FeatureStore.build(target, sequences, layer_ids, pad_id, cfg.soft_labels, device_bytes=on_device,
                               deadline=build_by)
    if store is None:
        print("feature store: off, it would take more than half the time left; the target runs at every step (the "
              "same command again with --resume builds it)", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None
    print(f"feature store: {len(sequences)} answers, {nbytes / 2**30:.1f} GiB ({store.describe()}; {why}), "
          f"built in {time.perf_counter() - began:.0f} s (target forwards {store.build_seconds['target']:.0f} s, rows "
          f"{store.build_seconds['rows']:.0f} s)")
    return store


def _check_fits_target(drafter: DFlashDrafter, text_config, path: str) -> None:
    config = drafter.config
    fits = (config.hidden_size, config.vocab_size) == (text_config.hidden_size, text_config.vocab_size)
    if not fits or max(config.target_layer_ids) >= text_config.num_hidden_layers:
        raise ValueError(
            f"init_from={path!r}: a drafter for hidden size {config.hidden_size}, vocabulary {config.vocab_size} and "
            f"target layers {config.target_layer_ids} does not fit this target (hidden size {text_config.hidden_size},"
            f" vocabulary {text_config.vocab_size}, {text_config.num_hidden_layers} layers); start from a drafter "
            "trained for this target, or drop init_from"
        )


def _init_from_target(drafter: DFlashDrafter, target) -> None:
    """Start the drafter's final norm at the target's: both feed the same LM head."""
    base = target.get_decoder() if hasattr(target, "get_decoder") else target.model
    weight = getattr(getattr(base, "norm", None), "weight", None)
    if weight is not None and weight.shape == drafter.norm.weight.shape:
        with torch.no_grad():
            drafter.norm.weight.copy_(weight.float())


def _eval_sequences(cfg, target, tokenizer, eval_prompt_ids, pad_id, eos_ids) -> list[Sequence]:
    """Greedy target responses to evaluation prompts (held-out ones by default)."""
    from vllm_ddtree.drafter import data

    if not cfg.eval_prompts:
        return []
    if eval_prompt_ids is None:
        if tokenizer is None:
            return []
        heldout = [p for source in cfg.sources for p in data.heldout_prompts(source, limit=cfg.eval_prompts)]
        random.Random(cfg.seed).shuffle(heldout)
        eval_prompt_ids = encode_prompts(tokenizer, heldout, cfg.chat_template, cfg.max_prompt_len)
    eval_prompt_ids = eval_prompt_ids[: cfg.eval_prompts]
    path = Path(cfg.out) / EVAL_RESPONSES
    responses = _cached_eval_responses(path, eval_prompt_ids, cfg.max_new_tokens)
    if responses is None:
        responses = generate_responses(target, eval_prompt_ids, cfg.max_new_tokens, 0.0, cfg.gen_batch_size,
                                       sorted(eos_ids), pad_id)
        path.write_text("".join(json.dumps({"prompt": p, "response": r, "max_new_tokens": cfg.max_new_tokens}) + "\n"
                                for p, r in zip(eval_prompt_ids, responses)))  # fmt: skip
    return [Sequence(p, r) for p, r in zip(eval_prompt_ids, responses)]


EVAL_RESPONSES = "eval_responses.jsonl"  # the held-out prompts' greedy answers (transformers), kept in OUT


def _cached_eval_responses(path: Path, prompt_ids: list[list[int]], max_new_tokens: int) -> list[list[int]] | None:
    """The responses in ``path`` if it answers exactly ``prompt_ids`` with ``max_new_tokens``, else None. Every
    training call needs them, and transformers took 35 s for 16 answers on an H100 (session 49), each call again:
    a resumed call, or a later session's call that carries the file with the banked answers, reads them here."""
    if not path.exists():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if [r["prompt"] for r in rows] != prompt_ids or any(r["max_new_tokens"] != max_new_tokens for r in rows):
        return None
    return [r["response"] for r in rows]


def _special_ids(target, tokenizer) -> tuple[int, set[int]]:
    gen = getattr(target, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) or getattr(target.config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    eos_ids = set(eos if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else []))
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    if pad is None:
        pad = getattr(gen, "pad_token_id", None) or (min(eos_ids) if eos_ids else 0)
    return int(pad), eos_ids



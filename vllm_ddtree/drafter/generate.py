"""The target writes its training data: its answers to the prompts (and the prompts it writes itself) with
transformers (`generate_responses`) or vLLM (`VllmGenerator`, much faster on a GPU).

A `VllmGenerator` keeps its engines from one `answer` call to the next, so a run that first lets the target write
prompts and then answers them starts its engines once. Session 47's training call started four engines for the
20,000 prompts the target wrote and four more for its 79,127 answers, ~25 s apart each time (process start, vLLM's
import, its engine core's own process): 115 s for ~1M tokens of prompts. With `engines` > 1 the engines run in
processes of their own (`_EngineCrew`): all import vLLM at once, then build their engines one at a time.
"""

from __future__ import annotations

import time

import torch

# Prompts per wave with `cuda_graphs`: vLLM's max_num_seqs on the H200, so a wave's prefills come first and its
# decode steps are pure decode batches, which FULL_DECODE_ONLY graphs replay (mixed batches run eagerly).
GRAPH_WAVE = 1024


def past(deadline: float | None) -> bool:
    """Whether a `time.monotonic()` deadline (None: none) has passed."""
    return deadline is not None and time.monotonic() > deadline


@torch.no_grad()
def generate_responses(
    model, prompts: list[list[int]], max_new_tokens: int, temperature: float, batch_size: int, eos_ids, pad_id: int
) -> list[list[int]]:
    """The target's responses to token-id prompts with transformers (left-padded batches); cut after EOS.

    Without cuDNN attention: each decoding step has a new key length, and cuDNN builds a plan for every new shape
    (~80 ms of host time each in session 49's training profile on an H100), likely most of the 35 s that 16 answers
    of 256 tokens took there."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    eos_ids = set(eos_ids)
    responses: list[list[int]] = []
    for start in tqdm(range(0, len(prompts), batch_size), desc="generating", unit="batch"):
        chunk = prompts[start : start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                do_sample=temperature > 0,
                temperature=temperature if temperature > 0 else None,
                top_p=None,
                top_k=0 if temperature > 0 else None,  # 0: no top-k cut (transformers' default 50), the whole distribution
                pad_token_id=pad_id,
                eos_token_id=sorted(eos_ids) or None,
            )
        for row in out[:, width:].tolist():
            responses.append(_cut_after_eos(row, eos_ids))
    return responses


def _cut_after_eos(row: list[int], eos_ids: set[int]) -> list[int]:
    for i, token in enumerate(row):
        if token in eos_ids:
            return row[: i + 1]
    return row


class VllmGenerator:
    """vLLM engines for the target's answers, started at the first `answer` call that has work and kept for later
    calls until `close`. `max_model_len` covers every call's prompts plus its new tokens (a call that needs more
    before the engines start raises it; after, it is an error). `engines` > 1: that many engines, each in a process
    of its own, answer chunks side by side. `cuda_graphs` (CUDA only): decode steps from FULL CUDA graphs captured
    without torch.compile, in chunks of GRAPH_WAVE prompts."""

    def __init__(self, target: str, max_model_len: int, eos_ids, seed: int = 0, cuda_graphs: bool = False,
                 engines: int = 1):  # fmt: skip
        self.target, self.max_model_len, self.eos_ids = target, max_model_len, sorted(eos_ids)
        self.seed, self.cuda_graphs, self.engines = seed, cuda_graphs, engines
        self.llm = None  # the engine of this process (engines == 1)
        self.crew: _EngineCrew | None = None  # engines in processes of their own (engines > 1)

    def __enter__(self) -> VllmGenerator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Start the engines now (with `engines` > 1 they build in their own processes while this one goes on)."""
        self._start(self.max_model_len)

    def _start(self, max_model_len: int) -> None:
        if self.llm is not None or self.crew is not None:
            if max_model_len > self.max_model_len:
                raise ValueError(f"prompts plus new tokens need max_model_len={max_model_len}, but the generator's "
                                 f"engines started with {self.max_model_len}: give VllmGenerator the larger value")
            return
        self.max_model_len = max(self.max_model_len, max_model_len)
        args = _engine_args(self.max_model_len, self.seed, self.cuda_graphs, memory_share=0.4 / self.engines)
        if self.engines > 1:
            self.crew = _EngineCrew(self.target, args, self.eos_ids, self.engines)
        else:
            self.llm = _start_engine(self.target, args)

    def answer(self, prompts: list[list[int]], max_new_tokens: int, temperatures: list[float], seed: int,
               chunk_size: int = 4096, deadline: float | None = None):  # fmt: skip
        """Yields the responses chunk by chunk, in order (so a run cut short keeps the chunks already written), one
        temperature per prompt; answer i is sampled with seed ``seed + i`` whichever engine answers it. Past
        ``deadline`` (a `time.monotonic()` value) no further chunk is started."""
        if past(deadline):  # not even an engine start fits
            print(f"time limit: no answer generated of {len(prompts)}", flush=True)
            return
        if not prompts:
            return
        began = time.monotonic()
        self._start(max(len(p) for p in prompts) + max_new_tokens)
        if self.cuda_graphs and torch.cuda.is_available():
            chunk_size = min(chunk_size, GRAPH_WAVE)
        if self.engines > 1:  # chunks small enough that every engine gets work
            chunk_size = max(1, min(chunk_size, -(-len(prompts) // self.engines)))
        # One seed per answer (seed, seed + 1, ...): repeated prompts get different samples, reruns the same ones.
        requests = [(p, t, seed + i if t > 0 else None) for i, (p, t) in enumerate(zip(prompts, temperatures))]
        chunks = [requests[start : start + chunk_size] for start in range(0, len(requests), chunk_size)]
        if self.crew is not None:
            results = self.crew.answer(chunks, max_new_tokens, deadline)
        else:
            results = (_answer_chunk(self.llm, chunk, max_new_tokens, self.eos_ids) for chunk in chunks
                       if not past(deadline))  # fmt: skip
        answered = generated = 0
        for responses, tokens, seconds in results:
            answered, generated, elapsed = answered + len(responses), generated + tokens, time.monotonic() - began
            print(f"generated {answered}/{len(prompts)} answers, {tokens / seconds:.0f} tok/s (this chunk's engine), "
                  f"{generated / elapsed:.0f} tok/s in the {elapsed:.0f} s since this call began", flush=True)
            yield responses
        if answered < len(prompts):
            print(f"time limit: generation stopped at {answered}/{len(prompts)} answers", flush=True)

    def close(self) -> None:
        """Stop the engines and free their GPU memory (the training steps need it)."""
        if self.crew is not None:
            self.crew.close()
            self.crew = None
        if self.llm is not None:
            from vllm_ddtree.compat import shutdown_llm

            shutdown_llm(self.llm)
            self.llm = None


def _engine_args(max_model_len: int, seed: int, cuda_graphs: bool, memory_share: float) -> dict:
    # Eager by default: on CPU compiled mode produced wrong SmolLM2 chat output (docs/drafter.md); on the H200 the
    # one-off torch.compile + CUDA-graph capture (~2 min at engine start) cost more than it saved for one pass.
    # `cuda_graphs` captures FULL decode graphs without torch.compile instead (CUDA only).
    on_cpu = not torch.cuda.is_available()
    if cuda_graphs and not on_cpu:
        engine = {"max_num_seqs": GRAPH_WAVE, "compilation_config": {
            "mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "max_cudagraph_capture_size": GRAPH_WAVE}}
    else:
        engine = {"enforce_eager": True}
    return dict(gpu_memory_utilization=memory_share, seed=seed, max_model_len=max_model_len, **engine,
                dtype="float32" if on_cpu else "auto", skip_tokenizer_init=True)  # token ids in and out


def _start_engine(target: str, engine_args: dict):
    from vllm import LLM

    return LLM(target, **engine_args)


def _answer_chunk(llm, chunk: list[tuple], max_new_tokens: int, eos_ids: list[int]) -> tuple[list, int, float]:
    """One chunk of (prompt ids, temperature, seed) requests: (answers, tokens generated, seconds)."""
    from vllm import SamplingParams

    began = time.perf_counter()
    params = [SamplingParams(temperature=t, max_tokens=max_new_tokens, seed=s, stop_token_ids=eos_ids,
                             detokenize=False) for _, t, s in chunk]
    outs = llm.generate([{"prompt_token_ids": p} for p, _, _ in chunk], params, use_tqdm=False)
    responses = [list(o.outputs[0].token_ids) for o in outs]
    return responses, sum(len(r) for r in responses), time.perf_counter() - began


def _crew_member(target: str, engine_args: dict, eos_ids: list[int], member: int, permits, tasks, results) -> None:
    """A generator engine in its own process: imports vLLM at once, builds its engine when the parent's permit
    comes (None: exit unbuilt), says when it is ready, then answers (chunk index, chunk, max_new_tokens) tasks
    until it gets None. An error goes back as text, so the parent raises instead of waiting forever."""
    import traceback

    try:
        import vllm  # noqa: F401  (the slow part of a start, side by side with the other members')

        if not permits.get():
            return
        llm = _start_engine(target, engine_args)
        results.put(("ready", member, None))
        while (task := tasks.get()) is not None:
            index, chunk, max_new_tokens = task
            results.put(("answered", member, (index, _answer_chunk(llm, chunk, max_new_tokens, eos_ids))))
        from vllm_ddtree.compat import shutdown_llm

        shutdown_llm(llm)
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put(("failed", member, traceback.format_exc()))


class _EngineCrew:
    """Generator engines in processes of their own. All processes start (and import vLLM) at once; their engines
    are built one at a time, each after the previous one is ready, because vLLM sizes its KV cache from the free GPU
    memory it measures at start, which another engine starting beside it would disturb. Chunks go to whichever
    engine is free and come back in order; the engines stay up between `answer` calls."""

    def __init__(self, target: str, engine_args: dict, eos_ids: list[int], size: int):
        import multiprocessing

        context = multiprocessing.get_context("spawn")  # a CUDA parent cannot fork
        self.results, self.permits = context.Queue(), context.Queue()
        self.members: list[tuple] = []  # (process, task queue)
        for member in range(size):
            tasks = context.Queue()
            process = context.Process(target=_crew_member, args=(target, engine_args, eos_ids, member, self.permits,
                                                                  tasks, self.results))  # fmt: skip
            process.start()  # not a daemon: its vLLM engine starts a process of its own
            self.members.append((process, tasks))
        self.permits.put(True)
        self.unbuilt = size - 1  # permits not handed out yet
        self.idle: list[int] = []  # ready members without a chunk

    def _next_message(self) -> tuple:
        import queue

        while True:
            try:
                return self.results.get(timeout=10)
            except queue.Empty:
                dead = [i for i, (process, _) in enumerate(self.members) if process.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"generator engine {dead[0] + 1} exited with code "
                                       f"{self.members[dead[0]][0].exitcode} before answering")

    def answer(self, chunks: list[list[tuple]], max_new_tokens: int, deadline):
        """Yields (answers, tokens, seconds) chunk by chunk, in order. Past `deadline` no chunk is handed out and no
        engine built; the chunks already handed out are waited for, and those after a chunk never handed out are
        dropped."""
        pending, done, next_out, next_chunk = set(), {}, 0, 0  # handed out, not answered; answered, by index
        while True:
            while self.idle and next_chunk < len(chunks) and not past(deadline):
                pending.add(next_chunk)
                self.members[self.idle.pop(0)][1].put((next_chunk, chunks[next_chunk], max_new_tokens))
                next_chunk += 1
            while next_out in done:
                yield done.pop(next_out)
                next_out += 1
            if not pending and (next_chunk == len(chunks) or past(deadline)):
                return
            kind, member, payload = self._next_message()
            if kind == "failed":
                raise RuntimeError(f"generator engine {member + 1} failed:\n{payload}")
            if kind == "ready":
                ready = len(self.members) - self.unbuilt
                print(f"generator engine {ready} of {len(self.members)} ready (process {member + 1})", flush=True)
                if self.unbuilt and not past(deadline):
                    self.permits.put(True)
                    self.unbuilt -= 1
            else:
                index, result = payload
                pending.discard(index)
                done[index] = result
            self.idle.append(member)

    def close(self) -> None:
        for _ in range(self.unbuilt):  # members still waiting for their turn exit unbuilt
            self.permits.put(None)
        for process, tasks in self.members:
            if process.is_alive():
                tasks.put(None)
        for process, _ in self.members:
            process.join(timeout=60)
            if process.is_alive():
                process.terminate()
                process.join(timeout=10)

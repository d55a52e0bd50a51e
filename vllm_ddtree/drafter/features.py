"""The target's hidden states that condition the drafter: per batch (``target_features``), or computed once for
every training answer and kept on the device, the overflow in host memory (``FeatureStore``).

Training reads each answer ~5 times (passes over the data), and the target's forward was 37 of the 86 ms of a
training step on the H200 (session 17, docs/drafter.md). The store runs that forward once per answer before the
first step; a step then gathers its batch's rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

# Memory a training step needs beside the store: fp32 logits of 32 x 32 blocks of 16 over a 49k vocabulary are
# 3 GB, and their gradient as much again.
TRAINING_HEADROOM_BYTES = 24 << 30
# Host memory left beside the host tier of the store: the process itself (answers, tokenizer, torch) and the OS.
HOST_HEADROOM_BYTES = 16 << 30


@dataclass
class TargetOutputs:
    """What the target gives a batch of training sequences."""

    features: torch.Tensor  # [B, T, F] residual stream after the drafter's target layers, concatenated
    top_ids: torch.Tensor | None = None  # [B, T, k] the target's k most probable next tokens at each position
    top_probs: torch.Tensor | None = None  # [B, T, k] their probabilities (the soft labels' teacher)


@torch.no_grad()
def target_outputs(model, input_ids: torch.Tensor, seq_lens: torch.Tensor, layer_ids: list[int],
                   top_k: int = 0) -> TargetOutputs:
    """Target residual stream after each layer in ``layer_ids``, concatenated, and with ``top_k`` > 0 the target's
    ``top_k`` most probable next tokens at every position.

    HF's ``hidden_states[i + 1]`` is the output of decoder layer i, except for the last layer, where HF returns
    the final-normed state; vLLM takes the un-normed one, so that one is caught at the final norm's input.
    Without ``top_k`` only the decoder runs: the LM head's logits ([B, T, vocab], 1.6 GB in bf16 for a store
    batch of 16,384 tokens of SmolLM2) are not needed.
    """
    T = input_ids.shape[1]
    attention_mask = (torch.arange(T, device=input_ids.device) < seq_lens.unsqueeze(-1)).long()
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    num_layers = len(base.layers)
    captured = {}
    hook = base.norm.register_forward_pre_hook(lambda _m, args: captured.__setitem__("pre_norm", args[0]))
    try:
        out = (model if top_k > 0 else base)(input_ids=input_ids, attention_mask=attention_mask,
                                             output_hidden_states=True, use_cache=False)
    finally:
        hook.remove()
    states = [captured["pre_norm"] if i == num_layers - 1 else out.hidden_states[i + 1] for i in layer_ids]
    outputs = TargetOutputs(torch.cat(states, dim=-1))
    if top_k > 0:
        probs, ids = out.logits.float().softmax(-1).topk(top_k, dim=-1)  # [B, T, k]
        outputs.top_ids, outputs.top_probs = ids.to(torch.int32), probs
    return outputs


def target_features(model, input_ids: torch.Tensor, seq_lens: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """[B, T, len(layer_ids) * H]: ``target_outputs``' features."""
    return target_outputs(model, input_ids, seq_lens, layer_ids).features


LENGTH_MULTIPLE = 64  # padded batch lengths: a multiple of this


def padded_length(length: int) -> int:
    """``length`` rounded up to a multiple of LENGTH_MULTIPLE: the length of every padded batch of answers (the
    store's, the training steps', the simulation's drafter contexts). On an H100 torch's SDPA runs cuDNN, which
    builds an execution plan for every new shape: ~80 ms of host time each (session 49's profile: 2.4 of 3.8 s of
    host time over 10 steps whose lengths were all new), which a handful of lengths turns into a few plans a run.
    The padding changes nothing: padded keys are masked (past a sequence's length, and past a block's anchor)."""
    return -(-length // LENGTH_MULTIPLE) * LENGTH_MULTIPLE


PROJECT_AFTER = 0.05  # FeatureStore.build projects its end once this share of its work is done (the first
# batches include the kernels' warm-up)


def attention_length(model) -> float:
    """The sequence length T at which a token's attention FLOPs in the target (~4 T hidden per layer: scores and
    values over T keys) equal its weights' (2 per parameter outside the embedding and LM head): a batch padded to
    T costs about (1 + T / this) per token. ~3,100 for SmolLM2-135M. The store builds longest first, so a pace in
    plain tokens projected session 47's build at ~200 s where whole builds took 105-139 s (sessions 45-46)."""
    config = getattr(model.config, "text_config", model.config)
    weights = sum(p.numel() for name, p in model.named_parameters() if "embed" not in name and "lm_head" not in name)
    return 2 * weights / (4 * config.hidden_size * config.num_hidden_layers)


def batch_cost(num_sequences: int, padded_len: int, attention_len: float) -> float:
    """A store batch's work in `_Pace` units: padded tokens weighted by their attention share (`attention_length`)."""
    return num_sequences * padded_len * (1 + padded_len / attention_len)


class FeatureStore:
    """``target_outputs`` of a fixed list of token sequences, computed once: rows of all sequences back to back.

    The rows live on the model's device up to ``device_bytes``; the sequences past that keep theirs in host memory
    (the second tier), and a batch's host rows are gathered there and copied over. Session 37's 89k answers needed
    122 GiB of features, more than an H100 keeps beside a training step.
    """

    def __init__(self, rows: TargetOutputs, host_rows: TargetOutputs | None, starts: torch.Tensor,
                 lengths: torch.Tensor, on_host: torch.Tensor):
        self.rows = rows  # each field [tokens of the device tier's sequences, ...], on the device
        self.host_rows = host_rows  # each field [tokens of the host tier's sequences, ...], in host memory; or None
        self.starts = starts  # [num sequences] first row of each sequence within its tier (CPU)
        self.lengths = lengths  # [num sequences] (CPU)
        self.on_host = on_host  # [num sequences] bool: the sequence's rows are in the host tier (CPU)
        self.build_seconds = {"target": 0.0, "rows": 0.0}  # where `build`'s time went (the log's store line)

    @staticmethod
    def nbytes(sequences: list[list[int]], num_features: int, dtype: torch.dtype, top_k: int = 0) -> int:
        per_token = num_features * dtype.itemsize + top_k * (4 + 4)  # features, top-k ids (int32) and probs (fp32)
        return sum(len(ids) for ids in sequences) * per_token

    @classmethod
    def build(cls, model, sequences: list[list[int]], layer_ids: list[int], pad_id: int, top_k: int = 0,
              tokens_per_batch: int = 16384, device_bytes: int | None = None, deadline: float | None = None
              ) -> FeatureStore | None:  # fmt: skip
        """Run the target over ``sequences`` (longest first, ``tokens_per_batch`` padded tokens per forward).
        Sequences keep their rows on the device in index order while they fit ``device_bytes`` (None: all).
        ``deadline`` (a `time.monotonic()` value): once it has passed, or the pace so far (`_Pace`, in
        `batch_cost` units) says the build would end past it, the build stops and returns None."""
        from tqdm.auto import tqdm

        device = next(model.parameters()).device
        lengths = torch.tensor([len(ids) for ids in sequences])
        rows = host_rows = on_host = starts = None
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
        batches, batch = [], []
        for i in order:  # longest first: a batch's padded length is its first sequence's
            if batch and (len(batch) + 1) * padded_length(len(sequences[batch[0]])) > tokens_per_batch:
                batches.append(batch)
                batch = []
            batch.append(i)
        batches += [batch] if batch else []
        attention_len = attention_length(model)
        pace = _Pace(sum(batch_cost(len(b), padded_length(len(sequences[b[0]])), attention_len) for b in batches))
        seconds = {"target": 0.0, "rows": 0.0}  # the target's forwards, and writing their rows into the store
        clock = time.perf_counter()
        for batch in tqdm(batches, desc="target features", unit="batch", mininterval=10):
            T = padded_length(len(sequences[batch[0]]))
            end = pace.projected_end()
            if deadline is not None and (time.monotonic() > deadline or end is not None and end > deadline):
                print(f"feature store: stopped at {pace.share_done():.0%}: at its pace it would end past its "
                      "deadline", flush=True)
                return None
            input_ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
            for b, i in enumerate(batch):
                input_ids[b, : len(sequences[i])] = torch.tensor(sequences[i])
            seq_lens = lengths[batch]
            outputs = target_outputs(model, input_ids.to(device), seq_lens.to(device), layer_ids, top_k)  # [b, T, ...]
            clock = _lap(seconds, "target", clock, device)
            if rows is None:
                per_token = sum(t.shape[-1] * t.element_size() for t in _fields(outputs) if t is not None)
                device_tokens = lengths.sum() if device_bytes is None else device_bytes // per_token
                on_host = torch.cumsum(lengths, 0) > device_tokens  # [N] the first sequences that fit stay on the device
                starts = torch.zeros_like(lengths)
                for tier in (~on_host, on_host):
                    starts[tier] = torch.cumsum(lengths[tier], 0) - lengths[tier]
                rows, host_rows = (_empty_rows(outputs, int(lengths[tier].sum()), where)
                                   for tier, where in ((~on_host, device), (on_host, torch.device("cpu"))))
            valid = torch.arange(T) < seq_lens[:, None]  # [b, T]
            for tier, store in ((~on_host, rows), (on_host, host_rows)):
                keep = valid & tier[batch][:, None]  # [b, T] valid positions of this tier's sequences
                if not keep.any():
                    continue
                index = (starts[batch][:, None] + torch.arange(T))[keep]  # rows of those positions in the tier
                for field, value in zip(_fields(store), _fields(outputs)):
                    if field is not None:
                        field[index.to(field.device)] = value[keep.to(device)].to(field.device)
            clock = _lap(seconds, "rows", clock, device)
            pace.step(batch_cost(len(batch), T, attention_len))
        if not on_host.any():
            host_rows = None
        store = cls(rows, host_rows, starts, lengths, on_host)
        store.build_seconds = seconds
        return store

    def describe(self) -> str:
        """Where the rows are, for the log."""
        host = int(self.on_host.sum())
        return f"{len(self.lengths) - host} answers on the device, {host} in host memory"

    def gather(self, indices: list[int], T: int) -> TargetOutputs:
        """Outputs of sequences ``indices`` right-padded to ``T`` positions ([len(indices), T, ...]), as
        ``target_outputs`` of the padded batch returns them (padded positions repeat the last row; no step reads
        them: a block's context ends before its anchor, and its labels before the sequence's end). No wait for the
        device: indices are computed on the host, host rows are gathered into pinned memory and copied
        asynchronously."""
        device = self.rows.features.device
        index = torch.tensor(indices)
        last = self.lengths[index, None] - 1  # [B, 1]
        rows = self.starts[index, None] + torch.minimum(torch.arange(T), last)  # [B, T] rows within each tier
        host = self.on_host[index]  # [B]
        if not host.any():
            return TargetOutputs(*(None if t is None else t[rows.to(device, non_blocking=True)]
                                   for t in _fields(self.rows)))
        gathered = []
        for field, host_field in zip(_fields(self.rows), _fields(self.host_rows)):
            if field is None:
                gathered.append(None)
                continue
            out = field.new_empty((len(indices), T, field.shape[-1]))  # [B, T, F]
            on_device = (~host).nonzero().squeeze(1)
            if len(on_device):
                out[on_device.to(device)] = field[rows[on_device].to(device, non_blocking=True)]
            picked = rows[host].flatten()  # [H * T]
            staged = torch.empty((len(picked), field.shape[-1]), dtype=field.dtype,
                                 pin_memory=device.type == "cuda")  # fmt: skip
            torch.index_select(host_field, 0, picked, out=staged)
            out[host.nonzero().squeeze(1).to(device)] = staged.view(-1, T, field.shape[-1]).to(device, non_blocking=True)
            gathered.append(out)
        return TargetOutputs(*gathered)


def _lap(seconds: dict, phase: str, since: float, device: torch.device) -> float:
    """Add the time since ``since`` to ``seconds[phase]`` once the device's work is done (one wait per store batch:
    the build runs once a call, and the split tells the target's forwards from the rows' copies)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    now = time.perf_counter()
    seconds[phase] += now - since
    return now


class _Pace:
    """When a job of ``total`` units ends at its pace so far, timed from the end of its first step (which includes
    the kernels' warm-up), once PROJECT_AFTER of the units are done."""

    def __init__(self, total: int):
        self.total, self.done, self.since = total, 0, None  # since: (time, units done) at the first step's end

    def step(self, units: int) -> None:
        self.done += units
        if self.since is None:
            self.since = (time.monotonic(), self.done)

    def share_done(self) -> float:
        return self.done / max(self.total, 1)

    def projected_end(self) -> float | None:
        if self.since is None or self.done < PROJECT_AFTER * self.total or self.done == self.since[1]:
            return None
        now, (began, done_then) = time.monotonic(), self.since
        return now + (now - began) / (self.done - done_then) * (self.total - self.done)


def _empty_rows(like: TargetOutputs, num_rows: int, device: torch.device) -> TargetOutputs:
    return TargetOutputs(*(None if t is None else torch.empty((num_rows, t.shape[-1]), dtype=t.dtype, device=device)
                           for t in _fields(like)))  # fmt: skip


def _fields(outputs: TargetOutputs) -> tuple:
    return outputs.features, outputs.top_ids, outputs.top_probs


def store_budget(device: torch.device) -> tuple[int, int, str]:
    """Bytes of store the device and the host memory can keep beside a training step, and why (for the log)."""
    host = max(0, _available_host_bytes() - HOST_HEADROOM_BYTES)
    if device.type != "cuda":
        limit = 2 << 30  # CPU runs are tiny test or smoke runs
        return limit, 0, f"a CPU limit of {limit / 2**30:.0f} GiB"
    free, _ = torch.cuda.mem_get_info(device)
    on_device = max(0, free - TRAINING_HEADROOM_BYTES)
    return on_device, host, (f"{free / 2**30:.1f} GiB free on the device less {TRAINING_HEADROOM_BYTES / 2**30:.0f} GiB "
                             f"headroom, then {host / 2**30:.1f} GiB of host memory")


def _available_host_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        fields = dict(line.split(":", 1) for line in meminfo)
    return int(fields["MemAvailable"].split()[0]) * 1024

"""The target's hidden states that condition the drafter: per batch (``target_features``), or computed once for
every training answer and kept on the device (``FeatureStore``).

Training reads each answer ~5 times (passes over the data), and the target's forward was 37 of the 86 ms of a
training step on the H200 (session 17, docs/drafter.md). The store runs that forward once per answer before the
first step; a step then gathers its batch's rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Memory a training step needs beside the store: fp32 logits of 32 x 32 blocks of 16 over a 49k vocabulary are
# 3 GB, and their gradient as much again.
TRAINING_HEADROOM_BYTES = 24 << 30


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
    """
    T = input_ids.shape[1]
    attention_mask = (torch.arange(T, device=input_ids.device) < seq_lens.unsqueeze(-1)).long()
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    num_layers = len(base.layers)
    captured = {}
    hook = base.norm.register_forward_pre_hook(lambda _m, args: captured.__setitem__("pre_norm", args[0]))
    try:
        out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
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


class FeatureStore:
    """``target_outputs`` of a fixed list of token sequences, computed once: rows of all sequences back to back."""

    def __init__(self, rows: TargetOutputs, starts: torch.Tensor, lengths: torch.Tensor):
        self.rows = rows  # each field [total tokens, ...]
        self.starts = starts  # [num sequences] first row of each sequence
        self.lengths = lengths  # [num sequences]

    @staticmethod
    def nbytes(sequences: list[list[int]], num_features: int, dtype: torch.dtype, top_k: int = 0) -> int:
        per_token = num_features * dtype.itemsize + top_k * (4 + 4)  # features, top-k ids (int32) and probs (fp32)
        return sum(len(ids) for ids in sequences) * per_token

    @classmethod
    def build(cls, model, sequences: list[list[int]], layer_ids: list[int], pad_id: int, top_k: int = 0,
              tokens_per_batch: int = 16384) -> FeatureStore:
        """Run the target over ``sequences`` (longest first, ``tokens_per_batch`` padded tokens per forward)."""
        from tqdm.auto import tqdm

        device = next(model.parameters()).device
        lengths = torch.tensor([len(ids) for ids in sequences])
        starts = torch.cumsum(lengths, 0) - lengths
        rows = None
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
        batches, batch = [], []
        for i in order:  # longest first: a batch's padded length is its first sequence's
            if batch and (len(batch) + 1) * len(sequences[batch[0]]) > tokens_per_batch:
                batches.append(batch)
                batch = []
            batch.append(i)
        batches += [batch] if batch else []
        for batch in tqdm(batches, desc="target features", unit="batch", mininterval=10):
            T = len(sequences[batch[0]])
            input_ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
            for b, i in enumerate(batch):
                input_ids[b, : len(sequences[i])] = torch.tensor(sequences[i])
            seq_lens = lengths[batch]
            outputs = target_outputs(model, input_ids.to(device), seq_lens.to(device), layer_ids, top_k)  # [b, T, ...]
            if rows is None:
                rows = TargetOutputs(*(None if t is None else t.new_empty((int(lengths.sum()), t.shape[-1]))
                                       for t in _fields(outputs)))  # fmt: skip
            valid = (torch.arange(T) < seq_lens[:, None]).to(device)  # [b, T]
            index = (starts[batch][:, None] + torch.arange(T)).to(device)[valid]  # rows of the valid positions
            for store, value in zip(_fields(rows), _fields(outputs)):
                if store is not None:
                    store[index] = value[valid]
        return cls(rows, starts.to(device), lengths.to(device))

    def gather(self, indices: list[int], T: int) -> TargetOutputs:
        """Outputs of sequences ``indices`` right-padded to ``T`` positions ([len(indices), T, ...]), as
        ``target_outputs`` of the padded batch returns them (padded positions repeat the last row; no step reads
        them: a block's context ends before its anchor, and its labels before the sequence's end)."""
        device = self.starts.device
        index = torch.tensor(indices, device=device)
        last = self.lengths[index, None] - 1  # [B, 1]
        rows = self.starts[index, None] + torch.minimum(torch.arange(T, device=device), last)  # [B, T]
        return TargetOutputs(*(None if t is None else t[rows] for t in _fields(self.rows)))


def _fields(outputs: TargetOutputs) -> tuple:
    return outputs.features, outputs.top_ids, outputs.top_probs


def store_fits(nbytes: int, device: torch.device) -> tuple[bool, str]:
    """Whether a store of ``nbytes`` leaves a training step its headroom on ``device``, and why (for the log)."""
    if device.type != "cuda":
        limit = 2 << 30  # CPU runs are tiny test or smoke runs
        return nbytes <= limit, f"{nbytes / 2**30:.1f} GiB against a CPU limit of {limit / 2**30:.0f} GiB"
    free, _ = torch.cuda.mem_get_info(device)
    return (nbytes + TRAINING_HEADROOM_BYTES <= free,
            f"{nbytes / 2**30:.1f} GiB + {TRAINING_HEADROOM_BYTES / 2**30:.0f} GiB headroom against "
            f"{free / 2**30:.1f} GiB free")

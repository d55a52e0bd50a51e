"""The target's hidden states that condition the drafter: per batch (``target_features``), or computed once for
every training answer and kept on the device (``FeatureStore``).

Training reads each answer ~5 times (passes over the data), and the target's forward was 37 of the 86 ms of a
training step on the H200 (session 17, docs/drafter.md). The store runs that forward once per answer before the
first step; a step then gathers its batch's rows.
"""

from __future__ import annotations

import torch

# Memory a training step needs beside the store: fp32 logits of 32 x 32 blocks of 16 over a 49k vocabulary are
# 3 GB, and their gradient as much again.
TRAINING_HEADROOM_BYTES = 24 << 30


@torch.no_grad()
def target_features(model, input_ids: torch.Tensor, seq_lens: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """Target residual stream after each layer in ``layer_ids``, concatenated: [B, T, len(layer_ids) * H].

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
    return torch.cat(states, dim=-1)


class FeatureStore:
    """``target_features`` of a fixed list of token sequences, computed once: rows of all sequences back to back."""

    def __init__(self, rows: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor):
        self.rows = rows  # [total tokens, F]
        self.starts = starts  # [num sequences] first row of each sequence
        self.lengths = lengths  # [num sequences]

    @staticmethod
    def nbytes(sequences: list[list[int]], num_features: int, dtype: torch.dtype) -> int:
        return sum(len(ids) for ids in sequences) * num_features * dtype.itemsize

    @classmethod
    def build(cls, model, sequences: list[list[int]], layer_ids: list[int], pad_id: int,
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
            features = target_features(model, input_ids.to(device), seq_lens.to(device), layer_ids)  # [b, T, F]
            if rows is None:
                rows = torch.empty((int(lengths.sum()), features.shape[-1]), dtype=features.dtype, device=device)
            valid = torch.arange(T) < seq_lens[:, None]  # [b, T]
            index = (starts[batch][:, None] + torch.arange(T))[valid]  # rows of the valid positions
            rows[index.to(device)] = features[valid.to(device)]
        return cls(rows, starts.to(device), lengths.to(device))

    def gather(self, indices: list[int], T: int) -> torch.Tensor:
        """Features of sequences ``indices`` right-padded to ``T`` positions: [len(indices), T, F], as
        ``target_features`` of the padded batch returns them (padded positions repeat the last row; no step reads
        them: a block's context ends before its anchor)."""
        index = torch.tensor(indices, device=self.rows.device)
        positions = torch.arange(T, device=self.rows.device)
        last = self.lengths[index, None] - 1  # [B, 1]
        return self.rows[self.starts[index, None] + torch.minimum(positions, last)]


def store_fits(nbytes: int, device: torch.device) -> tuple[bool, str]:
    """Whether a store of ``nbytes`` leaves a training step its headroom on ``device``, and why (for the log)."""
    if device.type != "cuda":
        limit = 2 << 30  # CPU runs are tiny test or smoke runs
        return nbytes <= limit, f"{nbytes / 2**30:.1f} GiB against a CPU limit of {limit / 2**30:.0f} GiB"
    free, _ = torch.cuda.mem_get_info(device)
    return (nbytes + TRAINING_HEADROOM_BYTES <= free,
            f"{nbytes / 2**30:.1f} GiB + {TRAINING_HEADROOM_BYTES / 2**30:.0f} GiB headroom against "
            f"{free / 2**30:.1f} GiB free")

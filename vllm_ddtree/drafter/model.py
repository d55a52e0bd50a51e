"""Pure-torch DFlash drafter for training, saved in the layout vLLM's ``DFlashDraftModel`` loads.

vLLM's drafter (``vllm/model_executor/models/qwen3_dflash.py``, driven by ``vllm/v1/spec_decode/dflash.py``) sees,
for a request whose next ("bonus") token sits at position ``a``:

    context   the target's hidden states of every token before ``a``, taken after the decoder layers
              ``target_layer_ids`` (the residual stream, before the final norm), concatenated:
              ctx = hidden_norm(fc(cat(h_l for l in target_layer_ids)))                     # [T, H]
              per drafter layer: K = rope(k_norm(k_proj(ctx))), V = v_proj(ctx) -- no input_layernorm
    query     embed([bonus, mask, ..., mask]) at positions a .. a+block_size-1 through Qwen3 decoder layers
              (q/k RMSNorm per head, RoPE (neox), GQA, SwiGLU); each query attends to all context K/V and to
              the block's own K/V (non-causal within the block unless ``causal``)
    output    lm_head(norm(h)) at block offset j >= 1 proposes the token at position a + j

The embedding and the LM head are the target's, frozen and never saved. Weights are saved without a ``model.``
prefix (``layers.*``, ``fc``, ``hidden_norm``, ``norm``) next to a Qwen3-style ``config.json`` with
``architectures: ["DFlashDraftModel"]``, ``block_size``, ``num_target_layers`` and ``dflash_config``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

WEIGHTS_FILE = "model.safetensors"


@dataclass
class DrafterConfig:
    """Shape of a DFlash drafter; ``hidden_size`` must equal the target's (it shares embedding and LM head)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int
    target_hidden_size: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    causal: bool = False
    extra: dict = field(default_factory=dict)  # copied into config.json as it is (e.g. bos/eos ids)

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"block_size={self.block_size}; a DFlash block needs at least 2 positions")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id={self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")
        ids = list(self.target_layer_ids)
        if not ids or ids != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= self.num_target_layers:
            raise ValueError(
                f"target_layer_ids={ids} must be a non-empty increasing list of layer indices in "
                f"[0, {self.num_target_layers}) (vLLM concatenates the target's features in layer order)"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    @property
    def fc_input_size(self) -> int:
        return (self.target_hidden_size or self.hidden_size) * len(self.target_layer_ids)

    def to_hf_dict(self) -> dict:
        """The ``config.json`` vLLM reads (parsed by transformers as a Qwen3 config)."""
        config = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
                "causal": self.causal,
            },
        }
        if self.target_hidden_size and self.target_hidden_size != self.hidden_size:
            config["target_hidden_size"] = self.target_hidden_size
        return {**self.extra, **config}

    @classmethod
    def from_hf_dict(cls, config: dict) -> "DrafterConfig":
        if "DFlashDraftModel" not in config.get("architectures", []):
            raise ValueError(f"architectures={config.get('architectures')}; expected ['DFlashDraftModel']")
        dflash = config.get("dflash_config") or {}
        rope = config.get("rope_parameters") or {}
        known = set(cls.__dataclass_fields__) | {
            "architectures", "model_type", "dflash_config", "rope_parameters", "hidden_act", "attention_bias",
            "tie_word_embeddings", "torch_dtype", "dtype",
        }
        return cls(
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config["num_key_value_heads"],
            head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
            vocab_size=config["vocab_size"],
            block_size=config["block_size"],
            mask_token_id=dflash["mask_token_id"],
            target_layer_ids=list(dflash["target_layer_ids"]),
            num_target_layers=config["num_target_layers"],
            target_hidden_size=config.get("target_hidden_size"),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=config.get("rope_theta", rope.get("rope_theta", 1_000_000.0)),
            max_position_embeddings=config.get("max_position_embeddings", 32768),
            causal=bool(dflash.get("causal", False)),
            extra={k: v for k, v in config.items() if k not in known},
        )


class RMSNorm(nn.Module):
    """RMSNorm as vLLM computes it: normalize in float32, cast back, then scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style RoPE tables for ``positions`` [...]; returns cos, sin of shape [..., head_dim] in float32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    freqs = positions.float().unsqueeze(-1) * inv_freq  # [..., head_dim / 2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [..., head_dim]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, heads, D]; cos/sin [B, S, D]. Rotates the two halves of each head (neox layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # [B, S, 1, D]
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class DrafterAttention(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        h, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.q_proj = nn.Linear(h, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """ctx [B, T, H] (already hidden_norm'ed) -> K, V [B, T, kv_heads, D]; no input_layernorm, as in vLLM."""
        B, T, _ = ctx.shape
        k = self.k_norm(self.k_proj(ctx).view(B, T, self.num_kv_heads, self.head_dim))
        v = self.v_proj(ctx).view(B, T, self.num_kv_heads, self.head_dim)
        return apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        """x [B, N, H] block tokens; ctx_k/ctx_v [B, T, kv, D]; mask [B, N, T + N] (True = attend)."""
        B, N, _ = x.shape
        q = apply_rope(self.q_norm(self.q_proj(x).view(B, N, self.num_heads, self.head_dim)), cos, sin)
        k = apply_rope(self.k_norm(self.k_proj(x).view(B, N, self.num_kv_heads, self.head_dim)), cos, sin)
        v = self.v_proj(x).view(B, N, self.num_kv_heads, self.head_dim)
        k = torch.cat([ctx_k, k], dim=1).transpose(1, 2)  # [B, kv, T + N, D]
        v = torch.cat([ctx_v, v], dim=1).transpose(1, 2)
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # [B, heads, T + N, D]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask.unsqueeze(1))
        return self.o_proj(out.transpose(1, 2).reshape(B, N, -1))  # [B, N, H]


class DrafterLayer(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.self_attn = DrafterAttention(config)
        self.mlp = nn.ModuleDict(
            {
                "gate_proj": nn.Linear(h, config.intermediate_size, bias=False),
                "up_proj": nn.Linear(h, config.intermediate_size, bias=False),
                "down_proj": nn.Linear(config.intermediate_size, h, bias=False),
            }
        )
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)

    def forward(self, x, cos, sin, ctx, ctx_cos, ctx_sin, mask):
        ctx_k, ctx_v = self.self_attn.context_kv(ctx, ctx_cos, ctx_sin)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        y = self.post_attention_layernorm(x)
        return x + self.mlp["down_proj"](F.silu(self.mlp["gate_proj"](y)) * self.mlp["up_proj"](y))


class DFlashDrafter(nn.Module):
    """The trainable part of a DFlash drafter; the target's embedding and LM head are attached, frozen, unsaved."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DrafterLayer(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(config.fc_input_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.register_buffer("embed_weight", torch.empty(0), persistent=False)
        self.register_buffer("lm_head_weight", torch.empty(0), persistent=False)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        _init_linears(self, std)
        # Scale the residual branches' outputs so that a fresh drafter starts near the embedding.
        for layer in self.layers:
            layer.self_attn.o_proj.weight.data.mul_(1 / math.sqrt(2 * len(self.layers)))
            layer.mlp["down_proj"].weight.data.mul_(1 / math.sqrt(2 * len(self.layers)))

    def add_layers(self, num_layers: int, std: float = 0.02) -> None:
        """Grow to `num_layers` decoder layers. The new layers go after the existing ones with their output
        projections (attention `o_proj`, MLP `down_proj`) at zero, so each starts as the identity on the residual
        stream and the drafter's outputs do not change until training moves them: more capacity for a drafter
        trained further (`TrainConfig.init_from`)."""
        have = len(self.layers)
        if num_layers < have:
            raise ValueError(f"num_layers={num_layers} is below this drafter's {have} layers; layers are only added")
        weight = self.fc.weight
        for _ in range(num_layers - have):
            layer = DrafterLayer(self.config).to(device=weight.device, dtype=weight.dtype)
            _init_linears(layer, std)
            nn.init.zeros_(layer.self_attn.o_proj.weight)
            nn.init.zeros_(layer.mlp["down_proj"].weight)
            self.layers.append(layer)
        self.config.num_hidden_layers = num_layers

    def attach_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """Share the target's input embedding [V, H] and LM head [V, H] (frozen, not in the state dict)."""
        expected = (self.config.vocab_size, self.config.hidden_size)
        for name, w in (("embedding", embed_weight), ("lm_head", lm_head_weight)):
            if tuple(w.shape) != expected:
                raise ValueError(f"target {name} has shape {tuple(w.shape)}; this drafter expects {expected}")
        self.embed_weight = embed_weight.detach()
        self.lm_head_weight = lm_head_weight.detach()

    def forward(
        self,
        block_ids: torch.Tensor,  # [B, A, S] int64: anchor token, then mask tokens
        anchors: torch.Tensor,  # [B, A] int64: position of each block's first token
        features: torch.Tensor,  # [B, T, fc_input_size]: target features of every position
        seq_lens: torch.Tensor | None = None,  # [B] valid lengths of ``features`` (default: T)
    ) -> torch.Tensor:
        """Hidden states after the final norm, [B, A, S, H]. Block a sees context positions < anchors[a]."""
        if self.embed_weight.numel() == 0:
            raise ValueError("call attach_target(embed_weight, lm_head_weight) before running the drafter")
        B, A, S = block_ids.shape
        T = features.shape[1]
        dtype = self.fc.weight.dtype
        ctx = self.hidden_norm(self.fc(features.to(dtype)))  # [B, T, H]
        ctx_pos = torch.arange(T, device=features.device).expand(B, T)
        positions = anchors.unsqueeze(-1) + torch.arange(S, device=anchors.device)  # [B, A, S]
        ctx_cos, ctx_sin = rope_cos_sin(ctx_pos, self.config.head_dim, self.config.rope_theta)
        cos, sin = rope_cos_sin(positions.view(B, A * S), self.config.head_dim, self.config.rope_theta)
        mask = block_attention_mask(anchors, S, T, seq_lens, self.config.causal)  # [B, A*S, T + A*S]
        x = F.embedding(block_ids.view(B, A * S), self.embed_weight).to(dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, ctx, ctx_cos, ctx_sin, mask)
        return self.norm(x).view(B, A, S, -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head_weight.to(hidden.dtype))

    def save(self, out_dir: str | os.PathLike, dtype: torch.dtype = torch.float32) -> Path:
        """Write ``config.json`` and ``model.safetensors`` (no ``model.`` prefix) that vLLM loads."""
        from safetensors.torch import save_file

        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        config = self.config.to_hf_dict()
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
        (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
        return out_dir

    @classmethod
    def load(cls, path: str | os.PathLike, device: str | torch.device = "cpu") -> "DFlashDrafter":
        from safetensors.torch import load_file

        path = Path(path)
        drafter = cls(DrafterConfig.from_hf_dict(json.loads((path / "config.json").read_text())))
        state = load_file(str(path / WEIGHTS_FILE), device=str(device))
        missing, unexpected = drafter.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
        if missing or unexpected:
            raise ValueError(f"{path}: missing weights {missing}, unexpected weights {unexpected}")
        return drafter.to(device)


def _init_linears(module: nn.Module, std: float) -> None:
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            nn.init.normal_(sub.weight, std=std)


def block_attention_mask(
    anchors: torch.Tensor, block_size: int, ctx_len: int, seq_lens: torch.Tensor | None, causal: bool
) -> torch.Tensor:
    """Boolean mask [B, A*S, T + A*S]: a block's queries see context positions < its anchor and its own block."""
    B, A = anchors.shape
    S, T = block_size, ctx_len
    t = torch.arange(T, device=anchors.device)
    limit = anchors if seq_lens is None else torch.minimum(anchors, seq_lens.unsqueeze(-1))
    ctx_mask = t.view(1, 1, 1, T) < limit.view(B, A, 1, 1)  # [B, A, 1, T]
    ctx_mask = ctx_mask.expand(B, A, S, T).reshape(B, A * S, T)
    block = torch.arange(A * S, device=anchors.device) // S
    offset = torch.arange(A * S, device=anchors.device) % S
    blk_mask = block.view(-1, 1) == block.view(1, -1)  # [A*S, A*S]
    if causal:
        blk_mask &= offset.view(-1, 1) >= offset.view(1, -1)
    return torch.cat([ctx_mask, blk_mask.expand(B, -1, -1)], dim=-1)

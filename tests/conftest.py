"""Shared test setup: vLLM on this machine's CPU, in-process, with the plugin registered."""

import os

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: engine runs that take more than a minute")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped elsewhere)")

"""Shared test setup: vLLM on this machine's CPU, in-process, with the plugin registered."""

import os

import pytest

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: engine runs that take more than a minute")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped elsewhere)")


@pytest.fixture(scope="module")
def one_cpu_thread():
    """Tiny tensors: one torch thread is many times faster than two fighting other jobs for two cores.

    Uses torch._C directly: vLLM's CPU worker replaces torch.set_num_threads once an engine exists."""
    import torch

    threads = torch.get_num_threads()
    torch._C.set_num_threads(1)
    yield
    torch._C.set_num_threads(threads)

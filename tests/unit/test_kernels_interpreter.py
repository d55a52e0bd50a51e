"""The GPU kernel tests on the CPU through Triton's interpreter, so CI checks the kernels' logic without a GPU:
tests/gpu/test_kernels.py (tree attention one-pass and split, KV compaction) and
tests/gpu/test_cross_entropy_kernel.py (the drafter training loss's row kernel). The switch (TRITON_INTERPRET=1)
is read when a kernel is defined, hence the subprocess; the tests that need CUDA itself skip there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("tests, timeout", [("tests/gpu/test_kernels.py", 900),
                                            ("tests/gpu/test_cross_entropy_kernel.py", 600)])  # fmt: skip
def test_gpu_kernel_tests_pass_in_triton_interpreter(tests, timeout):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-m", "pytest", tests, "-q", "-p", "no:cacheprovider"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert " passed" in run.stdout and " failed" not in run.stdout, run.stdout[-2000:]

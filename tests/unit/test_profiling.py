"""`profiling.StepTimer`: per-phase means over the steps that verify drafts only. A prefill step's forward would
otherwise land in the phase before the drafter (session 14, Qwen3-8B shape: 7.5 ms per step at batch 32 there,
all of it the prefill). The CUDA events are replaced by a clock the test advances (no GPU here)."""

import json

import torch

from vllm_ddtree import profiling


class _Clock:
    now = 0.0


class _FakeEvent:
    def __init__(self, enable_timing=True):
        self.at = None

    def record(self):
        self.at = _Clock.now

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return end.at - self.at


def test_only_verification_steps_count(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    path = tmp_path / "profile.json"
    monkeypatch.setenv(profiling.ENV, str(path))
    timer = profiling.StepTimer()
    timer.end_step()  # reads the switch

    def step(gpu_ms: dict, skip: bool):
        timer.mark("start")
        if skip:
            timer.skip_step()
        for name, ms in gpu_ms.items():
            _Clock.now += ms
            timer.mark(name)
        timer.end_step()

    step({"forward": 100.0, "draft": 1.0}, skip=True)  # a prefill
    for _ in range(10):
        step({"forward": 2.0, "draft": 1.0}, skip=False)
    summary = json.loads(path.read_text())
    assert summary["steps"] == 10
    assert summary["gpu_ms"] == {"forward": 2.0, "draft": 1.0}

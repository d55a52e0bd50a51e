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


def test_counts_are_totals_kept_with_the_profile_and_reset_with_it(monkeypatch, tmp_path):
    """What the steps ran (the target forward's CUDA-graph mode on Model Runner V2) is counted next to the times:
    session 16's SmolLM2-shape step at B = 64 spent 12 ms host time in the forward, which only a count of the
    graph mode can tell apart from a slow kernel."""
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    path = tmp_path / "profile.json"
    monkeypatch.setenv(profiling.ENV, str(path))
    timer = profiling.StepTimer()
    timer.end_step()
    for i in range(10):
        timer.mark("start")
        timer.count("target_cudagraph_FULL" if i % 5 else "target_cudagraph_PIECEWISE")
        _Clock.now += 1.0
        timer.mark("forward")
        timer.end_step()
    assert json.loads(path.read_text())["counts"] == {"target_cudagraph_FULL": 8, "target_cudagraph_PIECEWISE": 2}
    monkeypatch.setenv(profiling.ENV, str(tmp_path / "next.json"))
    timer.end_step()  # a new profile starts from zero
    assert timer.counts == {}

"""Optional per-phase timing of DDTree decode steps (CUDA events; off unless VLLM_DDTREE_PROFILE is set).

While `VLLM_DDTREE_PROFILE=/path/profile.json` is set (checked once per step, so an in-process engine can switch
it on and off), the runner records an event at each phase boundary of a step and writes mean GPU and host
milliseconds per phase to that file every 10 steps, and counts of what the steps ran (`count`: e.g. the CUDA-graph
mode of the target forward). Only steps that verify drafts count (prefills are skipped).
Reading the events synchronizes once per step, so profiled steps are for breakdowns, not for end-to-end timings.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict

import torch

ENV = "VLLM_DDTREE_PROFILE"


class StepTimer:
    """Marks name the end of a phase; phase time = time between the previous mark and this one."""

    def __init__(self):
        self.path: str | None = None
        self.marks: list[tuple[str, torch.cuda.Event, float]] = []
        self.skipping = False
        self.gpu_ms: dict[str, float] = defaultdict(float)
        self.host_ms: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.steps = 0

    def mark(self, name: str) -> None:
        if self.path is None:
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.marks.append((name, event, time.perf_counter()))

    def count(self, name: str) -> None:
        """Count one occurrence of `name` in this profile (totals, not per step)."""
        if self.path is not None:
            self.counts[name] += 1

    def skip_step(self) -> None:
        """Leave the current step out of the figures: a step without tree verification (a prefill), whose forward
        would otherwise land in the phase before the drafter (seen in session 14: 7.5 ms per step at batch 32)."""
        self.skipping = True

    def end_step(self) -> None:
        """Account the step that just ended, then (re)read the switch for the next one."""
        marks, self.marks = self.marks, []
        skipped, self.skipping = self.skipping, False
        if len(marks) >= 2 and not skipped:
            marks[-1][1].synchronize()
            for (_, start, host_start), (name, end, host_end) in zip(marks, marks[1:]):
                self.gpu_ms[name] += start.elapsed_time(end)
                self.host_ms[name] += (host_end - host_start) * 1e3
            self.steps += 1
            if self.steps % 10 == 0:
                self.write()
        path = os.environ.get(ENV) or None
        if path != self.path:
            if self.path is not None and self.steps:
                self.write()
            self.path = path
            self.gpu_ms.clear()
            self.host_ms.clear()
            self.counts.clear()
            self.steps = 0

    def write(self) -> None:
        summary = {
            "steps": self.steps,
            "gpu_ms": {k: v / self.steps for k, v in self.gpu_ms.items()},
            "host_ms": {k: v / self.steps for k, v in self.host_ms.items()},
            "counts": dict(self.counts),
        }
        with open(self.path, "w") as f:
            json.dump(summary, f, indent=1)


class _NoTimer:
    def mark(self, name: str) -> None:
        pass

    def count(self, name: str) -> None:
        pass

    def skip_step(self) -> None:
        pass

    def end_step(self) -> None:
        pass


def step_timer(device: torch.device):
    return StepTimer() if torch.device(device).type == "cuda" else _NoTimer()

"""Timing of the expert-parallel exchanges (the bench reports the share of step time spent in
dispatch/combine)."""

from __future__ import annotations

import time

import torch


class CommTimer:
    """Wall time spent in dispatch/combine exchanges, forward and backward. On CUDA it synchronises the
    device around each exchange while enabled, so leave it disabled outside benchmarks."""

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self.seconds = 0.0

    def measure(self, device: torch.device) -> _Span:
        return _Span(self, device)


class _Span:
    def __init__(self, timer: CommTimer, device: torch.device) -> None:
        self.timer, self.device = timer, device

    def __enter__(self) -> None:
        if self.timer.enabled:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        if self.timer.enabled:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.timer.seconds += time.perf_counter() - self.start

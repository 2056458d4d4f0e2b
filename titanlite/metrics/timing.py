"""Per-step phase timing: data wait, forward+backward, optimizer step.

`StepTimer.phase(name)` wraps a region of the training step. This first version measures host
wall clock only (correct on CPU; on GPU it sees launch time, not device time). The observability
issue replaces the internals with CUDA events and the per-rank breakdown; call sites stay as they are.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch


class StepTimer:
    PHASES = ("data", "compute", "optimizer")

    def __init__(self, device: torch.device):
        self.device = device
        self.totals: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] += time.perf_counter() - t0

    def collect(self) -> dict[str, float]:
        """Seconds per phase since the last collect (called on log steps only), then reset."""
        out = {k: self.totals.get(k, 0.0) for k in self.PHASES}
        self.totals.clear()
        return out

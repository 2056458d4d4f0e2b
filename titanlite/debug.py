"""Faults injected on purpose (config section `debug`), to validate the scaling diagnosis.

Each hook is called at a fixed point of the training step and does nothing unless configured.
"""

from __future__ import annotations

import time


class FaultInjector:
    def __init__(self, debug_cfg, rank: int):
        self.cfg = debug_cfg
        self.active = debug_cfg.inject_rank in (-1, rank)

    def data(self) -> None:
        """Called after each micro-batch is fetched (inside the data-wait phase)."""
        if self.active and self.cfg.inject_data_delay_ms > 0:
            time.sleep(self.cfg.inject_data_delay_ms / 1000)

    def compute(self) -> None:
        """Called inside the compute phase of each micro-step."""

    def comm(self) -> None:
        """Called before the gradient synchronisation of each optimizer step."""

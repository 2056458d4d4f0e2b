"""SIGTERM / SIGINT (preemption, Ctrl-C): finish the current step, save, exit cleanly.

The handler only records the signal; the training loop asks `requested()` after each step. With
several ranks the answer is agreed over a gloo group (a host-side all-reduce of one integer, no GPU
sync), because ranks see a signal at slightly different moments and must all stop after the same
step: a rank saving while another starts the next step's collectives would hang both.
"""

from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGINT)
REPEAT_GRACE_S = 2.0  # torchrun forwards a Ctrl-C its workers also got: a repeat this soon is that echo


class Preemption:
    def __init__(self, group=None):
        self.group = group
        self.received: str | None = None
        self._at: float | None = None  # when this rank itself got its first signal (a peer's flag sets none)
        self._previous = {}

    def install(self) -> None:
        """Catch the signals (for the training loop only: `restore` gives them back)."""
        try:
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        except ValueError:  # not the main thread: signals cannot be caught here
            self._previous = {}

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self._at is not None and now - self._at > REPEAT_GRACE_S:
            self.restore()  # a second, deliberate signal: stop waiting for the step to finish
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: aborting without a checkpoint")
        if self._at is None:
            # The first signal this rank sees, even when a peer's flag already stopped it: torchrun
            # signals every rank, and one that hears of it from a peer first must still save.
            self.received, self._at = signal.Signals(signum).name, now

    def requested(self) -> bool:
        """True on every rank once any rank has received a signal (call on every rank, every step)."""
        flag = self.received is not None
        if self.group is None:
            return flag
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        if t.item() and self.received is None:
            self.received = "a signal on another rank"
        return bool(t.item())

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

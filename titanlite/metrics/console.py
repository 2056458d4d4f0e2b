"""Rank-0 console: one concise line per log step and a progress bar with ETA.

The bar is drawn only when stderr is a terminal; in files and CI the log lines carry the step
count and ETA instead, and no colour codes are ever written to a non-terminal.
"""

from __future__ import annotations

import sys
import time


class Console:
    def __init__(self, enabled: bool, total_steps: int, progress_bar: bool = True, start_step: int = 0):
        self.enabled, self.total, self.t0 = enabled, total_steps, time.perf_counter()
        self.start_step = start_step  # a resumed run's ETA counts only the steps this process ran
        self.bar = None
        if enabled and progress_bar and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, desc="train", unit="step", dynamic_ncols=True, leave=False)

    def _write(self, line: str) -> None:
        if not self.enabled or not line:
            return
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def info(self, line: str) -> None:
        self._write(line)

    def advance(self, step: int) -> None:
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()

    def log_step(self, e: dict) -> None:
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / max(e["iter"] - self.start_step, 1) * (self.total - e["iter"])
        mfu = f" | mfu {e['mfu']:5.1f}%" if e.get("mfu") is not None else ""
        gpu = f" | gpu {e['gpu_util_pct']:.0f}% {e['power_w']:.0f} W" if e.get("gpu_util_pct") is not None else ""
        self._write(
            f"step {e['iter']:>6}/{self.total} | loss {e['loss']:7.4f} | lr {e['lr']:.2e} | gnorm {e['grad_norm']:6.3f}"
            f" | {e['time_ms']:8.1f} ms/step | {e['tokens_per_sec']:>10,.0f} tok/s{mfu}"
            f" | mem {e['memory_peak_gb']:.2f} GiB{gpu} | eta {_fmt(eta)}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _fmt(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"

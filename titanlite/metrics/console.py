"""Rank-0 console: one concise line per log step and a progress bar with ETA.

The bar is drawn only when stderr is a terminal; in files and CI the log lines carry the step
count and ETA instead, and no colour codes are ever written to a non-terminal. The ETA is the steps
left times the steady step time (validation and checkpoint saves not counted).
"""

from __future__ import annotations

import bisect
import sys

from titanlite.metrics.run_log import warmup_cutoff


class Console:
    def __init__(self, enabled: bool, total_steps: int, progress_bar: bool = True, start_step: int = 0):
        self.enabled, self.total = enabled, total_steps
        self.start_step = start_step  # a resumed run's ETA counts only the steps this process ran
        self.iters: list[int] = []  # this process's log steps (counted from its start) ...
        self.time_sums: list[float] = [0.0]  # ... and the running sum of their time_ms (O(log n) per ETA)
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
        self.iters.append(e["iter"] - self.start_step)
        self.time_sums.append(self.time_sums[-1] + e["time_ms"])
        eta = (self.total - e["iter"]) * self.steady_step_ms() / 1000
        mfu = f" | mfu {e['mfu']:5.1f}%" if e.get("mfu") is not None else ""
        gpu = f" | gpu {e['gpu_util_pct']:.0f}% {e['power_w']:.0f} W" if e.get("gpu_util_pct") is not None else ""
        self._write(
            f"step {e['iter']:>6}/{self.total} | loss {e['loss']:7.4f} | lr {e['lr']:.2e} | gnorm {e['grad_norm']:6.3f}"
            f" | {e['time_ms']:8.1f} ms/step | {e['tokens_per_sec']:>10,.0f} tok/s{mfu}"
            f" | mem {e['memory_peak_gb']:.2f} GiB{gpu} | eta {_fmt(eta)}")

    def steady_step_ms(self) -> float:
        """The mean step time of this process's steady log steps (the run log's steady-state rule:
        start-up, compilation and warm-up left out once there are later steps to go by)."""
        first = bisect.bisect_right(self.iters, warmup_cutoff(self.iters[-1]))
        first = min(first, len(self.iters) - 1)  # all within the warm-up: the last entry, as the rule says
        return (self.time_sums[-1] - self.time_sums[first]) / (len(self.iters) - first)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _fmt(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"

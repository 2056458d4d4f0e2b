"""Rank-0 console: one concise line per log step and a progress bar with ETA.

The bar is drawn only when stderr is a terminal; in files and CI the log lines carry the step
count and ETA instead, and no colour codes are ever written to a non-terminal. The ETA is the steps
left times the steady step time (validation and checkpoint saves not counted).
"""

from __future__ import annotations

import sys

from titanlite.metrics.run_log import mean, steady


class Console:
    def __init__(self, enabled: bool, total_steps: int, progress_bar: bool = True, start_step: int = 0):
        self.enabled, self.total = enabled, total_steps
        self.start_step = start_step  # a resumed run's ETA counts only the steps this process ran
        self.step_times: list[dict] = []  # this process's log steps: iter (from its start), time_ms
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
        self.step_times.append({"iter": e["iter"] - self.start_step, "time_ms": e["time_ms"]})
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
        return mean(e["time_ms"] for e in steady(self.step_times).entries) or 0.0

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _fmt(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"

"""TensorBoard scalars (metrics.enable_tensorboard): <dump_folder>/tb/run_<stamp>/, rank 0 only."""

from __future__ import annotations

import os

from titanlite.errors import require

# run-log entry key -> TensorBoard tag
SCALARS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "time_ms": "perf/time_ms",
           "tokens_per_sec": "perf/tokens_per_sec", "tokens_per_sec_per_gpu": "perf/tokens_per_sec_per_gpu",
           "tflops": "perf/tflops", "mfu": "perf/mfu_pct", "memory_gb": "memory/allocated_gb",
           "memory_peak_gb": "memory/peak_gb", "memory_reserved_gb": "memory/reserved_gb"}


def step_scalars(e: dict) -> dict[str, float]:
    """The scalars of a run-log entry, by tag (what TensorBoard and W&B log): the figures of SCALARS,
    the median over ranks of each breakdown figure and the GPU counters, where present."""
    out = {tag: e[key] for key, tag in SCALARS.items() if e.get(key) is not None}
    for fig, s in (e.get("breakdown") or {}).get("stats", {}).items():
        if s["median"] is not None:
            out[f"breakdown/{fig}_median"] = s["median"]
    for key in ("gpu_util_pct", "power_w", "sm_clock_mhz"):
        if e.get(key) is not None:
            out[f"gpu/{key}"] = e[key]
    return out


class TensorBoard:
    def __init__(self, dump_folder: str, stamp: str):
        require("tensorboard", "metrics.enable_tensorboard")
        from torch.utils.tensorboard import SummaryWriter
        self.log_dir = os.path.join(dump_folder, "tb", f"run_{stamp}")
        self.writer = SummaryWriter(log_dir=self.log_dir)

    def log_step(self, e: dict) -> None:
        for tag, value in step_scalars(e).items():
            self.writer.add_scalar(tag, value, e["iter"])
        self.writer.flush()

    def log_validation(self, step: int, val_loss: float) -> None:
        self.writer.add_scalar("val/loss", val_loss, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()

"""profiling.enable: a torch.profiler trace of steps [start_step, start_step + num_steps), one file per rank.

Traces land in <dump_folder>/profile_traces/step<a>-<b>/rank<r>.json (Chrome trace format: open in
https://ui.perfetto.dev or chrome://tracing). With profiling.memory_snapshot on CUDA, the allocator's
history over the same window goes to rank<r>_memory_snapshot.pickle (https://pytorch.org/memory_viz).
A later run in the same dump folder overwrites traces of the same window.
"""

from __future__ import annotations

import logging
import os
import time

import torch

logger = logging.getLogger("titanlite")


class StepProfiler:
    def __init__(self, cfg, dump_folder: str, rank: int, device: torch.device):
        self.cfg, self.rank, self.cuda = cfg, rank, device.type == "cuda"
        self.first, self.stop_at = cfg.start_step, cfg.start_step + cfg.num_steps
        self.folder = os.path.join(dump_folder, "profile_traces", f"step{self.first}-{self.stop_at - 1}")
        self.prof = None
        self.snapshot = cfg.memory_snapshot and self.cuda
        if cfg.enable and cfg.memory_snapshot and not self.cuda and rank == 0:
            logger.warning("profiling.memory_snapshot needs CUDA: no memory snapshot on this device")
        self.paths: list[str] = []

    def step(self, step: int) -> float:
        """Call before running `step` (1-based): opens the window at start_step, closes it after.
        Returns the seconds spent starting or writing, which the caller keeps out of step timing."""
        if not self.cfg.enable or step not in (self.first, self.stop_at):
            return 0.0
        t0 = time.perf_counter()
        if step == self.first and self.prof is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities, record_shapes=True)
            if self.snapshot:
                torch.cuda.memory._record_memory_history(max_entries=200_000)
            self.prof.start()
        elif step == self.stop_at:
            self.close()
        return time.perf_counter() - t0

    def close(self) -> None:
        """Stop and write the trace (also at the end of a run that stops inside the window)."""
        if self.prof is None:
            return
        if self.cuda:
            torch.cuda.synchronize()
        self.prof.stop()
        os.makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, f"rank{self.rank}.json")
        self.prof.export_chrome_trace(path)
        self.paths.append(path)
        if self.snapshot:
            snap = os.path.join(self.folder, f"rank{self.rank}_memory_snapshot.pickle")
            torch.cuda.memory._dump_snapshot(snap)
            torch.cuda.memory._record_memory_history(enabled=None)
            self.paths.append(snap)
        self.prof = None
        logger.info(f"rank {self.rank}: profiler trace written to {path}")

"""Faults injected on purpose (config section `debug`), to validate the scaling diagnosis.

Each hook is called at a fixed point of the training step and does nothing unless configured, so
a clean run pays one attribute check per hook. `python -m titanlite.diagnose` must name each fault:

| option                          | fault                     | diagnosed as                      |
|---------------------------------|---------------------------|-----------------------------------|
| inject_compute_matmuls (all)    | slower compute everywhere | compute_stall                     |
| inject_compute_matmuls + rank k | one slow rank             | straggler                         |
| inject_data_delay_ms (all)      | slow input pipeline       | data_stall                        |
| inject_data_delay_ms + rank k   | one rank waits for data   | straggler                         |
| inject_comm_mb                  | extra collective traffic  | communication                     |
| inject_shared_device            | every rank on one device  | compute_stall                     |

`inject_oom_step` plants a CUDA out-of-memory error (torch.OutOfMemoryError, as the allocator raises
it) in that step's last micro-step, before its forward, on inject_rank, on any device: the failure's
one line, exit code and traceback file (titanlite.train) are tested on CPU with it.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist


class FaultInjector:
    def __init__(self, debug_cfg, rank: int):
        self.cfg = debug_cfg
        self.active = debug_cfg.inject_rank in (-1, rank)
        self._mats = None  # (a, b, out) for the compute stall, built on first use on this rank's device
        self._comm_buf = None
        self._steps = 0  # optimizer steps begun (comm() is called once in each)

    def data(self) -> None:
        """Called after each micro-batch is fetched (inside the data-wait phase)."""
        if self.active and self.cfg.inject_data_delay_ms > 0:
            time.sleep(self.cfg.inject_data_delay_ms / 1000)

    def compute(self) -> None:
        """Called inside the compute phase of each micro-step: extra matmuls on the training device,
        queued like the model's own kernels, so device timers see them as compute; at inject_oom_step,
        an out-of-memory error."""
        if self.active and self.cfg.inject_oom_step and self._steps == self.cfg.inject_oom_step:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 1.00 GiB (planted by "
                                         f"debug.inject_oom_step={self.cfg.inject_oom_step})")
        if not (self.active and self.cfg.inject_compute_matmuls > 0):
            return
        if self._mats is None:
            device, dtype = _current_device()
            n = self.cfg.inject_matmul_size
            a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
            self._mats = (a, b, torch.empty_like(a))
        a, b, out = self._mats
        for _ in range(self.cfg.inject_compute_matmuls):
            torch.mm(a, b, out=out)

    def comm(self) -> None:
        """Called before the gradient synchronisation of each optimizer step: all-reduce a dummy
        buffer. Every rank takes part whatever inject_rank says: a collective needs them all. Called
        once per optimizer step (before its last micro-step's compute), so it also counts the steps."""
        self._steps += 1
        if self.cfg.inject_comm_mb <= 0 or not dist.is_initialized() or dist.get_world_size() == 1:
            return
        if self._comm_buf is None:
            device, _ = _current_device()
            self._comm_buf = torch.zeros(int(self.cfg.inject_comm_mb * 2**20) // 4, device=device)
        dist.all_reduce(self._comm_buf)


def _current_device() -> tuple[torch.device, torch.dtype]:
    """The device init_distributed selected (it calls torch.cuda.set_device), and a dtype that
    runs at full speed there."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    return torch.device("cpu"), torch.float32


def share_one_cpu_core() -> None:
    """debug.inject_shared_device on CPU: pin this process, and so every rank, to the same core,
    with one compute thread: the CPU analogue of all ranks on one GPU."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)

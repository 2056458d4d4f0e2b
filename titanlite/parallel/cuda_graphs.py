"""training.cuda_graphs: capture one whole training iteration as a CUDA graph and replay it.

After `training.cuda_graphs_warmup` eager steps (run on a side stream, as capture requires), the
next step is captured: every micro-batch's forward and backward, the gradient clip and the
optimizer step, reading its inputs from static buffers. Later steps copy their batches into those
buffers and replay the graph; only the lr scheduler (which writes the lr tensor in place) runs on
the host. The optimizer is built capturable (lr and step counters on device; titanlite.optim).

The captured gradients are the static tensors the graph writes: the first backward of a captured
step assigns them (they were None at capture), later micro-steps accumulate, so nothing zeroes
them between replays.

Safety: capture executes nothing, so when it fails (an op that syncs with the host, a collective
library without graph support, ...) the reason is logged once, the graph is dropped and the same
batches run eagerly: a failure costs speed, never a wrong result. Ranks agree on the outcome so
that all of them fall back together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch
import torch.distributed as dist

from titanlite.parallel.modes import MODES
from titanlite.step import TrainStep

logger = logging.getLogger("titanlite")


class CudaGraphStep:
    """Warm-up stream, capture, replay and fallback for the whole training iteration."""

    def __init__(self, step: TrainStep, device: torch.device, warmup: int, dp_mode: str):
        # The captured step keeps its gradients: the first backward of each replay writes them afresh
        self.step_fn = dataclasses.replace(step, zero_grad=False)
        self.optimizer, self.grad_accum, self.device = step.optimizer, step.grad_accum, device
        self.warmup = max(warmup, MODES[dp_mode].min_graph_warmup)  # DDP settles its buckets first
        self.graph = None
        self.failed = False
        self.static_batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.static_out: tuple[torch.Tensor, torch.Tensor] | None = None
        self.side_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @staticmethod
    def available(device: torch.device) -> tuple[bool, str]:
        if device.type != "cuda":
            return False, f"CUDA graphs need a CUDA device (this run is on {device.type})"
        return True, ""

    @classmethod
    def build(cls, enabled: bool, step: TrainStep, device: torch.device, warmup: int, dp_mode: str,
              is_main: bool = True) -> "CudaGraphStep | None":
        """The graph helper, or None (logged once) when CUDA graphs are off or cannot run here."""
        if not enabled:
            return None
        ok, why = cls.available(device)
        if not ok:
            if is_main:
                logger.warning(f"training.cuda_graphs is unavailable: {why}; training eagerly")
            return None
        return cls(step, device, warmup, dp_mode)

    def ready(self, steps_done: int) -> bool:
        """True when this step should capture or replay (warm-up done, no earlier failure)."""
        return not self.failed and steps_done >= self.warmup

    def warmup_context(self):
        """Eager steps before capture run on a side stream: capture happens off the default stream,
        and the lazily created state (cuBLAS workspaces, DDP buckets) must be made there too."""
        if self.side_stream is None or self.graph is not None or self.failed:
            return contextlib.nullcontext()
        return self._on_side_stream()

    @contextlib.contextmanager
    def _on_side_stream(self):
        self.side_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side_stream):
            yield
        torch.cuda.current_stream(self.device).wait_stream(self.side_stream)

    def _capture(self, batches) -> None:
        self.static_batches = [(x.clone(), y.clone()) for x, y in batches]
        self.optimizer.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # the eager step without hooks: what gets captured
            out = self.step_fn(self.static_batches.__getitem__)
            self.static_out = out.loss, out.grad_norm
        self.graph = graph

    def _agree(self, failed: bool) -> bool:
        """True if any rank failed: all ranks then fall back together (collectives stay matched)."""
        if not (dist.is_available() and dist.is_initialized()):
            return failed
        flag = torch.tensor([1.0 if failed else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def release(self) -> None:
        """Free the captured graph. Call before destroy_process_group: a live graph holding NCCL
        kernels makes the communicator's destruction hang (pytorch/pytorch#115388; seen here as a
        captured DDP run on 2 GPUs that did not exit within its timeout)."""
        if self.graph is not None:
            torch.cuda.synchronize(self.device)
            self.graph.reset()
        self.graph, self.static_out, self.static_batches = None, None, []

    def step(self, batches) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Run one captured step on `batches`; None when capture failed (then run them eagerly)."""
        if self.graph is None:
            error = None
            try:
                self._capture(batches)
            except Exception as e:  # any capture failure: report it, never train on a broken graph
                error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if self._agree(error is not None):
                self.graph, self.static_out, self.static_batches, self.failed = None, None, [], True
                self.optimizer.zero_grad(set_to_none=True)
                logger.warning(f"CUDA graph capture failed ({error or 'on another rank'}); "
                               f"continuing without CUDA graphs")
                return None
            logger.info(f"captured the training step as a CUDA graph ({self.grad_accum} micro-batches); replaying it")
        else:
            for (sx, sy), (x, y) in zip(self.static_batches, batches):
                sx.copy_(x, non_blocking=True)
                sy.copy_(y, non_blocking=True)
        self.graph.replay()
        loss, grad_norm = self.static_out
        return loss.clone(), grad_norm.clone()  # the next replay overwrites the static outputs

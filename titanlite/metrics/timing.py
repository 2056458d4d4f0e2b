"""Per-step phase timing: data wait, forward+backward compute, exposed gradient communication, optimizer.

`StepTimer.phase(name)` wraps a region of the training step; on log steps `take()` hands over the
marks since the last take and `collect(marks)` turns them into milliseconds per phase.

- GPU: each phase boundary records a CUDA event on the current stream, so a phase's figure is
  *device* time between its two boundaries (it includes the GPU idling while the host catches up,
  and excludes host time the GPU did not notice). Events are only read in `collect`, after the
  trainer waited for the log step's own mark (`wait`): no sync is added to other steps.
- CPU: the same boundaries with `time.perf_counter()`.

Exposed communication, measured at both ends of the compute phase. Every parameter gets a post-accumulate-grad hook that marks "this gradient
is ready" (re-recording one event / clock per micro-step, so the last mark wins). The backward
finishes compute at the last mark; anything after it up to the end of the compute phase is the
wait for the data-parallel gradient reduction (DDP waits for its buckets at the end of backward).
And a DDP-style wrapper (one holding the model as `.module`) may run its own collective before the
model's forward (DDP's buffer broadcast; titanlite turns it off, so an early rank waits in the
gradient reduction instead): a pre-hook on the wrapper and one on the wrapped model bracket that.
So exposed comm = (wrapped forward start - wrapper forward start) + (end of compute phase - last
gradient ready), and compute is reported without it.
A `phase("comm")` region (an explicit collective outside backward) counts as comm too.
When no hook fires (FSDP2 accumulates into unsharded copies, not the registered parameters), the
wait cannot be separated: comm is reported as None and stays inside compute.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.nn as nn


class StepTimer:
    PHASES = ("data", "compute", "optimizer")

    def __init__(self, device: torch.device, model: nn.Module | None = None):
        self.device = device
        self.cuda = device.type == "cuda"
        self.method = "cuda_events" if self.cuda else "wall_clock"
        # (phase, start, end, last grad ready, (wrapper forward start, wrapped forward start))
        self._done: list[tuple] = []
        self._in_compute = False
        self._grad_mark = None
        self._fwd_marks: list = []
        self.hooked = 0
        if model is not None:
            self.watch_gradients(model)

    def watch_gradients(self, model: nn.Module) -> None:
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
                self.hooked += 1
        inner = getattr(model, "module", None)
        if isinstance(inner, nn.Module):
            model.register_forward_pre_hook(self._on_forward, prepend=True)
            inner.register_forward_pre_hook(self._on_forward, prepend=True)

    def _on_forward(self, _module, _args) -> None:
        if self._in_compute and len(self._fwd_marks) < 2:  # the first forward of the micro-step only
            if self.cuda and torch.cuda.is_current_stream_capturing():
                return
            self._fwd_marks.append(self.mark())

    # ---- marks: a CUDA event on the current stream, or the host clock
    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def elapsed_ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1000

    def wait(self, mark) -> None:
        """Until the GPU has reached `mark` (a host-clock mark has been reached when it was taken)."""
        if self.cuda:
            mark.synchronize()

    def _on_grad_ready(self, _param) -> None:
        if not self._in_compute:
            return
        if self.cuda:
            if torch.cuda.is_current_stream_capturing():  # a CUDA-graph capture: nothing to time
                return  # one event per micro-step, re-recorded: its last record is the last gradient
            if self._grad_mark is None:
                self._grad_mark = torch.cuda.Event(enable_timing=True)
            self._grad_mark.record()
        else:
            self._grad_mark = time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str):
        if self.cuda and torch.cuda.is_current_stream_capturing():  # events cannot be timed inside a graph capture
            yield
            return
        compute = name == "compute"
        if compute:
            self._in_compute, self._grad_mark, self._fwd_marks = True, None, []
        start = self.mark()
        try:
            yield
        finally:
            end = self.mark()
            fwd = tuple(self._fwd_marks) if compute and len(self._fwd_marks) == 2 else None
            self._done.append((name, start, end, self._grad_mark if compute else None, fwd))
            if compute:
                self._in_compute = False

    def take(self) -> list[tuple]:
        """The phase marks since the last take, handed over (for `collect` once they are done)."""
        done, self._done = self._done, []
        return done

    def collect(self, marks: list[tuple]) -> dict[str, float | None]:
        """Milliseconds per phase of `marks` (from `take`; on CUDA their events must have completed).
        Keys: data, compute, comm, optimizer.

        compute excludes the exposed gradient-sync wait reported as comm; comm is None when it
        could not be measured (then compute includes it)."""
        out: dict[str, float | None] = {k: 0.0 for k in self.PHASES}
        comm, comm_known = 0.0, True
        for name, start, end, grad, fwd in marks:
            total = self.elapsed_ms(start, end)
            if name == "comm":  # an explicit collective outside backward, wrapped by the caller
                comm += total
                continue
            if name == "compute":
                if grad is None:
                    comm_known = False
                else:
                    wait = max(self.elapsed_ms(grad, end), 0.0)
                    if fwd is not None:
                        wait += max(self.elapsed_ms(*fwd), 0.0)
                    comm += wait
                    total -= wait
            out[name] = out.get(name, 0.0) + total
        out["comm"] = comm if comm_known else None
        if not comm_known:  # cannot separate: compute keeps all communication, as measured
            out["compute"] += comm
        return out

"""One training step: forward and backward over the micro-batches (gradient accumulation), the
gradient clip and the optimizer update; and its CUDA-graph runner, which captures the step once and
replays it.

The same `TrainStep` serves three callers, each watching it through its own `StepHooks`:
- the Trainer's loop (phase timers and fault injection), eagerly or through `CudaGraphStep`;
- CUDA graphs, which capture one call and replay it (no hooks, gradients left in place);
- estimation's fake run on fake tensors (memory phases per micro-step).
The lr scheduler, logging and checkpoints stay with the caller: a replayed graph skips this code.
Beside it: the NaN policy on the logged losses, and the validation loss.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from titanlite.config import parallel_settings
from titanlite.ops.loss import cross_entropy
from titanlite.ops.master_linear import MasterWeights
from titanlite.parallel.apply import float8_scale_hook
from titanlite.parallel.grads import FusedClip, clip_grad_norm, fused_clip_target, grad_sync, release_grads
from titanlite.parallel.modes import MODES
from titanlite.parallel.policy import autocasts

logger = logging.getLogger("titanlite")

Batch = tuple[torch.Tensor, torch.Tensor]
_NULL = contextlib.nullcontext()


class StepHooks:
    """Where a caller observes a step. Each method returns a context manager around that part."""

    def data(self, micro: int):
        """Around fetching micro-batch `micro`."""
        return _NULL

    def micro_step(self, micro: int, last: bool):
        """Around one micro-batch's forward and backward (`last`: its backward syncs gradients)."""
        return _NULL

    def backward(self, micro: int, last: bool):
        """Around one micro-batch's backward alone (inside micro_step)."""
        return _NULL

    def optimizer(self):
        """Around the clip, the update and the gradients' release."""
        return _NULL


NO_HOOKS = StepHooks()


def make_forward_loss(model: nn.Module, loss: str, autocast_device: str | None,
                      compile_loss: bool = False) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Mean token loss of one micro-batch.

    `loss` is training.loss: "chunked" runs the output layer and the loss in token chunks inside the
    model's forward; "cross_entropy" takes full logits. `compile_loss` (compile.enable) compiles either
    loss: the chunked one's per-chunk softmax / gradient kernel (the model is told at each call), or
    the full-logits cross-entropy.
    `autocast_device` is the device type to run bf16 autocast on, or None (parallel.policy.autocasts).
    """
    loss_fn = torch.compile(cross_entropy) if compile_loss and loss == "cross_entropy" else cross_entropy

    def forward_loss(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        ctx = torch.autocast(autocast_device, dtype=torch.bfloat16) if autocast_device else _NULL
        with ctx:
            if loss == "chunked":
                return model(inputs, labels, compile_loss=compile_loss)
            logits = model(inputs)
        return loss_fn(logits, labels)

    return forward_loss


@dataclasses.dataclass
class StepOut:
    loss: torch.Tensor       # mean loss over the micro-batches (on device)
    grad_norm: torch.Tensor  # global gradient norm before clipping (on device)
    skipped: bool            # on_nan=skip found non-finite gradients on the host and did not update


@dataclasses.dataclass
class TrainStep:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    forward_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    grad_accum: int
    max_norm: float
    # Where the clip scale goes into the optimizer's update kernel (fused clip), or None
    clip_into: FusedClip | None = None
    # training.on_nan: "skip" drops an update with non-finite gradients (on the device when the
    # optimizer can, else after one host sync); "stop" leaves it to the caller's loss check
    on_nan: str = "stop"
    # Release gradients after the update. A captured graph keeps them: its first backward writes
    # them afresh on every replay.
    zero_grad: bool = True
    # The bf16 copies' fp32 masters, whose gradients ddp keeps in its buckets (grads.release_grads)
    masters: MasterWeights | None = None
    # The data-parallel ranks (ParallelDims.dp_group; None for one rank): those whose collectives the step
    # matches, so a captured step's failure is agreed over them (CudaGraphStep)
    group: dist.ProcessGroup | None = None

    @property
    def skips_on_device(self) -> bool:
        return self.on_nan == "skip" and self.clip_into is not None

    def __call__(self, next_batch: Callable[[int], Batch], hooks: StepHooks = NO_HOOKS) -> StepOut:
        """Run the step on micro-batches `next_batch(0) ... next_batch(grad_accum - 1)`."""
        total = None
        for micro in range(self.grad_accum):
            with hooks.data(micro):
                inputs, labels = next_batch(micro)
            last = micro == self.grad_accum - 1
            with hooks.micro_step(micro, last), grad_sync(self.model, last):
                loss = self.forward_loss(inputs, labels) / self.grad_accum
                with hooks.backward(micro, last):
                    loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        skipped = False
        with hooks.optimizer():
            skip = self.on_nan == "skip"
            grad_norm = clip_grad_norm(self.model, self.max_norm, self.clip_into, skip_nonfinite=skip)
            if skip and not self.skips_on_device and not torch.isfinite(grad_norm):  # one host sync
                # the norm is global after the gradient sync, so every rank skips together, and an
                # overflow in backward with a finite loss is caught too
                skipped = True
            else:
                self.optimizer.step()  # a fused kernel skips a non-finite step on the device itself
            if self.zero_grad:
                release_grads(self.model, self.optimizer, self.masters, self.grad_accum)
        return StepOut(total, grad_norm, skipped)


def build_train_step(model: nn.Module, optimizer: torch.optim.Optimizer, cfg, grad_accum: int, dims,
                     masters: MasterWeights | None = None) -> TrainStep:
    """The step a run of `cfg` takes on `dims` (titanlite.parallel.dims.ParallelDims): its loss, bf16
    autocast where the run policy says so (titanlite.parallel.policy.autocasts), the clip fused into
    the optimizer where the optimizer can take it (optimizer.fuse_clip) and the NaN policy; `masters`:
    parallelize's. Work that follows every update (float8's scale precompute under FSDP) is registered
    as the optimizer's post-step hook, so a captured step replays it too."""
    settings = parallel_settings(cfg)
    hook = float8_scale_hook(model, settings.float8)
    if hook is not None:
        optimizer.register_step_post_hook(hook)
    autocast = dims.device.type if autocasts(settings.precision, MODES[dims.mode], dims.device.type) else None
    return TrainStep(
        model, optimizer, make_forward_loss(model, cfg.training.loss, autocast, compile_loss=cfg.compile.enable),
        grad_accum, cfg.training.max_norm,
        clip_into=fused_clip_target(optimizer) if cfg.optimizer.fuse_clip else None,  # into the AdamW kernel
        on_nan=cfg.training.on_nan, masters=masters, group=dims.dp_group)


class NonFiniteLossError(RuntimeError):
    """training.on_nan=stop: the loss of a step was NaN or infinite."""


def global_step_losses(losses: list[torch.Tensor], group: dist.ProcessGroup | None) -> torch.Tensor:
    """Each step's loss averaged over the data-parallel ranks `group` (ParallelDims.dp_group; None: one
    rank), each of which saw its own micro-batches; on device: queued work, no host sync."""
    stacked = torch.stack(losses).float()
    if group is not None:
        dist.all_reduce(stacked, op=dist.ReduceOp.AVG, group=group)
    return stacked


def check_finite(step_losses: list[float], last_step: int, on_nan: str) -> None:
    """training.on_nan=stop: raise naming the first step (of those ending at `last_step`) whose loss
    is not finite."""
    first = last_step - len(step_losses) + 1
    bad = [first + i for i, v in enumerate(step_losses) if not math.isfinite(v)]
    if bad and on_nan == "stop":
        raise NonFiniteLossError(f"loss became non-finite at step {bad[0]} (training.on_nan=stop); "
                                 f"lower optimizer.lr or set training.on_nan=skip")


@torch.no_grad()
def validation_loss(model: nn.Module, batches, steps: int, forward_loss, device: torch.device,
                    group: dist.ProcessGroup | None) -> float:
    """Mean loss over up to `steps` validation batches, averaged over the data-parallel ranks `group`
    (ParallelDims.dp_group; None: one rank)."""
    model.eval()
    total, n = torch.zeros((), device=device), 0
    for _ in range(steps):
        try:
            inputs, labels = next(batches)
        except StopIteration:
            break
        total += forward_loss(inputs.to(device), labels.to(device))
        n += 1
    model.train()
    stats = torch.stack([total, torch.tensor(float(n), device=device)])
    if group is not None:
        dist.all_reduce(stats, group=group)
    return (stats[0] / stats[1].clamp(min=1)).item()


class CudaGraphStep:
    """training.cuda_graphs: the step run as a CUDA graph, called as the eager `TrainStep` is.

    After `warmup` eager steps (run on a side stream, as capture requires), the next call captures
    every micro-batch's forward and backward, the gradient clip and the optimizer step, reading its
    inputs from static buffers; later calls copy their batches into those buffers and replay the
    graph. The optimizer is built capturable (lr and step counters on device; titanlite.optim), so
    only the lr scheduler, which writes the lr tensor in place, runs on the host.

    The captured gradients are the static tensors the graph writes: the first backward of a captured
    step assigns them (they were None at capture), later micro-steps accumulate, so nothing zeroes
    them between replays.

    Safety: capture executes nothing, so when it fails (an op that syncs with the host, a collective
    library without graph support, ...) the reason is logged once, the graph is dropped and the same
    batches run eagerly: a failure costs speed, never a wrong result. Ranks agree on the outcome so
    that all of them fall back together."""

    def __init__(self, step: TrainStep, device: torch.device, warmup: int, dp_mode: str):
        self.eager = step
        # The captured step keeps its gradients: the first backward of each replay writes them afresh
        self.step_fn = dataclasses.replace(step, zero_grad=False)
        self.optimizer, self.grad_accum, self.device = step.optimizer, step.grad_accum, device
        self.warmup = max(warmup, MODES[dp_mode].min_graph_warmup)  # DDP settles its buckets first
        self.graph = None
        self.failed = False
        self.static_batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.static_out: tuple[torch.Tensor, torch.Tensor] | None = None
        self.side_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.calls = 0  # steps run by this process: warm-up restarts on resume
        self.captures = 0  # capture attempts: the step that captures runs far slower than a replay

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

    def __call__(self, next_batch: Callable[[int], Batch], hooks: StepHooks = NO_HOOKS) -> StepOut:
        """Run the step on micro-batches `next_batch(0) ... next_batch(grad_accum - 1)`: eagerly while
        warming up or after a failed capture, else as one replay."""
        self.calls += 1
        if self.failed or self.calls <= self.warmup:
            with self.warmup_context():
                return self.eager(next_batch, hooks)
        batches = []
        for micro in range(self.grad_accum):
            with hooks.data(micro):
                batches.append(next_batch(micro))
        with hooks.micro_step(self.grad_accum - 1, True):  # forward, backward and optimizer step in one replay
            out = self.step(batches)
        if out is None:  # capture failed: the batches it fetched run eagerly, so no data is skipped
            return self.eager(batches.__getitem__, hooks)
        return StepOut(*out, skipped=False)

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
        if self.eager.group is None:
            return failed
        flag = torch.tensor([1.0 if failed else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.eager.group)
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
            self.captures += 1
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

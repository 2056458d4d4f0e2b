"""One training step: forward and backward over the micro-batches (gradient accumulation), the
gradient clip and the optimizer update.

The same `TrainStep` serves three callers, each watching it through its own `StepHooks`:
- the Trainer's eager loop (phase timers and fault injection);
- CUDA graphs, which capture one call and replay it (no hooks, gradients left in place);
- estimation's fake run on fake tensors (memory phases per micro-step).
The lr scheduler, logging and checkpoints stay with the caller: a replayed graph skips this code.
Beside it: the NaN policy on the logged losses, and the validation loss.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable

import torch
import torch.nn as nn

from titanlite.ops.loss import cross_entropy
from titanlite.parallel.data_parallel import clip_grad_norm, grad_sync

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
    model's forward; "cross_entropy" takes full logits (compiled with the blocks when `compile_loss`).
    `autocast_device` is the device type to run bf16 autocast on, or None (parallel.policy.autocasts).
    """
    loss_fn = torch.compile(cross_entropy) if compile_loss and loss == "cross_entropy" else cross_entropy

    def forward_loss(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        ctx = torch.autocast(autocast_device, dtype=torch.bfloat16) if autocast_device else _NULL
        with ctx:
            if loss == "chunked":
                return model(inputs, labels)
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
    # The optimizer that takes the clip scale inside its update kernel (fused clip), or None
    clip_into: torch.optim.Optimizer | None = None
    # training.on_nan: "skip" drops an update with non-finite gradients (on the device when the
    # optimizer can, else after one host sync); "stop" leaves it to the caller's loss check
    on_nan: str = "stop"
    post_update: Callable[[], None] = lambda: None  # e.g. float8's scale precompute under FSDP
    # Release gradients after the update. A captured graph keeps them: its first backward writes
    # them afresh on every replay.
    zero_grad: bool = True

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
                self.post_update()
            if self.zero_grad:
                self.optimizer.zero_grad(set_to_none=True)
        return StepOut(total, grad_norm, skipped)


def build_train_step(model: nn.Module, optimizer: torch.optim.Optimizer, cfg, grad_accum: int,
                     autocast_device: str | None, compile_loss: bool | None = None) -> TrainStep:
    """The step a run of `cfg` takes: its loss, the clip fused into the optimizer where the optimizer
    can take it (optimizer.fuse_clip), the NaN policy and float8's post-update hook. `autocast_device`
    is the device type to autocast on (parallel.policy.autocasts), or None."""
    from titanlite.parallel.apply import float8_post_step
    from titanlite.parallel.data_parallel import fused_clip_supported

    fuse = cfg.optimizer.fuse_clip and fused_clip_supported(optimizer)
    return TrainStep(
        model, optimizer,
        make_forward_loss(model, cfg.training.loss, autocast_device,
                          compile_loss=cfg.compile.enable if compile_loss is None else compile_loss),
        grad_accum, cfg.training.max_norm,
        clip_into=optimizer if fuse else None,  # the clip scale goes into the AdamW kernel
        on_nan=cfg.training.on_nan, post_update=lambda: float8_post_step(model, cfg.float8))


class NonFiniteLossError(RuntimeError):
    """training.on_nan=stop: the loss of a step was NaN or infinite."""


def global_step_losses(losses: list[torch.Tensor], world_size: int) -> torch.Tensor:
    """Each step's loss averaged over the ranks (each saw its own micro-batches), on device: queued
    work, no host sync."""
    stacked = torch.stack(losses).float()
    if world_size > 1:
        import torch.distributed as dist

        dist.all_reduce(stacked, op=dist.ReduceOp.AVG)
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
                    world_size: int) -> float:
    """Mean loss over up to `steps` validation batches, averaged over the ranks."""
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
    if world_size > 1:
        import torch.distributed as dist

        dist.all_reduce(stats)
    return (stats[0] / stats[1].clamp(min=1)).item()

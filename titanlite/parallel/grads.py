"""Gradients across the wrappers: their sync over micro-steps, their release after the update, and the
global-norm clip (fused into the optimizer where it can take it, through the `FusedClip` interface)."""

from __future__ import annotations

import contextlib
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from titanlite.ops.master_linear import MasterWeights, release_stale
from titanlite.parallel.fsdp import set_gradient_sync


def is_fsdp(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def grad_sync(model: nn.Module, enabled: bool):
    """Context for one micro-step: gradients are reduced over ranks only when `enabled` (the last
    micro-step of an accumulation); earlier micro-steps accumulate locally."""
    if isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext() if enabled else model.no_sync()
    if is_fsdp(model):
        set_gradient_sync(model, enabled)  # FSDP's switch and its gradient transport's, kept by fsdp.py
    return contextlib.nullcontext()


def release_grads(model: nn.Module, optimizer: torch.optim.Optimizer, masters: MasterWeights | None = None,
                  micro_steps: int = 1) -> None:
    """After the update: gradients set to None, except where ddp keeps them in its buckets
    (parallelism.ddp_bucket_view): there the fp32 masters of bf16 copies (`masters`) keep theirs as
    stale (titanlite.ops.master_linear.release_stale), so the next backward's weight GEMMs write
    straight into DDP's buckets and the reducer copies none of them in. Those buckets live for the
    whole run, so keeping the views costs no memory; elsewhere (one device, fsdp) freed gradients
    make room for the next forward's activations.

    Steps of one micro-step keep no view before DDP has rebuilt its buckets (in the second step's
    first forward, in the order the gradients became ready): the rebuild frees the old buckets before
    it allocates the new ones unless gradients still view them, so a view kept through it would hold
    every old bucket beside the new, the gradients' size once more at that moment (torch's
    `_has_rebuilt_buckets`). Steps of several (`micro_steps`) keep them all the same: their first
    micro-steps run under no_sync, where DDP copies nothing into its buckets, so a master without a
    view would grow a gradient of its own beside the buckets for the whole backward, a larger peak
    than the rebuild's (which the estimate holds: estimation.fake_run)."""
    if (isinstance(model, DistributedDataParallel) and model.gradient_as_bucket_view
            and (micro_steps > 1 or getattr(model, "_has_rebuilt_buckets", True))):
        for p in model.parameters():
            if masters is not None and masters.has_copy(p):
                release_stale(p)
            else:
                p.grad = None
        return
    optimizer.zero_grad(set_to_none=True)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor that holds this rank's elements of `t`: a DTensor's local shard (FSDP's
    parameters, gradients and optimizer state), and below it the one tensor a wrapper subclass holds.

    Wrapper subclasses (torch's traceable-wrapper convention: `__tensor_flatten__` names their inner
    tensors) own no storage, so their data_ptr() is 0: torchao's float8 weight under FSDP's float8
    all-gather (WeightWithDynamicFloat8CastTensor) and whatever a zeros_like of it returns. A kernel
    that takes addresses (titanlite.ops.master_adamw) must be handed the inner tensor, the one of the
    wrapper's shape and dtype; a wrapper holding several such tensors is returned as it is."""
    if isinstance(t, DTensor):
        t = t.to_local()
    while is_traceable_wrapper_subclass(t):
        name = _inner_name(t)
        if name is None:
            break
        t = getattr(t, name)
    return t


_INNER: dict[type, str | None] = {}


def _inner_name(t: torch.Tensor) -> str | None:
    """The attribute of wrapper `t` that holds its elements, found once per wrapper type: a type's
    `__tensor_flatten__` may cost a host sync (torchao's float8 weight tests its scale tensor for truth),
    and the optimizer asks for every parameter, gradient and moment at every step."""
    kind = type(t)
    if kind not in _INNER:
        names, _ = t.__tensor_flatten__()
        same = [n for n in names if getattr(t, n).shape == t.shape and getattr(t, n).dtype == t.dtype]
        _INNER[kind] = same[0] if len(same) == 1 else None
    return _INNER[kind]


@runtime_checkable
class FusedClip(Protocol):
    """An optimizer update that takes the clip inside its kernel: its next `step()` divides every
    gradient by `grad_scale` and changes nothing where `found_inf` is nonzero (both 0-d device tensors;
    None: 1 and no skip), so the clip costs no pass over the gradients of its own. titanlite.optim's
    MasterAdamW is one; `fused_clip_target` finds the one an optimizer offers."""

    def scale_next_step(self, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None: ...


class _TorchFusedAdamW:
    """torch's fused AdamW as a FusedClip: it reads the scale and the skip flag from the attributes
    `grad_scale` and `found_inf` of the optimizer at each step (the protocol torch's GradScaler uses
    with it); this adapter is the one place they are written."""

    def __init__(self, optimizer: torch.optim.AdamW):
        self.optimizer = optimizer

    def scale_next_step(self, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        self.optimizer.grad_scale, self.optimizer.found_inf = grad_scale, found_inf


def fused_clip_target(optimizer: torch.optim.Optimizer) -> FusedClip | None:
    """Where the clip scale can ride inside the optimizer's kernel (see FusedClip), or None. An optimizer
    implementing FusedClip (titanlite.optim's MasterAdamW, alone or as zero1's per-rank optimizer)
    always can; torch's AdamW only fused, over plain tensors (not FSDP's DTensor parameters) and not
    capturable for CUDA graphs."""
    if isinstance(optimizer, FusedClip):
        return optimizer
    if type(optimizer) is not torch.optim.AdamW or not optimizer.defaults.get("fused"):
        return None
    if optimizer.defaults.get("capturable"):
        return None
    if any(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"]):
        return None
    return _TorchFusedAdamW(optimizer)


def clip_grad_norm(model: nn.Module, max_norm: float, fused: FusedClip | None = None,
                   skip_nonfinite: bool = False) -> torch.Tensor:
    """Clip the global gradient norm (max_norm <= 0: measure only); returns a plain tensor.

    With a `fused` target (fused_clip_target) the gradients are not rescaled here: the scale goes to
    the optimizer's next step (its kernel divides each gradient by it while updating), which saves a
    full read and write of every gradient. With skip_nonfinite it also hands over `found_inf`, so a
    non-finite step is skipped on the device with no host sync. Under FSDP the gradients are DTensors
    and the norm comes back as one; reading it as a full tensor reduces the shards' partial norms so
    every rank sees the global value.
    """
    if fused is not None:
        by_dtype = {}  # bf16 and fp32 with float8 under training.bf16_params
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(local_tensor(g))
        # one list per dtype: torch's multi-tensor kernel takes lists of one dtype, and a mixed list
        # falls back to one reduction per tensor; fp32 sums either way
        norms = [n for local in by_dtype.values() for n in torch._foreach_norm(local, 2, dtype=torch.float32)]
        norm = torch.linalg.vector_norm(torch.stack(norms))
        shards = next((g for g in grads if isinstance(g, DTensor)), None)
        if shards is not None:  # FSDP: the local shards' norm; the squares summed over the sharded mesh dims
            squares = norm.square()
            for dim, placement in enumerate(shards.placements):
                if placement.is_shard():
                    dist.all_reduce(squares, group=shards.device_mesh.get_group(dim))
            norm = squares.sqrt()
        # same coefficient as clip_grad_norm_: max_norm / (norm + 1e-6), at most 1
        scale = torch.clamp((norm + 1e-6) / max_norm, min=1.0) if max_norm > 0 else None
        fused.scale_next_step(scale, (~torch.isfinite(norm)).float() if skip_nonfinite else None)
        return norm

    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else float("inf"),
                                          foreach=True)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm

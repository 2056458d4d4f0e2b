"""Linear layers with fp32 master weights that multiply in bf16 and produce fp32 weight gradients
(training.bf16_params).

A MasterLinear is an nn.Linear whose `weight` Parameter stays the fp32 master: it is what the
optimizer steps, DDP all-reduces, the clip measures and checkpoints save (same keys, same dtype as
an autocast run). The GEMMs read `weight_bf16`, a bf16 copy held as a non-persistent buffer, which
is exactly the rounding autocast would make of the master each forward. The copy is derived state:
titanlite.optim.MasterAdamW rewrites it in the pass that updates the master (the Triton kernel
writes both), and loading weights (load_state_dict) refreshes it. `MasterWeights` is where the
optimizer finds the copies: the one record of a model's masters and their lower-precision tensors.

Per matrix and micro-step, forward and input gradient are bf16 GEMMs as under autocast; the weight
gradient is one GEMM with an fp32 result (`fp32_mm`), added into the fp32 `.grad` by that same
GEMM from the second micro-step on. So no bf16 rounding of a weight gradient ever happens, where
autocast rounds each micro-step's to bf16 before adding it in fp32, and there is no separate add.

How the accumulation stays an ordinary `.grad`: the weight gradient comes from `weight_grad`, an
opaque custom op that takes the parameter's current `.grad` (if any), accumulates the product into
it and returns it, setting `.grad` to None; autograd then finds no gradient and keeps the tensor it
is handed, so its accumulation is a move, and DDP's hooks, the clip and the optimizer see a plain
fp32 `.grad`. The op is opaque because `.grad` is state outside the graph, which torch.compile must
neither trace nor reorder. A consequence: `torch.autograd.grad` on these weights while their
`.grad` is set would return the sum of both (training only calls `backward`).

A gradient released as stale (`release_stale`) keeps its storage: the next weight_grad writes the
product over it (beta = 0, the old values never read) instead of adding. ddp releases its masters'
gradients that way (titanlite.parallel.grads.release_grads), so each one stays a view of DDP's
reduce bucket and is written there by its GEMM: the reducer neither copies nor divides it. The
stale marks are this module's own: `release_stale` is the one call that records one, and
`weight_grad`'s body, which is handed tensors only (it is opaque to torch.compile), reads and clears it.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary


def fp32_mm(a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor | None = None, overwrite: bool = False) -> torch.Tensor:
    """a @ b for bf16 (or fp32) `a`, `b` as fp32, added into `acc` (fp32, returned) when given, or
    written over it with `overwrite`.

    On CUDA one cuBLAS GEMM with an fp32 output (it accumulates in fp32 in any case; this skips
    rounding the result to bf16, and with `acc` it adds into it, beta = 1, or ignores its values,
    beta = 0). Elsewhere, where that GEMM does not exist, the operands are widened: products of bf16
    numbers are exact in fp32, so the values are those of the GEMM up to the order of summation."""
    if a.is_cuda and a.dtype != torch.float32:
        if acc is None:
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.addmm(acc, a, b, out_dtype=torch.float32, beta=0 if overwrite else 1, out=acc)
    with torch.autocast(a.device.type, enabled=False):
        a, b = a.float(), b.float()
        if acc is None:
            return a @ b
        return torch.mm(a, b, out=acc) if overwrite else acc.addmm_(a, b)


@torch.library.custom_op("titanlite::weight_grad", mutates_args=())
def weight_grad(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The opaque op over accumulate_weight_grad (see the module docstring)."""
    return accumulate_weight_grad(grad_out, x, weight)


@weight_grad.register_fake
def _(grad_out, x, weight):
    return grad_out.new_empty(weight.shape, dtype=torch.float32)


# The masters whose `.grad` was released as stale (release_stale), until their next weight_grad. Keyed by
# identity, weakly (torch's WeakIdKeyDictionary: a tensor's == compares values), so a freed model leaves none.
_STALE: WeakIdKeyDictionary = WeakIdKeyDictionary()


def accumulate_weight_grad(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """weight.grad + grad_out^T x in fp32 (the product alone when weight.grad is None or stale), in the
    tensor that was weight.grad; weight.grad is left None. (A dry run calls this on fake tensors where
    the op's fake kernel could not: it touches `.grad`.)"""
    acc, weight.grad = weight.grad, None
    stale = _STALE.pop(weight, False) and acc is not None
    g = fp32_mm(grad_out.reshape(-1, grad_out.shape[-1]).t(), x.reshape(-1, x.shape[-1]), acc, overwrite=stale)
    if stale:
        # A new tensor over the same storage: autograd takes a tensor nobody else holds as the gradient
        # without a copy, and the stale one may be held elsewhere (it can be DDP's own bucket view).
        return g.view_as(g)
    return g


def release_stale(weight: torch.Tensor) -> None:
    """Release a master's gradient without freeing it: its next weight_grad writes over it."""
    if weight.grad is not None:
        _STALE[weight] = True
    else:
        _STALE.pop(weight, None)


class _MasterMatmul(torch.autograd.Function):
    """x @ weight_bf16^T (x in bf16); its backward gives x a bf16 gradient and the fp32 `master` an
    fp32 one. The forward is a plain matmul, so selective activation checkpointing sees an mm."""

    @staticmethod
    def forward(ctx, x, weight_bf16, master):
        ctx.save_for_backward(x, weight_bf16, master)
        return x @ weight_bf16.t()

    @staticmethod
    def backward(ctx, grad_out):
        x, weight_bf16, master = ctx.saved_tensors
        grad_x = grad_out @ weight_bf16 if ctx.needs_input_grad[0] else None
        grad_w = weight_grad(grad_out, x, master) if ctx.needs_input_grad[2] else None
        return grad_x, None, grad_w


class MasterLinear(nn.Linear):
    """nn.Linear on an fp32 master `weight` whose GEMMs use its bf16 copy `weight_bf16` (made by
    `use_bf16_copy`, which turns an existing nn.Linear into one)."""

    weight_bf16: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _MasterMatmul.apply(x.to(self.weight_bf16.dtype), self.weight_bf16, self.weight)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    @torch.no_grad()
    def refresh(self) -> None:
        """Rewrite the bf16 copy from the master (after the master changed outside the optimizer)."""
        self.weight_bf16.copy_(self.weight)


def _refresh_after_load(module: MasterLinear, incompatible_keys) -> None:
    module.refresh()


def use_bf16_copy(linear: nn.Linear) -> MasterLinear:
    """Make `linear` a MasterLinear in place: same module, same fp32 `weight` Parameter (so wrappers,
    optimizer and state-dict keys are untouched), plus its bf16 copy.

    The change is torch's in-place class swap (`module.__class__ = ...`), the convention its own
    fully_shard, replicate and nn.utils.parametrize use to give a module new behaviour while every
    reference to it stays valid: the parent's registration, hooks, and compiled blocks that hold it.
    MasterLinear adds no state but the buffer registered here, so the swap is the whole conversion."""
    linear.__class__ = MasterLinear
    linear.register_buffer("weight_bf16", linear.weight.detach().to(torch.bfloat16), persistent=False)
    linear.register_load_state_dict_post_hook(_refresh_after_load)
    return linear


class MasterWeights:
    """A model's fp32 master weights kept beside lower-precision tensors (training.bf16_params), in one
    object: titanlite.parallel.apply.apply_bf16_params fills it, the optimizer is given it
    (titanlite.optim.MasterAdamW rewrites each copy as it updates its master, and keeps the masters of
    bf16 parameters), and so is the gradients' release (titanlite.parallel.grads.release_grads: a
    master's gradient stays in DDP's bucket).

    - `copies`: fp32 master Parameter -> its bf16 copy (a MasterLinear's `weight_bf16`);
    - `initial`: bf16 Parameter -> the fp32 value it was rounded from (float8's weights), held until
      the optimizer takes it (`take_initial`) to start the master's low bits from.
    Tensors key the dicts by identity, as an optimizer's state does."""

    def __init__(self):
        self.copies: dict[torch.Tensor, torch.Tensor] = {}
        self.initial: dict[torch.Tensor, torch.Tensor] = {}

    def add_copy(self, linear: nn.Linear) -> None:
        """Give `linear` a bf16 copy of its weight (use_bf16_copy), the weight its master."""
        self.copies[linear.weight] = use_bf16_copy(linear).weight_bf16

    def round_to_bf16(self, weight: torch.Tensor) -> None:
        """Store `weight` in bf16 from now on, its fp32 value kept until the optimizer takes it."""
        self.initial[weight] = weight.data
        weight.data = weight.data.to(torch.bfloat16)

    def has_copy(self, p: torch.Tensor) -> bool:
        return p in self.copies

    def take_initial(self, p: torch.Tensor) -> torch.Tensor | None:
        """The fp32 value bf16 parameter `p` was rounded from (None: it was not, or was taken already)."""
        return self.initial.pop(p, None)

    @torch.no_grad()
    def refresh(self, params) -> None:
        """Rewrite the copies of `params` (those that have one) from their masters."""
        for p in params:
            if p in self.copies:
                self.copies[p].copy_(p)

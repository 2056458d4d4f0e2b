"""Losses. `cross_entropy` takes logits; `chunked_linear_cross_entropy` takes final hidden states and
the output weight and never materialises the (tokens x vocab) fp32 logits.

Why chunked: at LLaMA 1.36B, batch 4 x 2048, the fp32 logits are 8192 x 32000 x 4 B = 1 GiB, and
the eager softmax/cross-entropy forward and backward move about 9 GB through memory per step. The
chunked version computes, chunk by chunk of tokens, logits -> fp32 log-softmax -> loss and the
gradients with respect to the hidden states and the weight, all inside the forward pass (the
backward only scales them by the incoming gradient). Peak memory holds one chunk of logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from titanlite.ops.master_linear import fp32_mm


# The chunked loss's weight-gradient GEMMs (fp32_mm: bf16 operands, an fp32 result, the later chunks added
# into the first's) as opaque ops with fake kernels, as master_linear's weight_grad is. fp32_mm picks
# CUDA's one GEMM or the CPU's widened operands by the tensors' device; the fake kernels give what CUDA's
# GEMM gives, one fp32 result written or added in place, so a dry run on fake CPU tensors
# (titanlite's estimation) holds the GPU's tensors.
@torch.library.custom_op("titanlite::fp32_mm", mutates_args=())
def fp32_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b as fp32 (fp32_mm)."""
    return fp32_mm(a, b)


@fp32_product.register_fake
def _(a, b):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.float32)


@torch.library.custom_op("titanlite::fp32_addmm_", mutates_args=("acc",))
def add_fp32_product_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, in fp32 (fp32_mm into `acc`)."""
    fp32_mm(a, b, acc)


@add_fp32_product_.register_fake
def _(acc, a, b):
    return None


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy with an fp32 softmax."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _chunk_loss_and_grad(logits: torch.Tensor, labels: torch.Tensor, inv_n: float):
    """Summed loss of one chunk and d(mean loss)/d(logits) = (softmax - onehot) / N, in the logits' dtype.

    Elementwise only, and in place on one fp32 copy of the chunk, so eager mode holds a single
    (tokens x vocab) fp32 buffer. Compiled, nothing in it needs that copy to exist: the one-hot is a
    comparison with the column index (a scatter into the copy would make Inductor write it out and
    read it back), so the logits are read by the log-sum-exp and once more by the kernel that
    writes the gradient.
    """
    x = logits.float() if logits.dtype != torch.float32 else logits.clone()
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    loss_sum = (lse.squeeze(1) - x.gather(1, labels[:, None]).squeeze(1)).sum()
    x.sub_(lse).exp_()  # softmax
    x.sub_((labels[:, None] == torch.arange(x.shape[1], device=x.device)).float())
    return loss_sum, x.mul_(inv_n).to(logits.dtype)


_compiled_chunk_fn = None


def _chunk_fn(compiled: bool):
    global _compiled_chunk_fn
    if not compiled:
        return _chunk_loss_and_grad
    if _compiled_chunk_fn is None:
        _compiled_chunk_fn = torch.compile(_chunk_loss_and_grad, dynamic=False)
    return _compiled_chunk_fn


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_tokens: int, compute_dtype, compiled: bool):
        # hidden: (N, D), weight: (V, D), labels: (N,). Gradients are produced here, chunk by chunk;
        # backward only scales them, so no logits are kept for it.
        n = hidden.shape[0]
        h, w = hidden.to(compute_dtype), weight.to(compute_dtype)
        fn = _chunk_fn(compiled)
        grad_h = torch.empty_like(hidden)
        grad_w = None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk_tokens):
            hc, yc = h[start : start + chunk_tokens], labels[start : start + chunk_tokens]
            loss_sum, g = fn(hc @ w.t(), yc, 1.0 / n)
            total += loss_sum
            grad_h[start : start + chunk_tokens] = g @ w
            # the first chunk's GEMM writes the fp32 gradient, each later one adds into it, unrounded
            if grad_w is None:
                grad_w = fp32_product(g.t(), hc)
            else:
                add_fp32_product_(grad_w, g.t(), hc)
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        return total / n

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out, grad_w * grad_out, None, None, None, None


def _chunked_loss_only(hidden, weight, labels, chunk_tokens: int, compute_dtype) -> torch.Tensor:
    """Validation / no-grad path: the loss chunk by chunk, no gradient buffers."""
    h, w = hidden.to(compute_dtype), weight.to(compute_dtype)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    with torch.autocast(hidden.device.type, enabled=False):
        for start in range(0, h.shape[0], chunk_tokens):
            logits = (h[start : start + chunk_tokens] @ w.t()).float()
            total += F.cross_entropy(logits, labels[start : start + chunk_tokens], reduction="sum")
    return total / h.shape[0]


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                 chunk_tokens: int = 2048, compiled: bool = False) -> torch.Tensor:
    """Mean cross-entropy of (hidden @ weight.T) against labels, computed in token chunks.

    hidden: (B, S, D) final-norm hidden states; weight: (V, D) output projection; labels: (B, S).
    Matmuls run in the autocast dtype when autocast is on (else in hidden's dtype); softmax in fp32.
    `compiled` fuses each chunk's softmax / loss / gradient into a couple of kernels (torch.compile).
    """
    if torch.is_autocast_enabled(hidden.device.type):
        compute_dtype = torch.get_autocast_dtype(hidden.device.type)
    else:
        compute_dtype = hidden.dtype
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        return _chunked_loss_only(hidden.flatten(0, 1), weight, labels.flatten(), chunk_tokens, compute_dtype)
    with torch.autocast(hidden.device.type, enabled=False):
        return _ChunkedLinearCE.apply(hidden.flatten(0, 1), weight, labels.flatten(), chunk_tokens, compute_dtype,
                                      compiled)



"""The fused master-weight AdamW update as a Triton kernel (CUDA; imported only there).

One launch per parameter, one pass over its elements: read the low-precision gradient, the fp32
master and both fp32 moments; write the master, the moments and the low-precision parameter (an
fp32 parameter is its own master: `w` None, `p` written once). It computes what
`titanlite.optim._master_adamw_update` computes (the CPU path and the reference of the tests); a
kernel of our own rather than torch.compile of that function because, at ~220 parameters, the
compiled function's per-call guards and wrappers cost ~150 us of host time each (34 ms a step on an
H100, longer than the update itself), where a Triton launch costs a few us.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _kernel(p_ptr, g_ptr, w_ptr, m_ptr, v_ptr, n, lr_ptr, scale_ptr, keep_ptr, bias1_ptr, bias2_sqrt_ptr,
            wd, beta1, beta2, eps, BLOCK: tl.constexpr, OWN_MASTER: tl.constexpr):
    if tl.load(keep_ptr) == 0:  # a skipped step (non-finite gradients) writes nothing
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        lr = tl.load(lr_ptr)
        g = tl.load(g_ptr + offs, mask=mask).to(tl.float32) / tl.load(scale_ptr)
        w = tl.load(w_ptr + offs, mask=mask)
        m = tl.load(m_ptr + offs, mask=mask)
        v = tl.load(v_ptr + offs, mask=mask)
        m = m + (1 - beta1) * (g - m)  # torch.lerp's formula for a weight below 0.5
        v = v * beta2 + (1 - beta2) * g * g
        w = w * (1 - lr * wd) - (lr / tl.load(bias1_ptr)) * m / (tl.sqrt(v) / tl.load(bias2_sqrt_ptr) + eps)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        tl.store(w_ptr + offs, w, mask=mask)
        if not OWN_MASTER:
            tl.store(p_ptr + offs, w.to(p_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


def master_adamw_update(p, g, w, m, v, lr, wd: float, beta1: float, beta2: float, eps: float,
                        bias1, bias2_sqrt, grad_scale, keep) -> None:
    """Same arguments as titanlite.optim._master_adamw_update (tensors contiguous, any shape)."""
    n, own_master = p.numel(), w is None
    _kernel[(triton.cdiv(n, BLOCK),)](p, g, p if own_master else w, m, v, n, lr, grad_scale, keep.view(torch.uint8),
                                      bias1, bias2_sqrt, wd, beta1, beta2, eps, BLOCK=BLOCK, OWN_MASTER=own_master,
                                      num_warps=4)

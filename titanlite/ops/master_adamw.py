"""The fused master-weight AdamW update as a Triton kernel (CUDA; imported only there).

One launch per parameter, one pass over its elements: read the gradient, the bf16 parameter with
its master's low bits (together the fp32 master, see titanlite.optim.master_low_bits) and both
moments; write the parameter, the low bits and the moments. With fp32 moments that is 26 bytes per
bf16 parameter (torch's fused AdamW moves 28 on fp32 parameters), with bf16 moments 18. An fp32
parameter is its own master (`lo` None). It computes what `titanlite.optim._master_adamw_update`
computes (the CPU path and the reference of the tests); a kernel of our own rather than
torch.compile of that function because, at ~220 parameters, the compiled function's per-call guards
and wrappers cost ~150 us of host time each (34 ms a step on an H100, longer than the update
itself), where a Triton launch costs a few us.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _kernel(p_ptr, g_ptr, lo_ptr, m_ptr, v_ptr, n, lr_ptr, scale_ptr, keep_ptr, bias1_ptr, bias2_sqrt_ptr,
            wd, beta1, beta2, eps, BLOCK: tl.constexpr, OWN_MASTER: tl.constexpr, BF16_MOMENTS: tl.constexpr):
    if tl.load(keep_ptr) == 0:  # a skipped step (non-finite gradients) writes nothing
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        lr = tl.load(lr_ptr)
        g = tl.load(g_ptr + offs, mask=mask).to(tl.float32) / tl.load(scale_ptr)
        p = tl.load(p_ptr + offs, mask=mask)
        if OWN_MASTER:
            w = p
        else:  # fp32 bits = bf16 bits x 65536 + the signed low 16
            hi = p.to(tl.int16, bitcast=True).to(tl.int32) * 65536
            w = (hi + tl.load(lo_ptr + offs, mask=mask).to(tl.int32)).to(tl.float32, bitcast=True)
        m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
        m = m + (1 - beta1) * (g - m)  # torch.lerp's formula for a weight below 0.5
        v = v * beta2 + (1 - beta2) * g * g
        w = w * (1 - lr * wd) - (lr / tl.load(bias1_ptr)) * m / (tl.sqrt(v) / tl.load(bias2_sqrt_ptr) + eps)
        if BF16_MOMENTS:
            tl.store(m_ptr + offs, m.to(tl.bfloat16, fp_downcast_rounding="rtne"), mask=mask)
            tl.store(v_ptr + offs, v.to(tl.bfloat16, fp_downcast_rounding="rtne"), mask=mask)
        else:
            tl.store(m_ptr + offs, m, mask=mask)
            tl.store(v_ptr + offs, v, mask=mask)
        if OWN_MASTER:
            tl.store(p_ptr + offs, w, mask=mask)
        else:
            # Round to nearest even on the bits (what torch's .to(bfloat16) does), then the remainder
            bits = w.to(tl.int32, bitcast=True)
            hi = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            tl.store(p_ptr + offs, hi.to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)
            tl.store(lo_ptr + offs, tl.minimum(bits - hi * 65536, 32767).to(tl.int16), mask=mask)  # see master_low_bits


def master_adamw_update(p, g, lo, m, v, lr, wd: float, beta1: float, beta2: float, eps: float,
                        bias1, bias2_sqrt, grad_scale, keep) -> None:
    """Same arguments as titanlite.optim._master_adamw_update (tensors contiguous, any shape)."""
    n, own_master = p.numel(), lo is None
    _kernel[(triton.cdiv(n, BLOCK),)](p, g, p if own_master else lo, m, v, n, lr, grad_scale, keep.view(torch.uint8),
                                      bias1, bias2_sqrt, wd, beta1, beta2, eps, BLOCK=BLOCK, OWN_MASTER=own_master,
                                      BF16_MOMENTS=m.dtype == torch.bfloat16, num_warps=4)

"""The fused master-weight AdamW update as Triton kernels (CUDA; imported only there).

One pass over each parameter's elements: read the gradient, the master and both moments; write
the master and the moments, and what derives from the master. Per kind of parameter (see
titanlite.optim.MasterAdamW), with fp32 moments:
- fp32 with a bf16 copy (training.bf16_params' matrices): the fp32 gradient and master, the copy
  written as the master's rounding: 30 bytes per parameter (22 with bf16 moments);
- bf16 with its master's low bits (`lo`; together the fp32 master, see
  titanlite.optim.master_low_bits): bf16 gradient, parameter and low bits: 26 bytes (18);
- fp32, its own master (`lo` and `copy` None): 28 bytes, what torch's fused AdamW moves (20).
It computes what `titanlite.optim.eager_master_adamw_update` computes (the CPU path and the reference of
the tests).

Two entry points share the update (`_update_block`):
- `master_adamw_update_many`: one launch for a whole list of parameters. Each program finds its
  parameter and block through two tables built once per list of sizes; each tensor's address is an
  element offset from the list's first tensor (a small table, rebuilt when a gradient moves).
  Launching a Triton kernel costs tens of microseconds of Python: with one launch per parameter the
  host took about as long to launch the update as the GPU took to run it
  (benchmarks/step_host_time.py measures both). It needs every address
  and size to be a multiple of 8 elements (it then moves 16 bytes per access, as the per-parameter
  kernel does).
- `master_adamw_update`: one parameter per launch. Used while a CUDA graph is being captured (the
  tables' host-to-device copies cannot be captured) and where an address or a size is not a
  multiple of 8 elements.
A kernel of our own rather than torch.compile of the reference, because the compiled function's
per-call guards cost ~150 us of host time per parameter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
# A kernel handed address 0 faults the whole device ("illegal memory access", reported at a later op)
_NO_STORAGE = ("master_adamw: a tensor without storage of its own (data_ptr() 0: a wrapper subclass, such as "
               "torchao's float8 weight under FSDP); pass the tensor it wraps (titanlite.parallel.grads.local_tensor)")


@triton.jit
def _bf16_bits(w):
    """The bits of w's bf16 rounding (to nearest even, what torch's .to(bfloat16) does), as int32."""
    bits = w.to(tl.int32, bitcast=True)
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


@triton.jit
def _update_block(p_ptr, g_ptr, lo_ptr, m_ptr, v_ptr, copy_ptr, offs, mask, lr, scale, bias1, bias2_sqrt,
                  wd, beta1, beta2, eps, OWN_MASTER: tl.constexpr, BF16_MOMENTS: tl.constexpr,
                  WRITE_COPY: tl.constexpr):
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32) / scale
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
    w = w * (1 - lr * wd) - (lr / bias1) * m / (tl.sqrt(v) / bias2_sqrt + eps)
    if BF16_MOMENTS:
        tl.store(m_ptr + offs, m.to(tl.bfloat16, fp_downcast_rounding="rtne"), mask=mask)
        tl.store(v_ptr + offs, v.to(tl.bfloat16, fp_downcast_rounding="rtne"), mask=mask)
    else:
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
    if OWN_MASTER:
        tl.store(p_ptr + offs, w, mask=mask)
        if WRITE_COPY:
            tl.store(copy_ptr + offs, _bf16_bits(w).to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:  # the bf16 rounding, then the remainder
        hi = _bf16_bits(w)
        tl.store(p_ptr + offs, hi.to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)
        tl.store(lo_ptr + offs, tl.minimum(w.to(tl.int32, bitcast=True) - hi * 65536, 32767).to(tl.int16),
                 mask=mask)  # see master_low_bits


@triton.jit
def _master_adamw_kernel(p_ptr, g_ptr, lo_ptr, m_ptr, v_ptr, copy_ptr, n, lr_ptr, scale_ptr, keep_ptr, bias1_ptr, bias2_sqrt_ptr,
            wd, beta1, beta2, eps, BLOCK: tl.constexpr, OWN_MASTER: tl.constexpr, BF16_MOMENTS: tl.constexpr,
            WRITE_COPY: tl.constexpr):
    if tl.load(keep_ptr) == 0:  # a skipped step (non-finite gradients) writes nothing
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        _update_block(p_ptr, g_ptr, lo_ptr, m_ptr, v_ptr, copy_ptr, offs, offs < n, tl.load(lr_ptr),
                      tl.load(scale_ptr), tl.load(bias1_ptr), tl.load(bias2_sqrt_ptr), wd, beta1, beta2, eps,
                      OWN_MASTER, BF16_MOMENTS, WRITE_COPY)


@triton.jit
def _master_adamw_many_kernel(p_ptr, g_ptr, lo_ptr, m_ptr, v_ptr, copy_ptr, table_ptr, block_param_ptr, block_index_ptr,
                 lr_ptr, scale_ptr, keep_ptr, bias1_ptr, bias2_sqrt_ptr, wd, beta1, beta2, eps, BLOCK: tl.constexpr,
                 OWN_MASTER: tl.constexpr, BF16_MOMENTS: tl.constexpr, WRITE_COPY: tl.constexpr):
    if tl.load(keep_ptr) == 0:
        b = tl.program_id(0)
        row = table_ptr + tl.load(block_param_ptr + b).to(tl.int64) * 7  # p, g, lo, m, v, copy offsets; numel
        offs = tl.load(block_index_ptr + b).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        # The table holds every offset and numel divided by 8: multiplied back here, the compiler knows
        # them to be multiples of 8, which is what lets it issue 16-byte loads and stores (a masked
        # access is vectorised only when the mask is known to be constant over the vector)
        _update_block(p_ptr + tl.load(row) * 8, g_ptr + tl.load(row + 1) * 8, lo_ptr + tl.load(row + 2) * 8,
                      m_ptr + tl.load(row + 3) * 8, v_ptr + tl.load(row + 4) * 8, copy_ptr + tl.load(row + 5) * 8,
                      offs, offs < tl.load(row + 6) * 8, tl.load(lr_ptr), tl.load(scale_ptr), tl.load(bias1_ptr),
                      tl.load(bias2_sqrt_ptr), wd, beta1, beta2, eps, OWN_MASTER, BF16_MOMENTS, WRITE_COPY)


def master_adamw_update(p, g, lo, m, v, lr, wd: float, beta1: float, beta2: float, eps: float,
                        bias1, bias2_sqrt, grad_scale, keep, copy=None) -> None:
    """Same arguments as titanlite.optim.eager_master_adamw_update (tensors contiguous, any shape)."""
    n, own_master = p.numel(), lo is None
    if n and 0 in (p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr()):
        raise ValueError(_NO_STORAGE)
    _master_adamw_kernel[(triton.cdiv(n, BLOCK),)](p, g, p if own_master else lo, m, v, p if copy is None else copy, n, lr,
                                      grad_scale, keep.view(torch.uint8), bias1, bias2_sqrt, wd, beta1, beta2, eps,
                                      BLOCK=BLOCK, OWN_MASTER=own_master, BF16_MOMENTS=m.dtype == torch.bfloat16,
                                      WRITE_COPY=copy is not None, num_warps=4)


def _offset_table(roles: list[list[torch.Tensor]]) -> torch.Tensor | None:
    """Per parameter: each role's element offset from that role's first tensor, then the numel, all
    divided by 8. None when one of them is not a multiple of 8 (or a first tensor is not 16-byte aligned)."""
    cols = []
    for ts in roles:
        base, size = ts[0].data_ptr(), ts[0].element_size()
        offs = [t.data_ptr() - base for t in ts]
        if base % 16 or any(o % (8 * size) for o in offs):
            return None
        cols.append([o // (8 * size) for o in offs])
    if any(t.numel() % 8 for t in roles[0]):
        return None
    cols.append([t.numel() // 8 for t in roles[0]])
    return torch.tensor(list(zip(*cols)), dtype=torch.int64).to(roles[0][0].device, non_blocking=True)


def _block_tables(numels: tuple[int, ...], device) -> tuple[torch.Tensor, torch.Tensor]:
    """For each program of the launch: its parameter's index and its block's index in that parameter."""
    blocks = torch.tensor([triton.cdiv(n, BLOCK) for n in numels])
    param = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), blocks)
    index = torch.arange(param.numel(), dtype=torch.int32) - torch.repeat_interleave(blocks.cumsum(0) - blocks, blocks).int()
    return param.to(device), index.to(device)


def master_adamw_update_many(ps, gs, los, ms, vs, lr, wd: float, beta1: float, beta2: float, eps: float,
                             bias1, bias2_sqrt, grad_scale, keep, copies, cache: dict) -> bool:
    """master_adamw_update over lists of tensors of one kind (all bf16 parameters with their low bits
    `los`, or all fp32 with `los` None, with their bf16 `copies` or all without; one weight decay, one
    lr) in one launch. `cache` (a dict the caller keeps) holds the tables between steps. Returns
    False, having done nothing, when an address or a size is not a multiple of 8 elements; the caller
    then updates parameter by parameter."""
    own_master = los is None
    roles = [ps, gs, ps if own_master else los, ms, vs, ps if copies is None else copies]
    where = tuple(t.data_ptr() for ts in roles for t in ts)
    if cache.get("where") != where:
        if 0 in where:
            raise ValueError(_NO_STORAGE)
        cache.update(where=where, table=_offset_table(roles))
    if cache["table"] is None:
        return False
    numels = tuple(p.numel() for p in ps)
    if cache.get("numels") != numels:
        cache.update(numels=numels, blocks=_block_tables(numels, ps[0].device))
    param, index = cache["blocks"]
    _master_adamw_many_kernel[(param.numel(),)](*(ts[0] for ts in roles), cache["table"], param, index, lr, grad_scale,
                                   keep.view(torch.uint8), bias1, bias2_sqrt, wd, beta1, beta2, eps, BLOCK=BLOCK,
                                   OWN_MASTER=own_master, BF16_MOMENTS=ms[0].dtype == torch.bfloat16,
                                   WRITE_COPY=copies is not None, num_warps=4)
    return True

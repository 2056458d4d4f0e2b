"""ddp and zero1's wrapper: DistributedDataParallel over the mesh's dp_replicate dimension, and its comm hooks.

Every mode receives a model whose weights are already materialised and initialised identically on
every rank (see `parallelize.materialize`), so ddp / zero1 / fsdp / hsdp all start from the same
weights as a single process. Losses are means over the local micro-batch divided by the number of
accumulation steps, and every mode averages gradients over ranks, so the same global batch gives
the same update in every mode. (zero1's optimizer-state sharding lives in titanlite.optim.)
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from titanlite.ops.master_linear import MasterWeights, release_stale
from titanlite.parallel.copy_engine import copy_engines_chosen, zero_cta_group
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.settings import ParallelSettings


def apply_ddp(model: nn.Module, settings: ParallelSettings, dims: ParallelDims, masters: MasterWeights) -> nn.Module:
    """DistributedDataParallel: gradients all-reduced in buckets of parallelism.ddp_bucket_cap_mb, in
    parallelism.ddp_reduce_dtype, averaged by the collective itself (see mean_allreduce_hook), the
    all-reduce's second half on the copy engines where parallelism.ddp_copy_engine_all_gather takes them
    (SplitAllReduce)."""
    ddp = ddp_wrapper(model, settings, dims, masters)
    dp = settings.data_parallel
    graphs = settings.cuda_graphs and dims.device.type == "cuda"
    if dp.ddp_reduce_dtype == "bfloat16":
        ddp.register_comm_hook(ddp.process_group, bf16_allreduce_hook)
    elif graphs:
        # A captured step keeps DDP's own division: with mean_allreduce_hook the replayed step took 159-160 ms
        # on 2 x H100, without it 150-151 (docs/parallelism.md, "ddp's gradients stay in its buckets")
        pass
    elif copy_engines_chosen("parallelism.ddp_copy_engine_all_gather", dp.ddp_copy_engine_all_gather, dims,
                             "dp_replicate", what="each bucket is reduce-scattered by NCCL's kernels and gathered "
                                                  "back on the copy engines, beside the backward"):
        ddp.register_comm_hook(SplitAllReduce(ddp, zero_cta_group(dims.mesh, "dp_replicate")), SplitAllReduce.hook)
    else:
        ddp.register_comm_hook(ddp.process_group, mean_allreduce_hook)
    return ddp


def ddp_wrapper(model: nn.Module, settings: ParallelSettings, dims: ParallelDims,
                masters: MasterWeights) -> DistributedDataParallel:
    """The DistributedDataParallel module of apply_ddp, before its comm hook: replicas along the mesh's
    dp_replicate dimension (today the whole job, whose default process group that dimension reuses).
    With parallelism.ddp_bucket_view the masters of bf16 copies (`masters`) hold their gradients in
    DDP's buckets from the first step on."""
    dp = settings.data_parallel
    ids = [dims.device.index] if dims.device.type == "cuda" else None
    # No buffer sync before each forward: the only buffers are RoPE tables, computed identically on every
    # rank and never updated; the default would broadcast them every micro-step. torch 2.13 renamed the
    # switch (forward_sync_buffers; it still syncs once at construction, which is harmless here) and
    # warns on the old one, which torch 2.11 still needs.
    no_sync = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
               else "broadcast_buffers")
    in_buckets = [p for p in model.parameters() if masters.has_copy(p)] if dp.ddp_bucket_view else []
    for p in in_buckets:
        # DDP makes each gradient that exists when it is built a view of its bucket (released as stale below,
        # as grads.release_grads leaves them after every step). Without one, the first step's no_sync
        # micro-steps would accumulate the masters' gradients outside the buckets: a second fp32 copy of the
        # blocks' gradients beside them until the last backward, which set the run's peak under accumulation.
        p.grad = torch.zeros_like(p)
    ddp = DistributedDataParallel(model, device_ids=ids, process_group=dims.mesh.get_group("dp_replicate"),
                                  bucket_cap_mb=dp.ddp_bucket_cap_mb, gradient_as_bucket_view=dp.ddp_bucket_view,
                                  **{no_sync: False})
    for p in in_buckets:
        release_stale(p)
    return ddp


def mean_allreduce_hook(group, bucket):
    """DDP comm hook: all-reduce the bucket in place as the mean over ranks (NCCL's average, which
    scales inside the collective). Without a hook DDP's reducer divides every gradient by the ranks
    itself, a read and write of each gradient beside the backward (for a gradient already in its
    bucket, see grads.release_grads); with any hook it leaves the bucket alone. Gloo has no average:
    it divides first, then sums."""
    buf = bucket.buffer()
    op = dist.ReduceOp.AVG
    if dist.get_backend(group) != "nccl":
        buf.div_(dist.get_world_size(group))
        op = dist.ReduceOp.SUM
    fut = dist.all_reduce(buf, op=op, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def bf16_allreduce_hook(group, bucket):
    """DDP comm hook: all-reduce the gradient bucket as bf16 (half the bytes of fp32), averaged over
    ranks. Divided before the sum, so the bf16 sum cannot overflow; the bucket gets the result back
    in fp32. (torch's own bf16 hook refuses anything but NCCL, so CPU tests could not run it.)"""
    buf = bucket.buffer()
    low = buf.to(torch.bfloat16).div_(dist.get_world_size(group))
    fut = dist.all_reduce(low, group=group, async_op=True).get_future()

    def unpack(f):
        buf.copy_(f.value()[0])
        return buf

    return fut.then(unpack)


class SplitAllReduce:
    """DDP comm hook (state and `hook`) of parallelism.ddp_copy_engine_all_gather: each bucket's mean as a
    reduce-scatter over DDP's group (NCCL's SM kernels, in the bucket's float32) and then an all-gather of the
    reduced pieces over `gather_group`, a communicator under NCCL's zero-CTA policy (copy_engine.zero_cta_group)
    whose buffers are registered NCCL symmetric memory: NCCL moves that half on the copy engines, so of an
    all-reduce's traffic only the reduce-scatter's takes SMs beside the backward. Both run in place in the
    bucket (the rank's piece is its slice of it), on a side stream the backward does not wait for; the
    last numel % ranks elements, which no equal split covers, are all-reduced. Every rank ends with the same
    bits: the gather copies each piece's one sum.

    DDP's buckets must live in symmetric memory. DDP lays them out again once, at the second forward, in
    the order the first backward produced the gradients; a forward pre-hook does that rebuild first, with
    allocations routed to the symmetric pool. Until then (the first step) the buckets are ordinary memory
    and the hook all-reduces them as mean_allreduce_hook does. Off CUDA (the CPU tests, gloo) the same
    hook runs without pool, stream or registration."""

    def __init__(self, ddp: DistributedDataParallel, gather_group):
        self.group, self.gather_group = ddp.process_group, gather_group
        device = next(ddp.parameters()).device
        self.cuda = device.type == "cuda"
        if self.cuda:
            import torch.distributed._symmetric_memory as symm_mem  # here: copy_engine_refusal has checked it exists

            self.symm_mem, self.pool, self.stream = symm_mem, symm_mem.get_mem_pool(device), torch.cuda.Stream(device)
        self.symmetric = False  # the buckets are in the pool (rebuilt)
        self.registered: set[int] = set()  # buckets rendezvoused with the gather group, by address
        self._pre_hook = ddp.register_forward_pre_hook(self._rebuild_in_pool)

    def _rebuild_in_pool(self, ddp: DistributedDataParallel, inputs) -> None:
        if not torch.is_grad_enabled():
            return  # DDP rebuilds only in a forward with gradients
        with torch.cuda.use_mem_pool(self.pool) if self.cuda else contextlib.nullcontext():
            rebuilt = ddp.reducer._rebuild_buckets()  # False until a backward has recorded the order
        if rebuilt:
            self.symmetric = True
            self._pre_hook.remove()

    @staticmethod
    def hook(state: "SplitAllReduce", bucket):
        if not state.symmetric:
            return mean_allreduce_hook(state.group, bucket)
        buf = bucket.buffer()
        ranks, rank = state.group.size(), state.group.rank()
        whole = buf.numel() - buf.numel() % ranks
        if not whole:
            return mean_allreduce_hook(state.group, bucket)
        head, mine, rest = buf[:whole], buf[rank * (whole // ranks):(rank + 1) * (whole // ranks)], buf[whole:]
        op = dist.ReduceOp.AVG
        if not state.cuda:  # gloo has no average: divide, then sum
            buf.div_(ranks)
            op = dist.ReduceOp.SUM
        else:
            state.stream.wait_stream(torch.cuda.current_stream())  # the bucket's gradients are written
        with torch.cuda.stream(state.stream) if state.cuda else contextlib.nullcontext():
            # not async: the side stream (not the host) waits for each before the gather is queued behind them
            REDUCE_SCATTER(mine, head, op=op, group=state.group)
            if rest.numel():
                dist.all_reduce(rest, op=op, group=state.group)
            if state.cuda and buf.data_ptr() not in state.registered:
                state.symm_mem.rendezvous(buf, group=state.gather_group.group_name)
                state.registered.add(buf.data_ptr())
            work = ALL_GATHER(head, mine, group=state.gather_group, async_op=True)
        return work.get_future().then(lambda f: buf)


# torch 2.13 renamed the tensor collectives (the old names warn there); torch 2.11 has only the old ones
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

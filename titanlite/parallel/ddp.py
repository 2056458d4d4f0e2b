"""ddp and zero1's wrapper: DistributedDataParallel over the mesh's dp_replicate dimension, and its comm hooks.

Every mode receives a model whose weights are already materialised and initialised identically on
every rank (see `parallelize.materialize`), so ddp / zero1 / fsdp / hsdp all start from the same
weights as a single process. Losses are means over the local micro-batch divided by the number of
accumulation steps, and every mode averages gradients over ranks, so the same global batch gives
the same update in every mode. (zero1's optimizer-state sharding lives in titanlite.optim.)
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from titanlite.ops.master_linear import MasterWeights, release_stale
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.settings import ParallelSettings


def apply_ddp(model: nn.Module, settings: ParallelSettings, dims: ParallelDims, masters: MasterWeights) -> nn.Module:
    """DistributedDataParallel: gradients all-reduced in buckets of parallelism.ddp_bucket_cap_mb, in
    parallelism.ddp_reduce_dtype, averaged by the collective itself (see mean_allreduce_hook)."""
    ddp = ddp_wrapper(model, settings, dims, masters)
    if settings.data_parallel.ddp_reduce_dtype == "bfloat16":
        ddp.register_comm_hook(ddp.process_group, bf16_allreduce_hook)
    elif not (settings.cuda_graphs and dims.device.type == "cuda"):
        # A captured step keeps DDP's own division: the replay ran slower with this hook than without it
        # (benchmarks/results/2026-11-26_2xh100_ddp-buckets-against-peers.md; docs/parallelism.md, "ddp's
        # gradients stay in its buckets")
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
    ddp = DistributedDataParallel(model, device_ids=ids, process_group=dims.group("dp_replicate"),
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

"""Data-parallel wrapping, one function per mode, chosen through DATA_PARALLEL by name.

Every mode receives a model whose weights are already materialised and initialised identically on
every rank (see `parallelize.materialize`), so ddp / zero1 / fsdp / hsdp all start from the same
weights as a single process. Losses are means over the local micro-batch divided by the number of
accumulation steps, and every mode averages gradients over ranks, so the same global batch gives
the same update in every mode.
"""

from __future__ import annotations

import contextlib
import inspect
import logging

import torch
import torch.nn as nn

from titanlite.errors import ConfigError
from titanlite.parallel.policy import computes_bf16, hsdp_shape, ranks_per_host


def apply_ddp(model: nn.Module, cfg, dims) -> nn.Module:
    """DistributedDataParallel: gradients all-reduced in buckets of parallelism.ddp_bucket_cap_mb, in
    parallelism.ddp_reduce_dtype, averaged by the collective itself (see mean_allreduce_hook)."""
    ddp = ddp_wrapper(model, cfg, dims)
    if cfg.parallelism.ddp_reduce_dtype == "bfloat16":
        ddp.register_comm_hook(None, bf16_allreduce_hook)
    elif not (cfg.training.cuda_graphs and dims.device.type == "cuda"):
        # A captured step keeps DDP's own division: with this hook the replayed step took 159-160 ms on
        # 2 x H100, without it 150-151 (docs/parallelism.md, "ddp's gradients stay in its buckets")
        ddp.register_comm_hook(None, mean_allreduce_hook)
    return ddp


def ddp_wrapper(model: nn.Module, cfg, dims) -> nn.Module:
    """The DistributedDataParallel module of apply_ddp, before its comm hook."""
    from torch.nn.parallel import DistributedDataParallel

    from titanlite.ops.master_linear import release_stale

    ids = [dims.device.index] if dims.device.type == "cuda" else None
    # No buffer sync before each forward: the only buffers are RoPE tables, computed identically on every
    # rank and never updated; the default would broadcast them every micro-step. torch 2.13 renamed the
    # switch (forward_sync_buffers; it still syncs once at construction, which is harmless here) and
    # warns on the old one, which torch 2.11 still needs.
    no_sync = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
               else "broadcast_buffers")
    masters = [p for p in model.parameters() if hasattr(p, "bf16_copy")] if cfg.parallelism.ddp_bucket_view else []
    for p in masters:
        # DDP makes each gradient that exists when it is built a view of its bucket (released as stale below,
        # as release_grads leaves them). Without one, the first step's no_sync micro-steps would accumulate
        # the masters' gradients outside the buckets, a second fp32 copy beside them until the last backward.
        p.grad = torch.zeros_like(p)
    ddp = DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=cfg.parallelism.ddp_bucket_cap_mb,
                                  gradient_as_bucket_view=cfg.parallelism.ddp_bucket_view, **{no_sync: False})
    for p in masters:
        release_stale(p)
    return ddp


def mean_allreduce_hook(group, bucket):
    """DDP comm hook: all-reduce the bucket in place as the mean over ranks (NCCL's average, which
    scales inside the collective). Without a hook DDP's reducer divides every gradient by the ranks
    itself, a read and write of each gradient beside the backward (for a gradient already in its
    bucket, see release_grads); with any hook it leaves the bucket alone. Gloo has no average: it
    divides first, then sums."""
    import torch.distributed as dist

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
    import torch.distributed as dist

    buf = bucket.buffer()
    low = buf.to(torch.bfloat16).div_(dist.get_world_size(group))
    fut = dist.all_reduce(low, group=group, async_op=True).get_future()

    def unpack(f):
        buf.copy_(f.value()[0])
        return buf

    return fut.then(unpack)


# fsdp_reshard_after_forward=auto: the blocks keep their gathered parameters from forward to backward
# when all of them together take at most this share of the GPU's memory
KEEP_GATHERED_SHARE = 1 / 16


def blocks_reshard(setting: str, gathered_bytes: int, device_memory: int | None) -> bool:
    """Do the blocks free their gathered parameters after forward (parallelism.fsdp_reshard_after_forward)?
    Freeing saves `gathered_bytes` (less this rank's shard) until backward, which then gathers every block
    a second time: on 2 x H200 keeping them made LLaMA 1.36B 1.7-3.5% faster for 2.1 GiB more
    (docs/performance.md). `auto` keeps them where they are small beside the GPU's memory
    (`device_memory`, None off CUDA: freed, as `default`)."""
    if setting == "auto":
        return device_memory is None or gathered_bytes > KEEP_GATHERED_SHARE * device_memory
    return setting != "never"


def _fsdp(model: nn.Module, cfg, dims, mesh, device_memory: int | None = None) -> nn.Module:
    """fully_shard each TransformerBlock, then the final norm with an untied output layer as one group,
    then the root (the embedding, and a tied output). `device_memory`: the GPU's bytes, for
    fsdp_reshard_after_forward=auto."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    p = cfg.parallelism
    # bf16 compute: the policy gathers bf16 copies of the fp32 shards and reduce-scatters the gradients in
    # fsdp_reduce_dtype (fp32 by default), what training.bf16_params does with copies in the other modes
    bf16 = computes_bf16(cfg, dims.device.type)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                              reduce_dtype=getattr(torch, p.fsdp_reduce_dtype))
    gathered = sum(q.numel() for q in model.layers.parameters()) * (2 if bf16 else 4)
    block_reshard = blocks_reshard(p.fsdp_reshard_after_forward, gathered, device_memory)
    if p.fsdp_reshard_after_forward == "auto" and dims.is_main:
        logging.getLogger("titanlite").info(
            f"parallelism.fsdp_reshard_after_forward=auto: the blocks {'free' if block_reshard else 'keep'} their "
            f"gathered parameters after forward ({gathered / 2**30:.2f} GiB gathered"
            + (f", {gathered / device_memory:.1%} of the GPU's memory)" if device_memory else ", not on a GPU)"))
    # the root keeps its parameters unless told otherwise: backward starts with the output layer right away
    root_reshard = p.fsdp_reshard_after_forward == "always"
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=block_reshard)
    if model.output.weight is not model.tok_embeddings.weight:
        # A group of its own: the head's gradients are complete as soon as the backward has passed the
        # final norm, and reduce-scatter beside the blocks' backward instead of after the embedding's,
        # the last gradient of the step; its gather rides ahead of the last blocks' forward. (A tied
        # output shares the embedding's parameter, which one FSDP group must hold.)
        fully_shard([model.norm, model.output], mesh=mesh, mp_policy=mp, reshard_after_forward=root_reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=root_reshard)
    return model


# NCCL's copy-engine collectives (zero-CTA policy over symmetric memory) arrived in 2.28
COPY_ENGINE_NCCL = (2, 28)


def copy_engine_refusal(dims) -> str | None:
    """Why this process cannot gather on the copy engines (parallelism.fsdp_copy_engine_all_gather), or None:
    a phrase starting "needs", which `on` refuses with and `auto` logs."""
    import torch.distributed as dist

    backend = dist.get_backend() if dist.is_initialized() else None
    if dims.device.type != "cuda" or backend != "nccl":
        return f"needs CUDA GPUs and NCCL, not {dims.device.type} with {backend or 'no process group'}"
    if getattr(dist.ProcessGroupNCCL, "NCCL_CTA_POLICY_ZERO", None) is None or not hasattr(
            dist.ProcessGroupNCCL.Options().config, "cta_policy"):
        return f"needs NCCL's per-communicator CTA policy, which torch {torch.__version__} does not expose"
    try:
        import torch.distributed._symmetric_memory as symm_mem
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather  # noqa: F401
    except ImportError:
        symm_mem = None
    if symm_mem is None or not hasattr(symm_mem, "get_mem_pool") or not hasattr(FSDPModule, "set_custom_all_gather"):
        return f"needs NCCL symmetric memory and FSDP's custom all-gather, which torch {torch.__version__} lacks"
    return nccl_refusal(torch.cuda.nccl.version())


def nccl_refusal(version: tuple) -> str | None:
    """Why NCCL `version` (torch.cuda.nccl.version(): major, minor, patch[, suffix]) has no copy-engine
    collectives, or None."""
    if tuple(version[:2]) >= COPY_ENGINE_NCCL:
        return None
    return (f"needs NCCL {'.'.join(map(str, COPY_ENGINE_NCCL))} or newer for copy-engine collectives; this torch "
            f"runs {'.'.join(map(str, version))}")


# auto gathers on the copy engines only over NVSwitch fabrics this fast per GPU and direction (NVLink 4 and 5:
# H100 SXM, H200, B200, GB200 in titanlite.hardware), where it was measured or NCCL's path is built for
COPY_ENGINE_MIN_LINK_GBPS = 400.0


def copy_engine_decision(setting: str, refusal: str | None, float8: bool, shard: int, ranks_per_host: int | None,
                         gpu: str, link_gbps: float | None) -> tuple[bool, str]:
    """parallelism.fsdp_copy_engine_all_gather: do the gathers run on the copy engines, and why (one phrase).
    `refusal`: copy_engine_refusal's answer; `shard`: ranks in a gather group; `ranks_per_host`: torchrun's
    LOCAL_WORLD_SIZE (None: unknown); `gpu`, `link_gbps`: the device's name and its link in titanlite.hardware's table
    (None: not in it). `on` raises ConfigError where it cannot; `auto` is on where every gather group is
    inside one host on an NVSwitch fabric (NCCL's copy-engine path runs over NVLink) and float8 is off
    (float8's gathers were never measured there)."""
    if setting == "off":
        return False, "off"
    if setting == "on":
        if refusal:
            raise ConfigError(f"parallelism.fsdp_copy_engine_all_gather=on {refusal}")
        return True, "on"
    if refusal:
        return False, f"off: it {refusal}"
    if shard == 1:
        return False, "off: a gather group of one rank gathers nothing"
    if ranks_per_host is None:
        return False, "off: the launcher does not say how many ranks share a host (torchrun's LOCAL_WORLD_SIZE)"
    if ranks_per_host % shard:
        return False, f"off: a gather group of {shard} ranks spans hosts of {ranks_per_host}"
    if link_gbps is None or link_gbps < COPY_ENGINE_MIN_LINK_GBPS:
        known = "is not in titanlite.hardware's table" if link_gbps is None else f"links at {link_gbps:g} GB/s"
        return False, (f"off: {gpu} {known}; auto takes the copy engines on NVSwitch nodes of at least "
                       f"{COPY_ENGINE_MIN_LINK_GBPS:g} GB/s (set it on to try)")
    if float8:
        return False, "off: float8's gathers have not been measured on the copy engines"
    return True, "on"


def gathers_on_copy_engines(model: nn.Module, cfg, dims, mesh) -> None:
    """Apply parallelism.fsdp_copy_engine_all_gather to the sharded `model` (see copy_engine_decision);
    `auto` says on the main rank what it chose. Building the gather groups is collective, so under `auto`
    the ranks take the copy engines only where every one of them can."""
    import torch.distributed as dist

    from titanlite.hardware import lookup

    setting = cfg.parallelism.fsdp_copy_engine_all_gather
    if setting == "off":
        return
    shard = mesh.size(mesh.mesh_dim_names.index("dp_shard"))
    gpu = torch.cuda.get_device_name(dims.device) if dims.device.type == "cuda" else dims.device.type
    hw = lookup(gpu)
    use, why = copy_engine_decision(setting, copy_engine_refusal(dims), cfg.float8.enable, shard, ranks_per_host(),
                                    gpu, hw.link_gbps if hw else None)
    if setting == "auto" and dist.is_initialized():
        agreed = torch.tensor([int(use)], device=dims.device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        if use and not agreed.item():
            use, why = False, "off: another rank cannot take the copy engines"
    if setting == "auto" and dims.is_main:
        logging.getLogger("titanlite").info(
            f"parallelism.fsdp_copy_engine_all_gather=auto: {why}"
            + (" (the parameter gathers move over NVLink on the copy engines, beside the GEMMs)" if use else ""))
    if use:
        copy_engine_all_gather(model, mesh)


def copy_engine_all_gather(model: nn.Module, mesh) -> None:
    """Every FSDP module gathers into NCCL symmetric memory, over a communicator of its own made under
    NCCL's zero-CTA policy: NCCL then moves the gathered bytes with the copy engines instead of SM
    kernels, so the gathers stop taking SMs from the GEMMs they overlap, while the reduce-scatters
    keep the job's communicator and its full share of SMs. (copy_engine_refusal has checked that
    this torch and NCCL can.)"""
    from torch.distributed.fsdp import FSDPModule

    comm = _symmetric_all_gather(_zero_cta_group(mesh, "dp_shard"))
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_all_gather(comm)


def _zero_cta_group(mesh, dim: str):
    """This rank's group along mesh dimension `dim`, as a new NCCL communicator under the zero-CTA policy.
    Every rank makes every group of the dimension (new_group is collective over the whole job)."""
    import torch.distributed as dist

    opts = dist.ProcessGroupNCCL.Options()
    opts.config.cta_policy = dist.ProcessGroupNCCL.NCCL_CTA_POLICY_ZERO
    i = mesh.mesh_dim_names.index(dim)
    mine = None
    for row in mesh.mesh.movedim(i, -1).reshape(-1, mesh.size(i)).tolist():  # the groups along `dim`
        group = dist.new_group(ranks=row, backend="nccl", pg_options=opts)
        if dist.get_rank() in row:
            mine = group
    return mine


def _symmetric_all_gather(gather_group):
    """An FSDP all-gather over `gather_group` whose output buffers come from NCCL's symmetric-memory pool
    and are registered with every rank before the collective (what makes NCCL pick its copy-engine path)."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

    symm_mem.set_backend("NCCL")
    # The gather communicator must exist before the first rendezvous.
    dist.barrier(group=gather_group)

    class SymmetricAllGather(AllGather):
        def allocate(self, size, *, dtype, device):
            # one pool, reused step after step: a buffer is registered once, not per gather
            with torch.cuda.use_mem_pool(symm_mem.get_mem_pool(device)):
                return torch.empty(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            # FSDP passes its own group (the job's communicator, SM kernels): gather over ours instead
            symm_mem.rendezvous(output_tensor, group=gather_group.group_name)
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=gather_group, async_op=async_op)

    return SymmetricAllGather()


def apply_fsdp(model: nn.Module, cfg, dims) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    return _sharded(model, cfg, dims, init_device_mesh(dims.device.type, (dims.world_size,),
                                                       mesh_dim_names=("dp_shard",)))


def apply_hsdp(model: nn.Module, cfg, dims) -> nn.Module:
    """FSDP over a 2-D mesh: parameters sharded within a replica group, replicated across groups."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = hsdp_shape(cfg, dims.world_size)
    return _sharded(model, cfg, dims, init_device_mesh(dims.device.type, shape,
                                                       mesh_dim_names=("dp_replicate", "dp_shard")))


def _sharded(model: nn.Module, cfg, dims, mesh) -> nn.Module:
    """The model sharded over `mesh`, its gathers where parallelism.fsdp_copy_engine_all_gather puts them
    (estimation's fake run calls _fsdp alone: its fake process group has no communicators to build)."""
    model = _fsdp(model, cfg, dims, mesh, _device_memory(dims))
    gathers_on_copy_engines(model, cfg, dims, mesh)
    return model


def _device_memory(dims) -> int | None:
    return torch.cuda.get_device_properties(dims.device).total_memory if dims.device.type == "cuda" else None


# zero1 is DDP for gradients; its optimizer-state sharding lives in titanlite.optim.
DATA_PARALLEL = {"ddp": apply_ddp, "zero1": apply_ddp, "fsdp": apply_fsdp, "hsdp": apply_hsdp}


def is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def grad_sync(model: nn.Module, enabled: bool):
    """Context for one micro-step: gradients are reduced over ranks only when `enabled` (the last
    micro-step of an accumulation); earlier micro-steps accumulate locally."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext() if enabled else model.no_sync()
    if is_fsdp(model):
        model.set_requires_gradient_sync(enabled)  # applies to every FSDP module below the root
    return contextlib.nullcontext()


def release_grads(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """After the update: gradients set to None, except where ddp keeps them in its buckets
    (parallelism.ddp_bucket_view): there the bf16 copies' fp32 masters keep theirs as stale
    (titanlite.ops.master_linear.release_stale), so the next backward's weight GEMMs write straight
    into DDP's buckets and the reducer copies none of them in. Those buckets live for the whole run,
    so keeping the views costs no memory; elsewhere (one device, fsdp) freed gradients make room for
    the next forward's activations."""
    from titanlite.ops.master_linear import release_stale

    if isinstance(model, nn.parallel.DistributedDataParallel) and model.gradient_as_bucket_view:
        for p in model.parameters():
            if hasattr(p, "bf16_copy"):
                release_stale(p)
            else:
                p.grad = None
        return
    optimizer.zero_grad(set_to_none=True)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP's parameters, gradients and optimizer state), else `t` itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def fused_clip_supported(optimizer) -> bool:
    """Can the clip scale ride inside the optimizer kernel? The interface: before `step()` the
    optimizer finds `grad_scale` (divide every gradient by it) and `found_inf` (skip the update where
    it is nonzero) set on it, as torch's fused AdamW reads them. Optimizers that declare
    `takes_grad_scale` (titanlite.optim's MasterAdamW, alone or as zero1's per-rank optimizer) always
    can; torch's AdamW only fused, over plain tensors (not FSDP's DTensor parameters) and not
    capturable for CUDA graphs."""
    from torch.distributed.tensor import DTensor

    if getattr(optimizer, "takes_grad_scale", False):
        return True
    if type(optimizer) is not torch.optim.AdamW or not optimizer.defaults.get("fused"):
        return False
    if optimizer.defaults.get("capturable"):
        return False
    return not any(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"])


def clip_grad_norm(model: nn.Module, max_norm: float, optimizer=None, skip_nonfinite: bool = False) -> torch.Tensor:
    """Clip the global gradient norm (max_norm <= 0: measure only); returns a plain tensor.

    With a fused AdamW (see fused_clip_supported) the gradients are not rescaled here: the scale
    goes to the optimizer as `grad_scale` (its kernel divides each gradient by it while updating),
    which saves a full read and write of every gradient. With
    skip_nonfinite it also sets `found_inf`, so a non-finite step is skipped on the device with no
    host sync. Under FSDP the gradients are DTensors and the norm comes back as one; reading it as
    a full tensor reduces the shards' partial norms so every rank sees the global value.
    """
    from torch.distributed.tensor import DTensor

    if optimizer is not None and fused_clip_supported(optimizer):
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
            import torch.distributed as dist

            squares = norm.square()
            for dim, placement in enumerate(shards.placements):
                if placement.is_shard():
                    dist.all_reduce(squares, group=shards.device_mesh.get_group(dim))
            norm = squares.sqrt()
        if max_norm > 0:  # same coefficient as clip_grad_norm_: max_norm / (norm + 1e-6), at most 1
            optimizer.grad_scale = torch.clamp((norm + 1e-6) / max_norm, min=1.0)
        if skip_nonfinite:
            optimizer.found_inf = (~torch.isfinite(norm)).float()
        return norm

    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else float("inf"),
                                          foreach=True)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm

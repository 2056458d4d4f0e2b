"""parallelism.fsdp_copy_engine_all_gather: FSDP's parameter gathers on the GPU's copy engines.

Every FSDP module gathers into NCCL symmetric memory over a communicator of its own made under
NCCL's zero-CTA policy, so the gathered bytes move on the copy engines instead of SM kernels, beside
the GEMMs; the reduce-scatters keep the job's communicator. The pieces: whether this process can
(`copy_engine_refusal`), whether the setting takes them (`copy_engine_decision`), and the gather
itself (`copy_engine_all_gather`).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from titanlite.errors import ConfigError
from titanlite.hardware import lookup
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.settings import ParallelSettings

# NCCL's copy-engine collectives (zero-CTA policy over symmetric memory) arrived in 2.28
COPY_ENGINE_NCCL = (2, 28)


def copy_engine_refusal(dims: ParallelDims) -> str | None:
    """Why this process cannot gather on the copy engines (parallelism.fsdp_copy_engine_all_gather), or None:
    a phrase starting "needs", which `on` refuses with and `auto` logs."""
    backend = dist.get_backend() if dist.is_initialized() else None
    if dims.device.type != "cuda" or backend != "nccl":
        return f"needs CUDA GPUs and NCCL, not {dims.device.type} with {backend or 'no process group'}"
    if getattr(dist.ProcessGroupNCCL, "NCCL_CTA_POLICY_ZERO", None) is None or not hasattr(
            dist.ProcessGroupNCCL.Options().config, "cta_policy"):
        return f"needs NCCL's per-communicator CTA policy, which torch {torch.__version__} does not expose"
    try:  # here, not at the top: these may be missing from this torch, which is what is being asked
        import torch.distributed._symmetric_memory as symm_mem
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


def copy_engine_decision(setting: str, refusal: str | None, shard: int, ranks_per_host: int | None,
                         gpu: str, link_gbps: float | None) -> tuple[bool, str]:
    """parallelism.fsdp_copy_engine_all_gather: do the gathers run on the copy engines, and why (one phrase).
    `refusal`: copy_engine_refusal's answer; `shard`: ranks in a gather group; `ranks_per_host`: torchrun's
    LOCAL_WORLD_SIZE (None: unknown); `gpu`, `link_gbps`: the device's name and its link in titanlite.hardware's table
    (None: not in it). `on` raises ConfigError where it cannot; `auto` is on where every gather group is
    inside one host on an NVSwitch fabric (NCCL's copy-engine path runs over NVLink), with float8's gathers
    as with bf16's (float8 fsdp on 2 x H200: LLaMA-3.1-8B 1.2% faster, LLaMA 1.36B 0.4%)."""
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
    return True, "on"


def gathers_on_copy_engines(model: nn.Module, settings: ParallelSettings, dims: ParallelDims) -> None:
    """Apply parallelism.fsdp_copy_engine_all_gather to the sharded `model` (see copy_engine_decision);
    `auto` says on the main rank what it chose. Building the gather groups is collective, so under `auto`
    the ranks take the copy engines only where every one of them can."""
    setting = settings.data_parallel.fsdp_copy_engine_all_gather
    if setting == "off":
        return
    gpu = torch.cuda.get_device_name(dims.device) if dims.device.type == "cuda" else dims.device.type
    hw = lookup(gpu)
    use, why = copy_engine_decision(setting, copy_engine_refusal(dims), dims.size("dp_shard"),
                                    dims.ranks_per_host, gpu, hw.link_gbps if hw else None)
    if setting == "auto" and dims.dp_group is not None:
        # over every rank of the mesh (dp_group spans all its dimensions): each builds every gather group
        group = dims.dp_group
        agreed = torch.tensor([int(use)], device=dims.device if dist.get_backend(group) == "nccl" else "cpu")
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
        if use and not agreed.item():
            use, why = False, "off: another rank cannot take the copy engines"
    if setting == "auto" and dims.is_main:
        logging.getLogger("titanlite").info(
            f"parallelism.fsdp_copy_engine_all_gather=auto: {why}"
            + (" (the parameter gathers move over NVLink on the copy engines, beside the GEMMs)" if use else ""))
    if use:
        copy_engine_all_gather(model, dims.mesh)


def copy_engine_all_gather(model: nn.Module, mesh) -> None:
    """Every FSDP module gathers into NCCL symmetric memory, over a communicator of its own made under
    NCCL's zero-CTA policy: NCCL then moves the gathered bytes with the copy engines instead of SM
    kernels, so the gathers stop taking SMs from the GEMMs they overlap, while the reduce-scatters
    keep the job's communicator and its full share of SMs. (copy_engine_refusal has checked that
    this torch and NCCL can.)"""
    comm = _symmetric_all_gather(_zero_cta_group(mesh, "dp_shard"))
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_all_gather(comm)


def _zero_cta_group(mesh, dim: str):
    """This rank's group along mesh dimension `dim`, as a new NCCL communicator under the zero-CTA policy.
    Every rank makes every group of the dimension (new_group is collective over the whole job)."""
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
    # here, not at the top: a torch without them never gets this far (copy_engine_refusal)
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

"""fsdp and hsdp's wrapper: FSDP2's fully_shard over the job's device mesh.

The mesh is dims.mesh: one dp_shard dimension for fsdp, dp_replicate x dp_shard for hsdp (FSDP2
shards along the last dimension and replicates along the first). The gathers then go where
parallelism.fsdp_copy_engine_all_gather puts them (titanlite.parallel.copy_engine).
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from titanlite.parallel.copy_engine import gathers_on_copy_engines
from titanlite.ops.master_linear import MasterWeights
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.policy import computes_bf16
from titanlite.parallel.settings import ParallelSettings

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


def shard_model(model: nn.Module, settings: ParallelSettings, dims: ParallelDims) -> nn.Module:
    """fully_shard each TransformerBlock, then the final norm with an untied output layer as one group,
    then the root (the embedding, and a tied output), over dims.mesh."""
    dp = settings.data_parallel
    # bf16 compute: the policy gathers bf16 copies of the fp32 shards and reduce-scatters the gradients in
    # fsdp_reduce_dtype (fp32 by default), what training.bf16_params does with copies in the other modes
    bf16 = computes_bf16(settings.precision, dims.device.type)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                              reduce_dtype=getattr(torch, dp.fsdp_reduce_dtype))
    gathered = sum(q.numel() for q in model.layers.parameters()) * (2 if bf16 else 4)
    block_reshard = blocks_reshard(dp.fsdp_reshard_after_forward, gathered, dims.device_memory)
    if dp.fsdp_reshard_after_forward == "auto" and dims.is_main:
        logging.getLogger("titanlite").info(
            f"parallelism.fsdp_reshard_after_forward=auto: the blocks {'free' if block_reshard else 'keep'} their "
            f"gathered parameters after forward ({gathered / 2**30:.2f} GiB gathered"
            + (f", {gathered / dims.device_memory:.1%} of the GPU's memory)" if dims.device_memory
               else ", not on a GPU)"))
    # the root keeps its parameters unless told otherwise: backward starts with the output layer right away
    root_reshard = dp.fsdp_reshard_after_forward == "always"
    mesh = dims.mesh
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


def apply_fsdp(model: nn.Module, settings: ParallelSettings, dims: ParallelDims, masters: MasterWeights) -> nn.Module:
    """fsdp and hsdp: the model sharded over dims.mesh (1-D or replicate x shard, see the module
    docstring), its gathers where parallelism.fsdp_copy_engine_all_gather puts them. (`masters` is empty:
    FSDP's mixed-precision policy, not bf16 copies, gives the sharded modes their bf16 parameters.)"""
    model = shard_model(model, settings, dims)
    gathers_on_copy_engines(model, settings, dims)
    return model

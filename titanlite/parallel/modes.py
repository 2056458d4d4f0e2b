"""Data-parallel modes and their traits: one record per mode, read by everything that depends on one.

Config checks, parallelize, the optimizer builder, CUDA graphs, estimation and diagnose ask a mode
what it does instead of comparing mode names. A new mode is a record here plus its wrapping
function in `titanlite.parallel.apply.DATA_PARALLEL` (docs/parallelism.md lists the steps).

Pure data, no torch: the config checker imports it before torchrun starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Mode:
    name: str
    summary: str
    # Parameters live as shards (FSDP2): bf16 compute comes from its mixed-precision policy (it
    # gathers bf16 copies), not from autocast, and gradients come back as reduce-scattered shards.
    shards_params: bool = False
    # Who holds the AdamW state: "local" (every rank, all of it), "zero" (ZeroRedundancyOptimizer
    # partitions it over the ranks) or "sharded" (it follows the parameter shards).
    optimizer: str = "local"
    # Gradient collective: "none", "all_reduce", or "reduce_scatter" (+ parameter all-gathers).
    comm: str = "none"
    # The gradient collectives run during backward, beside the GEMMs (bucketed DDP, FSDP2 prefetch).
    overlaps_comm: bool = False
    # Allocator headroom over max allocated (reserved / allocated - 1) measured with
    # expandable_segments: FSDP2's all-gather and reduce-scatter buffers live on their own streams,
    # whose blocks are not shared with the default stream's.
    headroom: float = 0.02
    # CUDA graphs need this many eager steps before capture (DDP settles its buckets first).
    min_graph_warmup: int = 0
    # How a bf16 run with training.bf16_params gets its bf16 matrices: "copies" (fp32 master parameters,
    # bf16 copies the optimizer rewrites, weight gradients produced, accumulated and reduced in fp32:
    # titanlite.ops.master_linear) or "fsdp_policy" (FSDP2's mixed-precision policy gathers bf16 copies of
    # the fp32 shards and reduce-scatters the gradients in parallelism.fsdp_reduce_dtype, fp32 by default).
    bf16_params: str = "copies"
    # The device-mesh dimensions the mode lays the ranks over, in MESH_DIMS's order (below).
    # titanlite.parallel.policy.mesh_shape sizes them; titanlite.parallel.dims builds the mesh.
    mesh: tuple[str, ...] = ()
    # Settings this mode cannot run, each with the reason given to the user.
    refuses: dict[str, str] = field(default_factory=dict)


# Every dimension a job's device mesh can have, outermost first: ranks of one "dp_replicate" index hold
# whole copies of the model (gradients all-reduced across them), ranks of one "dp_shard" index split
# one copy (FSDP's gathers and reduce-scatters run inside them). The innermost dimension is the one
# laid over neighbouring ranks, on one host's fast links: a tensor-parallel dimension would be
# appended here, after dp_shard (docs/parallelism.md, "Adding a mesh dimension").
MESH_DIMS = ("dp_replicate", "dp_shard")

_FSDP_GRAPHS = ("FSDP2 allocates and frees the gathered parameters every step and orders its streams with "
                "host-side events, which a CUDA graph cannot replay; use ddp (or no cuda_graphs)")
_MASTER = ("bf16 moments over FSDP's shards have not been validated (their numerics and resume are tested under "
           "ddp, zero1 and one GPU only); use ddp, zero1 or one GPU")

MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("none", "one process, no wrapper (what every mode runs with one rank)"),
    Mode("ddp", "DistributedDataParallel: full replicas, gradients all-reduced in buckets during backward",
         comm="all_reduce", overlaps_comm=True, min_graph_warmup=11, mesh=("dp_replicate",)),
    Mode("zero1", "ddp for gradients, AdamW state partitioned over the ranks (ZeroRedundancyOptimizer)",
         optimizer="zero", comm="all_reduce", overlaps_comm=True, mesh=("dp_replicate",),
         refuses={"training.cuda_graphs": "ZeroRedundancyOptimizer broadcasts parameters from host-side bookkeeping "
                                          "and has no capturable mode; use ddp (or no cuda_graphs)"}),
    Mode("fsdp", "FSDP2 fully_shard per group of blocks and the root: parameters, gradients and AdamW state sharded",
         shards_params=True, optimizer="sharded", comm="reduce_scatter", overlaps_comm=True, headroom=0.15,
         bf16_params="fsdp_policy", mesh=("dp_shard",),
         refuses={"training.cuda_graphs": _FSDP_GRAPHS, "optimizer.moments_dtype=bfloat16": _MASTER}),
    Mode("hsdp", "FSDP2 over a 2-D mesh: sharded inside a replica group, replicated across groups",
         shards_params=True, optimizer="sharded", comm="reduce_scatter", overlaps_comm=True, headroom=0.15,
         bf16_params="fsdp_policy", mesh=("dp_replicate", "dp_shard"),
         refuses={"training.cuda_graphs": "HSDP is FSDP2 underneath: " + _FSDP_GRAPHS,
                  "optimizer.moments_dtype=bfloat16": _MASTER}),
)}

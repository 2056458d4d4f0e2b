"""What a run computes in and how its ranks are laid out, decided once from its settings and world
size, beside the mode table.

parallelize, the optimizer and step builders, the config checks and estimation ask these instead of
reading precision settings themselves. Pure Python, no torch: the config checker imports it before
torchrun starts. The records they take are titanlite.parallel.settings' (config builds them).
"""

from __future__ import annotations

from titanlite.errors import ConfigError
from titanlite.parallel.modes import MESH_DIMS, MODES, Mode
from titanlite.parallel.settings import DataParallelSettings, PrecisionSettings


def data_parallel_mode(dp: DataParallelSettings, world: int) -> str:
    """The data-parallel mode a run of `world` ranks uses: the configured one, or "none" for one rank."""
    return dp.data_parallel if world > 1 else "none"


def run_mode(dp: DataParallelSettings, world: int) -> Mode:
    """The Mode record a run of `world` ranks uses."""
    return MODES[data_parallel_mode(dp, world)]


def computes_bf16(precision: PrecisionSettings, device_type: str) -> bool:
    """Does a run on `device_type` compute in bf16? training.mixed_precision_param: auto on CUDA only,
    bfloat16 on any device."""
    setting = precision.mixed_precision_param
    return setting == "bfloat16" or (setting == "auto" and device_type == "cuda")


def bf16_gradients_refusal(dp: DataParallelSettings, precision: PrecisionSettings, device_type: str) -> str | None:
    """Why parallelism.fsdp_gradient_transport has no bf16 gradients to carry in a run on `device_type`, or None:
    they must be FSDP's (fsdp, hsdp), computed in bf16 and reduced in float32."""
    if not MODES[dp.data_parallel].shards_params:
        return f"parallelism.data_parallel={dp.data_parallel} reduces no FSDP gradients"
    if dp.fsdp_reduce_dtype != "float32":
        return "parallelism.fsdp_reduce_dtype=bfloat16 already reduces bf16"
    if not computes_bf16(precision, device_type):
        return (f"training.mixed_precision_param={precision.mixed_precision_param} gives float32 gradients"
                + (f" on {device_type}" if precision.mixed_precision_param == "auto" else ""))
    return None


def bf16_transport_error(why: str) -> ConfigError:
    """parallelism.fsdp_gradient_transport=bfloat16 refused, `why` being bf16_gradients_refusal's phrase or the like."""
    return ConfigError(f"parallelism.fsdp_gradient_transport=bfloat16: {why}; set it to auto or reduce_dtype")


def autocasts(precision: PrecisionSettings, mode: Mode, device_type: str = "cuda") -> bool:
    """Does the forward of a run in `mode` run under bf16 autocast? Where the run computes in bf16,
    unless the mode shards parameters (FSDP's policy then gives bf16 parameters). With
    training.bf16_params the blocks' matrices multiply their own bf16 copies and everything else is
    left to autocast."""
    return computes_bf16(precision, device_type) and not mode.shards_params


def bf16_copies(precision: PrecisionSettings, mode: Mode, device_type: str = "cuda") -> bool:
    """Do the blocks' matrices keep bf16 copies of fp32 masters (training.bf16_params)? Where the run
    computes in bf16 and its mode realises the setting with copies (the Mode record's bf16_params)."""
    return precision.bf16_params and computes_bf16(precision, device_type) and mode.bf16_params == "copies"


def hsdp_shape(dp: DataParallelSettings, world: int, ranks_per_host: int | None = None) -> tuple[int, int]:
    """(replicate, shard) degrees of the hsdp mesh; their product must be the world size.
    `ranks_per_host`: the launcher's ranks per host (titanlite.parallel.launcher_env.Launch), None if unknown."""
    rep, shard = dp.replicate_degree, dp.shard_degree
    per_host = rep == -1 and shard == -1
    if per_host:  # the usual layout: shard inside a node (fast links), replicate across nodes
        shard = ranks_per_host or world
    if rep == -1:
        rep = max(1, world // shard)
    if shard == -1:
        shard = max(1, world // rep)
    if rep * shard != world:
        raise ConfigError(f"parallelism.replicate_degree ({rep}) x parallelism.shard_degree ({shard}) "
                          f"must equal the world size ({world})"
                          + (f"; with both at -1 hsdp shards over a host's {shard} ranks, which do not divide "
                             f"the world size: set the degrees" if per_host else ""))
    return rep, shard


def mesh_shape(dp: DataParallelSettings, world: int, ranks_per_host: int | None = None) -> dict[str, int]:
    """The device mesh of a run of `world` ranks: its dimensions' sizes by name, outermost first (MESH_DIMS'
    order); empty for one rank. A mode over one dimension lays every rank along it; over replicate x
    shard the degrees are hsdp_shape's."""
    dims = run_mode(dp, world).mesh
    if len(dims) <= 1:
        return {d: world for d in dims}
    if dims != MESH_DIMS:
        raise ValueError(f"no layout for a mesh over {dims}")  # a new mode's dimensions need their sizes here
    return dict(zip(dims, hsdp_shape(dp, world, ranks_per_host)))

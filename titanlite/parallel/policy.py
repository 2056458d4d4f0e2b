"""What a run computes in, decided once from its config and world size, beside the mode table.

parallelize, the optimizer and step builders, the config checks and estimation ask these instead of
reading precision settings themselves. Pure Python, no torch: the config checker imports it before
torchrun starts. `cfg` is a titanlite.config.JobConfig (read, never imported: config sits above).
"""

from __future__ import annotations

import os

from titanlite.errors import ConfigError
from titanlite.parallel.modes import MODES, Mode


def data_parallel_mode(cfg, world: int) -> str:
    """The data-parallel mode a run of `world` ranks uses: the configured one, or "none" for one rank."""
    return cfg.parallelism.data_parallel if world > 1 else "none"


def run_mode(cfg, world: int) -> Mode:
    """The Mode record a run of `world` ranks uses."""
    return MODES[data_parallel_mode(cfg, world)]


def computes_bf16(cfg, device_type: str) -> bool:
    """Does a run on `device_type` compute in bf16? training.mixed_precision_param: auto on CUDA only,
    bfloat16 on any device."""
    precision = cfg.training.mixed_precision_param
    return precision == "bfloat16" or (precision == "auto" and device_type == "cuda")


def autocasts(cfg, world: int, device_type: str = "cuda") -> bool:
    """Does the forward run under bf16 autocast? Where the run computes in bf16, unless the mode
    shards parameters (FSDP's policy then gives bf16 parameters). With training.bf16_params the
    blocks' matrices multiply their own bf16 copies and everything else is left to autocast."""
    return computes_bf16(cfg, device_type) and not run_mode(cfg, world).shards_params


def bf16_copies(cfg, world: int, device_type: str = "cuda") -> bool:
    """Do the blocks' matrices keep bf16 copies of fp32 masters (training.bf16_params)? Where the run
    computes in bf16 and its mode realises the setting with copies (the Mode record's bf16_params)."""
    return (cfg.training.bf16_params and computes_bf16(cfg, device_type)
            and run_mode(cfg, world).bf16_params == "copies")


def ranks_per_host() -> int | None:
    """This host's ranks as torchrun states them (LOCAL_WORLD_SIZE); None when the launcher does not say."""
    n = os.environ.get("LOCAL_WORLD_SIZE")
    return int(n) if n else None


def hsdp_shape(cfg, world: int) -> tuple[int, int]:
    """(replicate, shard) degrees of the hsdp mesh; their product must be the world size."""
    p = cfg.parallelism
    rep, shard = p.replicate_degree, p.shard_degree
    if rep == -1 and shard == -1:  # the usual layout: shard inside a node (fast links), replicate across nodes
        shard = ranks_per_host() or world
    if rep == -1:
        rep = max(1, world // shard)
    if shard == -1:
        shard = max(1, world // rep)
    if rep * shard != world:
        raise ConfigError(f"parallelism.replicate_degree ({rep}) x parallelism.shard_degree ({shard}) "
                          f"must equal the world size ({world})")
    return rep, shard

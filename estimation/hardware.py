"""Which GPU a dry run targets, and the attention kernel it would run there.

The GPU facts themselves (peak, memory, bandwidths, link) are titanlite.hardware's table; the rates
achieved on them are estimation/calibration.json's.
"""

from __future__ import annotations

from titanlite.config import ConfigError
from titanlite.hardware import GPUS_PER_NODE, Hardware, by_key, keys  # noqa: F401


def get_hardware(name: str) -> Hardware:
    hw = by_key(name)
    if hw is None:
        raise ConfigError(f"estimate.hardware '{name}' is unknown; choose from {', '.join(keys())}")
    return hw


def auto_attention(hw: Hardware) -> str:
    """What attention_backend=auto picks on that GPU, assuming no flash-attn package is installed."""
    return "sdpa_cudnn" if hw.capability >= 9 else "sdpa_flash"


def gpus_per_node(est) -> int:
    """GPUs per node of the modelled machine: estimate.gpus_per_node, or (0) titanlite.hardware's board of 8."""
    return est.gpus_per_node or GPUS_PER_NODE


def on_nodes(cfg, world: int):
    """`cfg` as `world` ranks on nodes of estimate.gpus_per_node run it: hsdp's default mesh (both
    degrees -1) shards inside a node, the node size being what torchrun's LOCAL_WORLD_SIZE gives the
    training run. A copy where that changes anything, else `cfg` itself."""
    import copy

    p, node = cfg.parallelism, gpus_per_node(cfg.estimate)
    if p.data_parallel != "hsdp" or p.replicate_degree != -1 or p.shard_degree != -1 or world % node:
        return cfg
    cfg = copy.deepcopy(cfg)
    cfg.parallelism.shard_degree = min(node, world)
    return cfg

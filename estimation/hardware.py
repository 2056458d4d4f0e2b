"""Which GPU a dry run targets, the attention kernel it would run there, and the nodes it is laid out on.

The GPU facts themselves (peak, memory, bandwidths, link) are titanlite.hardware's table; the rates
achieved on them are estimation/calibration.json's.
"""

from __future__ import annotations

from titanlite.config import ConfigError
from titanlite.hardware import GPUS_PER_NODE, Hardware, by_key, keys  # noqa: F401
from titanlite.parallel.launcher_env import Launch


def get_hardware(name: str) -> Hardware:
    hw = by_key(name)
    if hw is None:
        raise ConfigError(f"estimate.hardware '{name}' is unknown; choose from {', '.join(keys())}")
    return hw


def auto_attention(hw: Hardware) -> str:
    """What attention_backend=auto picks on that GPU, assuming no flash-attn package is installed."""
    return "sdpa_cudnn" if hw.capability >= 9 else "sdpa_flash"


def attention_kernel(backend: str, hw: Hardware) -> str:
    """The kernel whose rate a backend runs at on that GPU: unpinned `sdpa` is the kernel torch picks,
    cuDNN's from Hopper on (the kernel names benchmarks/attention.py records on H100 and H200), as
    `auto` pins it."""
    return auto_attention(hw) if backend == "sdpa" else backend


def gpus_per_node(est) -> int:
    """GPUs per node of the modelled machine: estimate.gpus_per_node, or (0) titanlite.hardware's board of 8."""
    return est.gpus_per_node or GPUS_PER_NODE


def launch_on_nodes(est, world: int) -> Launch:
    """The launcher's record of a job of `world` ranks on nodes of estimate.gpus_per_node GPUs, as torchrun
    gives it (LOCAL_WORLD_SIZE: the ranks on one node). The fake run lays its mesh out from it by the
    trainer's own policy.mesh_shape, so hsdp's default mesh shards inside a node as the training run's."""
    return Launch(world_size=world, ranks_per_host=min(gpus_per_node(est), world))

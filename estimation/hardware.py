"""Which GPU a dry run targets, and the attention kernel it would run there.

The GPU facts themselves (peak, memory, bandwidths, link) are titanlite.hardware's table.
"""

from __future__ import annotations

from titanlite.config import ConfigError
from titanlite.hardware import GPUS_PER_NODE, INTER_NODE_GBPS, Hardware, by_key, keys  # noqa: F401

# Attention kernel rates as a fraction of the bf16 peak, forward + backward, counting causal FLOPs
# (half the dense square). Measured on H100 at B=8, H=18, S=2048, D=128: cuDNN SDPA 323 TFLOP/s,
# flash SDPA 206 (of 989). FA3 / FA2 / efficient are not measured here: assumed.
ATTENTION_EFFICIENCY = {
    "flash_attn_3": 0.45, "sdpa_cudnn": 323 / 989, "flash_attn": 0.25, "sdpa_flash": 206 / 989,
    "sdpa_efficient": 0.15, "sdpa": 206 / 989, "manual": 0.05,
}


def get_hardware(name: str) -> Hardware:
    hw = by_key(name)
    if hw is None:
        raise ConfigError(f"estimate.hardware '{name}' is unknown; choose from {', '.join(keys())}")
    return hw


def auto_attention(hw: Hardware) -> str:
    """What attention_backend=auto picks on that GPU, assuming no flash-attn package is installed."""
    return "sdpa_cudnn" if hw.capability >= 9 else "sdpa_flash"

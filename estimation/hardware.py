"""Which GPU a dry run targets, and the attention kernel it would run there.

The GPU facts themselves (peak, memory, bandwidths, link) are titanlite.hardware's table; the rates
achieved on them are estimation/calibration.json's.
"""

from __future__ import annotations

from titanlite.config import ConfigError
from titanlite.hardware import GPUS_PER_NODE, INTER_NODE_GBPS, Hardware, by_key, keys  # noqa: F401


def get_hardware(name: str) -> Hardware:
    hw = by_key(name)
    if hw is None:
        raise ConfigError(f"estimate.hardware '{name}' is unknown; choose from {', '.join(keys())}")
    return hw


def auto_attention(hw: Hardware) -> str:
    """What attention_backend=auto picks on that GPU, assuming no flash-attn package is installed."""
    return "sdpa_cudnn" if hw.capability >= 9 else "sdpa_flash"

"""GPUs the dry run can target: memory, bandwidths and links (bf16 peaks come from titanlite.metrics.peaks).

Memory is the total that `torch.cuda.get_device_properties(i).total_memory` reports (GiB, approximate;
benchmarks/estimation_gpu.py prints the real figure). Bandwidths are datasheet numbers; the achieved
fractions are `estimate.*_efficiency` options, so every assumption is visible and overridable.
"""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.config import ConfigError
from titanlite.metrics.peaks import peak_tflops


@dataclass(frozen=True)
class Hardware:
    device_name: str     # as torch.cuda.get_device_name reports it: keys the bf16 peak table
    memory_gib: float    # total device memory torch sees
    hbm_tbps: float      # device-memory bandwidth, TB/s
    link_gbps: float     # intra-node per-GPU one-direction bandwidth for collectives, GB/s
    capability: int      # CUDA compute capability major: picks the attention kernel `auto` gets

    @property
    def peak_tflops(self) -> float:
        return peak_tflops(self.device_name)


HARDWARE: dict[str, Hardware] = {
    "a100-40gb": Hardware("NVIDIA A100-SXM4-40GB", 39.39, 1.555, 300.0, 8),
    "a100": Hardware("NVIDIA A100-SXM4-80GB", 79.15, 2.039, 300.0, 8),
    "a6000": Hardware("NVIDIA RTX A6000", 47.54, 0.768, 32.0, 8),  # PCIe 4.0 x16, no NVLink switch
    "l40s": Hardware("NVIDIA L40S", 44.39, 0.864, 32.0, 8),
    "h100": Hardware("NVIDIA H100 80GB HBM3", 79.19, 3.35, 450.0, 9),  # SXM, NVLink 4
    "h100-pcie": Hardware("NVIDIA H100 PCIe", 79.19, 2.0, 64.0, 9),
    "h200": Hardware("NVIDIA H200", 139.81, 4.8, 450.0, 9),
    "b200": Hardware("NVIDIA B200", 178.35, 8.0, 900.0, 10),  # NVLink 5
}
HARDWARE["a100-80gb"] = HARDWARE["a100"]

# Beyond one 8-GPU node collectives cross the network: 400 Gb/s InfiniBand per GPU.
INTER_NODE_GBPS = 50.0
GPUS_PER_NODE = 8

# Attention kernel rates as a fraction of the bf16 peak, forward + backward, counting causal FLOPs
# (half the dense square). Measured on H100 at B=8, H=18, S=2048, D=128: cuDNN SDPA 323 TFLOP/s,
# flash SDPA 206 (of 989). FA3 / FA2 / efficient are not measured here: assumed.
ATTENTION_EFFICIENCY = {
    "flash_attn_3": 0.45, "sdpa_cudnn": 323 / 989, "flash_attn": 0.25, "sdpa_flash": 206 / 989,
    "sdpa_efficient": 0.15, "sdpa": 206 / 989, "manual": 0.05,
}


def get_hardware(name: str) -> Hardware:
    hw = HARDWARE.get(name.lower())
    if hw is None:
        raise ConfigError(f"estimate.hardware '{name}' is unknown; choose from {', '.join(sorted(HARDWARE))}")
    return hw


def auto_attention(hw: Hardware) -> str:
    """What attention_backend=auto picks on that GPU, assuming no flash-attn package is installed."""
    return "sdpa_cudnn" if hw.capability >= 9 else "sdpa_flash"

"""The one table of GPU facts: dense bf16 peak, memory, HBM bandwidth, intra-node link, compute capability.

Read by the Trainer (MFU), estimation (dry runs target a GPU by its key) and diagnose (peaks and
link bandwidths of the GPUs named in run logs). A new GPU is one row here.

Peaks are the DENSE bf16 tensor-core figures. Datasheets also print sparse and fp8 figures (for a
B200 4.5 PFLOP/s is sparse bf16 or dense fp8); an MFU over those is understated about 2x, so they
are never used. Memory is what `torch.cuda.get_device_properties(i).total_memory` reports (GiB).
Link is the per-GPU, one-direction bandwidth collectives see inside one node.
"""

from __future__ import annotations

from dataclasses import dataclass

# GPUs one node holds, the GPUs NVLink (or the node's PCIe) joins: an HGX/DGX board. Beyond it collectives
# cross the network, whose bandwidth is estimation's setting (estimate.inter_node_gbps).
GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Hardware:
    key: str             # short name used on the command line (--estimate.hardware h100)
    match: str           # substring of torch.cuda.get_device_name that identifies it
    device_name: str     # a full name torch reports for it
    peak_tflops: float   # dense bf16 tensor-core peak per GPU
    memory_gib: float    # total device memory torch sees
    hbm_tbps: float      # device-memory bandwidth, TB/s
    link_gbps: float     # intra-node per-GPU one-direction bandwidth for collectives, GB/s
    capability: int      # CUDA compute capability major (9 = Hopper: cuDNN attention, float8)


# Most specific match first: "H100 PCIe" before "H100", "GB200" before "B200".
TABLE: list[Hardware] = [
    Hardware("gb200", "GB200", "NVIDIA GB200", 2500.0, 184.0, 8.0, 900.0, 10),
    Hardware("b200", "B200", "NVIDIA B200", 2250.0, 178.35, 8.0, 900.0, 10),        # NVLink 5
    Hardware("h200", "H200", "NVIDIA H200", 989.0, 139.81, 4.8, 450.0, 9),
    Hardware("h100-pcie", "H100 PCIe", "NVIDIA H100 PCIe", 756.0, 79.19, 2.0, 64.0, 9),
    Hardware("h100-nvl", "H100 NVL", "NVIDIA H100 NVL", 835.0, 93.1, 3.9, 300.0, 9),
    Hardware("h100", "H100", "NVIDIA H100 80GB HBM3", 989.0, 79.19, 3.35, 450.0, 9),  # SXM, NVLink 4
    Hardware("h800", "H800", "NVIDIA H800", 989.0, 79.19, 3.35, 200.0, 9),
    Hardware("a100-40gb", "A100-SXM4-40GB", "NVIDIA A100-SXM4-40GB", 312.0, 39.39, 1.555, 300.0, 8),
    Hardware("a100", "A100", "NVIDIA A100-SXM4-80GB", 312.0, 79.15, 2.039, 300.0, 8),
    Hardware("a800", "A800", "NVIDIA A800-SXM4-80GB", 312.0, 79.15, 2.039, 200.0, 8),
    # PCIe 4.0 x16 (an NVLink bridge joins only pairs of cards, so collectives over more use PCIe)
    Hardware("a6000", "RTX A6000", "NVIDIA RTX A6000", 154.85, 47.54, 0.768, 32.0, 8),
    Hardware("l40s", "L40S", "NVIDIA L40S", 362.05, 44.39, 0.864, 32.0, 8),
    Hardware("l4", "L4", "NVIDIA L4", 121.0, 22.05, 0.3, 32.0, 8),
]
BY_KEY: dict[str, Hardware] = {hw.key: hw for hw in TABLE}
ALIASES = {"a100-80gb": "a100"}


def lookup(device_name: str) -> Hardware | None:
    """The row whose match string is in `device_name` (as torch or nvidia-smi print it), else None."""
    return next((hw for hw in TABLE if hw.match in device_name), None) if device_name else None


def by_key(key: str) -> Hardware | None:
    """The row for a short key ("h100"), an alias, or a device name; None when unknown."""
    k = key.strip().lower()
    return BY_KEY.get(ALIASES.get(k, k)) or lookup(key)


def peak_tflops(device_name: str, override: float = 0.0) -> float | None:
    """Dense bf16 peak per GPU: the configured override, else the table's, else None (MFU not shown)."""
    if override > 0:
        return override
    hw = lookup(device_name)
    return hw.peak_tflops if hw else None


def keys() -> list[str]:
    """Every short key and alias, sorted (what --estimate.hardware accepts)."""
    return sorted([*BY_KEY, *ALIASES])


FLOAT8_CAPABILITY = (8, 9)  # hardware float8 matmuls: Ada, Hopper, Blackwell


def float8_refusal(where: str) -> str:
    """The one line refusing float8.enable on `where` (the device or machine that lacks it)."""
    return (f"float8.enable needs a GPU with compute capability >= {FLOAT8_CAPABILITY[0]}.{FLOAT8_CAPABILITY[1]} "
            f"(H100-class), not {where}; set float8.emulate=true to emulate it (tests only, slow)")

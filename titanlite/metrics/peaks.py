"""Dense bf16 peak TFLOP/s per GPU, for MFU. Matched on the device name, most specific first."""

from __future__ import annotations

# (substring of torch.cuda.get_device_name, peak dense bf16 TFLOP/s). Sparse / fp8 figures are
# never used: the seeds' 4500 for B200 was a sparse figure and understated their MFU about 2x.
PEAK_BF16_TFLOPS: list[tuple[str, float]] = [
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("RTX A6000", 154.85),
    ("L40S", 362.05),
    ("L4", 121.0),
]


def peak_tflops(device_name: str, override: float = 0.0) -> float | None:
    """The configured override, else the table's figure, else None (MFU is then not shown)."""
    if override > 0:
        return override
    for key, value in PEAK_BF16_TFLOPS:
        if key in device_name:
            return value
    return None

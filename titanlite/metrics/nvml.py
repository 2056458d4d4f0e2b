"""GPU utilisation, power and SM clock per log step through NVML (nvidia-ml-py, `import pynvml`).

Silently absent without a CUDA device or without the package; one warning if NVML fails to start.
Utilisation is NVML's own figure: the share of its last sample period (1/6 s to 1 s) in which any
kernel ran, not how busy the SMs were.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("titanlite")


class GpuMonitor:
    def __init__(self, device: torch.device):
        self.handle, self.nvml = None, None
        if device.type != "cuda":
            return
        try:
            import pynvml
        except ImportError:
            return
        try:
            pynvml.nvmlInit()
            # NVML numbers GPUs physically; CUDA_VISIBLE_DEVICES renumbers them: match on the PCI bus id.
            p = torch.cuda.get_device_properties(device)
            bus = f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
            self.handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus.encode())
            self.nvml = pynvml
        except Exception as e:  # NVML missing from the driver, no permission, old torch without PCI ids
            logger.warning(f"NVML unavailable, no GPU utilisation/power in the run log: {e}")

    def sample(self) -> dict:
        if self.handle is None:
            return {}
        n, h = self.nvml, self.handle
        try:
            return {"gpu_util_pct": float(n.nvmlDeviceGetUtilizationRates(h).gpu),
                    "power_w": n.nvmlDeviceGetPowerUsage(h) / 1000,
                    "sm_clock_mhz": float(n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM))}
        except Exception as e:
            logger.warning(f"NVML query failed, stopping GPU sampling: {e}")
            self.handle = None
            return {}

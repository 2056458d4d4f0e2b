"""Process-group setup and the data-parallel layout of this run."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titanlite.parallel.policy import data_parallel_mode


@dataclass
class ParallelDims:
    world_size: int
    rank: int
    local_rank: int
    device: torch.device
    mode: str  # parallelism.data_parallel, or "none" when there is one rank

    @property
    def dp_size(self) -> int:
        return self.world_size  # every rank is a data-parallel rank (no tensor/pipeline parallelism)

    @property
    def dp_rank(self) -> int:
        return self.rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(cfg) -> ParallelDims:
    """Join the process group torchrun set up (if any) and pick this rank's device. The configuration
    was checked for this world size when it was loaded (config.manager.load_config)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    shared = cfg.debug.inject_shared_device  # a fault on purpose (titanlite.debug): every rank on one device
    if torch.cuda.is_available():
        device = torch.device("cuda", 0 if shared else local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        if shared:
            from titanlite.debug import share_one_cpu_core

            share_one_cpu_core()
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" and not shared else "gloo"  # NCCL refuses two ranks on one GPU
        if backend == "nccl" and cfg.training.cuda_graphs and os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") != "0":
            # torch's CUDA-graph notes: collectives captured in a graph need NCCL's asynchronous error
            # handling off. torchrun always sets it (to 1 unless told otherwise), so it is overwritten
            # here. The cost: a hung collective then hangs instead of aborting after the timeout.
            if rank == 0:
                logging.getLogger("titanlite").info(
                    "training.cuda_graphs: TORCH_NCCL_ASYNC_ERROR_HANDLING=0 (torch's CUDA-graph requirement; "
                    "a hung collective will hang rather than abort)")
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
        dist.init_process_group(backend=backend, device_id=device if backend == "nccl" else None)
    return ParallelDims(world, rank, local_rank, device, data_parallel_mode(cfg, world))

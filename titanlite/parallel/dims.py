"""This rank's place in the job: the process group, the one device mesh of the job's ranks, and the device.

The mesh is built once, right after the process group starts (`init_distributed`, through
`parallel_dims`), with named dimensions (titanlite.parallel.modes.MESH_DIMS): "dp_replicate" and
"dp_shard" today, sized by the mode (titanlite.parallel.policy.mesh_shape). Every collective takes
its process group from it: the wrappers and zero1's optimizer along one dimension (`group`), the
step's loss and validation averages over the data-parallel dimensions together (`dp_group`), the
checkpoint's and the run log's host-side gathers over the job's ranks (`ranks`). Estimation's fake
run builds its mesh through the same `parallel_dims`, over the fake process group it started.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titanlite.debug import share_one_cpu_core
from titanlite.hardware import FLOAT8_CAPABILITY
from titanlite.parallel.launcher_env import Launch
from titanlite.parallel.policy import data_parallel_mode, mesh_shape
from titanlite.parallel.settings import DataParallelSettings, ParallelSettings


@dataclass(frozen=True)
class ParallelDims:
    mode: str                       # parallelism.data_parallel, or "none" when there is one rank
    rank: int
    world_size: int
    device: torch.device            # where this rank's tensors live
    mesh: DeviceMesh | None = None  # the job's ranks over named dimensions (MESH_DIMS order); None for one rank
    ranks_per_host: int | None = None  # the launcher's ranks per host (None: it does not say)
    device_memory: int | None = None   # the GPU's bytes (None: not a GPU), for choices that weigh memory
    float8: bool = False            # the device runs float8 matmuls (compute capability 8.9+)
    # the data-parallel dimensions' ranks together (see dp_group below); None for one rank
    dp_group: ProcessGroup | None = None

    def size(self, dim: str) -> int:
        """Ranks along mesh dimension `dim` (1 where the mesh has no such dimension)."""
        if self.mesh is None or dim not in self.mesh.mesh_dim_names:
            return 1
        return self.mesh.size(self.mesh.mesh_dim_names.index(dim))

    def group(self, dim: str) -> ProcessGroup | None:
        """The process group of this rank's ranks along mesh dimension `dim` (None where the mesh has no
        such dimension: one rank along it)."""
        if self.mesh is None or dim not in self.mesh.mesh_dim_names:
            return None
        return self.mesh.get_group(dim)

    @property
    def ranks(self) -> list[int]:
        """Every rank of the job, as the mesh lays them out (row-major)."""
        return self.mesh.mesh.flatten().tolist() if self.mesh is not None else [self.rank]

    @property
    def dp_dims(self) -> tuple[str, ...]:
        """The mesh dimensions that split the batch (today every one: no tensor or pipeline parallelism)."""
        return tuple(self.mesh.mesh_dim_names) if self.mesh is not None else ()

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: the product of the data-parallel dimensions."""
        return math.prod(self.size(d) for d in self.dp_dims)

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (its coordinates on those dimensions, row-major)."""
        if self.mesh is None:
            return 0
        names, coordinate = self.mesh.mesh_dim_names, self.mesh.get_coordinate()
        index = 0
        for d in self.dp_dims:
            index = index * self.size(d) + coordinate[names.index(d)]
        return index

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def parallel_dims(dp: DataParallelSettings, launch: Launch, device: torch.device, device_memory: int | None = None,
                  float8: bool = False) -> ParallelDims:
    """This rank's dims over the process group already started (the job's, or estimation's fake one):
    its mode and the job's device mesh, laid out by policy.mesh_shape. Building the mesh reads its rank
    layout back, so call it outside fake-tensor modes."""
    mode = data_parallel_mode(dp, launch.world_size)
    shape = mesh_shape(dp, launch.world_size, launch.ranks_per_host)
    mesh = init_device_mesh(device.type, tuple(shape.values()), mesh_dim_names=tuple(shape)) if shape else None
    dims = ParallelDims(mode, launch.rank, launch.world_size, device, mesh, launch.ranks_per_host, device_memory,
                        float8)
    return replace(dims, dp_group=dp_group(mesh, dims.dp_dims))


def dp_group(mesh: DeviceMesh | None, dp_dims: tuple[str, ...]) -> ProcessGroup | None:
    """The process group of the data-parallel dimensions `dp_dims` together (every dimension today): the
    one dimension's, or the dimensions flattened into one. Flattening is collective, so it happens here,
    where every rank builds the mesh; where the flattened ranks are the whole job (today always) torch
    hands back the default group, so no communicator is added. (torch 2.11 and 2.13 flatten a mesh
    through DeviceMesh._flatten only: no public name for it.)"""
    if mesh is None:
        return None
    if len(dp_dims) == 1:
        return mesh.get_group(dp_dims[0])
    return mesh[dp_dims]._flatten("dp").get_group()


def float8_supported(device: torch.device) -> bool:
    """Hardware float8 matmuls need compute capability 8.9+ (Ada / Hopper / Blackwell)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FLOAT8_CAPABILITY


def init_distributed(settings: ParallelSettings, launch: Launch) -> ParallelDims:
    """Join the process group the launcher set up (if any), pick this rank's device and lay the job's
    ranks out on the device mesh. The configuration was checked for this world size when it was
    loaded (config.manager.load_config)."""
    shared = settings.shared_device  # a fault on purpose (titanlite.debug): every rank on one device
    if torch.cuda.is_available():
        device = torch.device("cuda", 0 if shared else launch.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        if shared:
            share_one_cpu_core()
    if launch.world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" and not shared else "gloo"  # NCCL refuses two ranks on one GPU
        dist.init_process_group(backend=backend, device_id=device if backend == "nccl" else None)
    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    return parallel_dims(settings.data_parallel, launch, device, memory, float8_supported(device))

"""What the launcher told this process, read from the environment once, where the process starts.

torchrun (or a SLURM wrapper setting the same variables) describes each rank's place in the job
through environment variables. `Launch.from_environ` is the one reader of them: the entry points
(`titanlite.train.main`, `python -m titanlite.config.check`, `run_cli`) call it and hand the record
down, to `load_config`, the Trainer, `init_distributed` and the mesh layout; nothing below them
looks at the environment. `load_config` and `Trainer` read it themselves only when they are not
handed one (a library caller's default). Pure Python, no torch: the config checker imports it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Launch:
    world_size: int = 1                # WORLD_SIZE: ranks in the job
    rank: int = 0                      # RANK: this process's rank
    local_rank: int = 0                # LOCAL_RANK: its index on its host, which picks its GPU
    ranks_per_host: int | None = None  # LOCAL_WORLD_SIZE: ranks sharing this host; None where the launcher does not say
    torchrun: bool = False             # started by torchrun's agent (TORCHELASTIC_RUN_ID), which watch_launcher follows
    error_file: str | None = None      # TORCHELASTIC_ERROR_FILE: where torchrun reads why a rank failed

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> "Launch":
        """The launcher's variables as they are now; one process alone where none is set."""
        per_host = environ.get("LOCAL_WORLD_SIZE")
        return cls(world_size=int(environ.get("WORLD_SIZE", "1")), rank=int(environ.get("RANK", "0")),
                   local_rank=int(environ.get("LOCAL_RANK", "0")), ranks_per_host=int(per_host) if per_host else None,
                   torchrun="TORCHELASTIC_RUN_ID" in environ, error_file=environ.get("TORCHELASTIC_ERROR_FILE"))

"""The typed records titanlite.parallel takes, built from a JobConfig: the one place config meets them.

Each record's fields bear the names of the config keys they are taken from (titanlite.parallel.settings),
so a key added to a section reaches parallel/ by adding the field of the same name there.
"""

from __future__ import annotations

import dataclasses

from titanlite.config.job_config import JobConfig
from titanlite.parallel import policy
from titanlite.parallel.modes import Mode
from titanlite.parallel.settings import (ActivationCheckpointSettings, CompileSettings, DataParallelSettings,
                                         Float8Settings, ParallelSettings, PrecisionSettings)


def _section(record: type, section):
    """`record` filled from the config section's keys of the same names."""
    return record(**{f.name: getattr(section, f.name) for f in dataclasses.fields(record)})


def parallel_settings(cfg: JobConfig) -> ParallelSettings:
    """What titanlite.parallel is told about the run `cfg` describes."""
    t = cfg.training
    return ParallelSettings(
        data_parallel=_section(DataParallelSettings, cfg.parallelism),
        precision=_section(PrecisionSettings, t),
        float8=_section(Float8Settings, cfg.float8),
        activation_checkpoint=_section(ActivationCheckpointSettings, cfg.activation_checkpoint),
        compile=_section(CompileSettings, cfg.compile),
        seed=t.seed, loss=t.loss, cuda_graphs=t.cuda_graphs, shared_device=cfg.debug.inject_shared_device)


def data_parallel_mode(cfg: JobConfig, world: int) -> str:
    """The data-parallel mode a run of `cfg` on `world` ranks uses (titanlite.parallel.policy's, for a JobConfig)."""
    return policy.data_parallel_mode(_section(DataParallelSettings, cfg.parallelism), world)


def run_mode(cfg: JobConfig, world: int) -> Mode:
    """The Mode record a run of `cfg` on `world` ranks uses."""
    return policy.run_mode(_section(DataParallelSettings, cfg.parallelism), world)

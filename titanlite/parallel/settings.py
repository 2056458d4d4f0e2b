"""What titanlite.parallel is told about a run: small typed records, built from the job's config by
`titanlite.config.parallel_settings` (each field bears the name of the config key it is taken from).

parallel/ never sees a JobConfig: config sits above it (it checks settings against the mode table
and the registries below), so these records are the one way settings travel down. A function here
declares which record it reads, and a test or the estimator builds one with `dataclasses.replace`
of the config's. Pure Python, no torch: the config checker imports it before torchrun starts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DataParallelSettings:
    """The parallelism section: the mode, its mesh degrees and how its wrapper is built."""
    data_parallel: str                # the mode's name in parallel/modes.py's MODES
    replicate_degree: int             # hsdp: replicas (-1: world / shard_degree)
    shard_degree: int                 # hsdp: shards per replica (-1: world / replicate_degree)
    ddp_bucket_cap_mb: int
    ddp_bucket_view: bool
    ddp_reduce_dtype: str             # "float32" | "bfloat16"
    fsdp_reshard_after_forward: str   # "auto" | "default" | "always" | "never"
    fsdp_reduce_dtype: str            # "float32" | "bfloat16"
    fsdp_gradient_transport: str      # "auto" | "bfloat16" | "reduce_dtype"
    fsdp_accumulate: str              # "auto" | "unsharded" | "sharded"
    fsdp_blocks_per_group: int        # consecutive blocks in one FSDP group
    fsdp_copy_engine_all_gather: str  # "auto" | "on" | "off"


@dataclass(frozen=True)
class PrecisionSettings:
    """training.mixed_precision_param and training.bf16_params (parallel/policy.py reads them)."""
    mixed_precision_param: str        # "auto" | "bfloat16" | "float32"
    bf16_params: bool


@dataclass(frozen=True)
class Float8Settings:
    """The float8 section."""
    enable: bool
    recipe: str                       # "tensorwise" | "rowwise"
    emulate: bool
    backward_fast_accum: bool


@dataclass(frozen=True)
class ActivationCheckpointSettings:
    """The activation_checkpoint section."""
    mode: str                         # "none" | "full" | "selective"
    selective_option: str             # "op" or N


@dataclass(frozen=True)
class CompileSettings:
    """The compile section."""
    enable: bool
    mode: str
    coordinate_descent_tuning: bool


@dataclass(frozen=True)
class ParallelSettings:
    """Everything `parallelize`, the data-parallel wrappers and the process-group start read."""
    data_parallel: DataParallelSettings
    precision: PrecisionSettings
    float8: Float8Settings
    activation_checkpoint: ActivationCheckpointSettings
    compile: CompileSettings
    seed: int                         # training.seed: the weights' initialisation
    loss: str                         # training.loss: cross_entropy gives the output layer a bf16 copy too
    cuda_graphs: bool                 # training.cuda_graphs: wrappers built for capture
    shared_device: bool               # debug.inject_shared_device: every rank on one device (a fault on purpose)

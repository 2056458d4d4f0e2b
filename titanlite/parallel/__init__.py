"""Parallelism applied from outside the model, one function per technique.

Order (documented, fixed): float8 -> activation checkpointing -> compile per TransformerBlock
-> materialise + init -> data-parallel wrapping. `parallelize` composes them from typed config;
nothing here reads TOML.
"""

from titanlite.parallel.data_parallel import clip_grad_norm, grad_sync
from titanlite.parallel.dims import ParallelDims, init_distributed
from titanlite.parallel.parallelize import float8_post_step, parallelize

__all__ = ["ParallelDims", "init_distributed", "parallelize", "grad_sync", "clip_grad_norm", "float8_post_step"]

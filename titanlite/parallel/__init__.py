"""Parallelism applied from outside the model, one function per technique.

Order (documented, fixed): float8 -> activation checkpointing -> compile per TransformerBlock
-> data-parallel wrapping. `parallelize` composes them from typed config; nothing here reads TOML.
"""

from titanlite.parallel.dims import ParallelDims, init_distributed
from titanlite.parallel.parallelize import grad_sync, parallelize

__all__ = ["ParallelDims", "init_distributed", "parallelize", "grad_sync"]

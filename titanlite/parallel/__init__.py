"""Parallelism applied from outside the model, one function per technique.

Order (documented, fixed): float8 -> activation checkpointing -> compile per TransformerBlock
-> materialise + init -> data-parallel wrapping (`titanlite.parallel.apply.parallelize` composes
them from typed config; nothing here reads TOML). The names below load on first use, so that the
config checker can import `titanlite.parallel.modes` (pure data) without importing torch.
"""

import importlib

_EXPORTS = {
    "ParallelDims": "titanlite.parallel.dims", "init_distributed": "titanlite.parallel.dims",
    "parallelize": "titanlite.parallel.apply", "float8_post_step": "titanlite.parallel.apply",
    "grad_sync": "titanlite.parallel.data_parallel", "clip_grad_norm": "titanlite.parallel.data_parallel",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'titanlite.parallel' has no attribute {name!r}")

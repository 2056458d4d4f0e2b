"""Datasets by name. Each builder returns train and validation token sources for one data-parallel rank.

A builder takes (cfg, dp_rank, dp_size) and returns a `DataSources`. Add one by adding to DATASETS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch


@dataclass
class DataSources:
    train: "Iterator[tuple[torch.Tensor, torch.Tensor]]"  # yields (inputs, labels), (local_bs, seq_len) int64
    make_val: Callable[[], "Iterator[tuple[torch.Tensor, torch.Tensor]]"]  # fresh validation iterator
    vocab_size: int  # tokens the data can contain (the model's vocab must be >= this)
    description: str


def _synthetic(cfg, dp_rank: int, dp_size: int) -> DataSources:
    from titanlite.data.synthetic import SyntheticBatches

    from titanlite.models import get_model_args

    vocab = cfg.model.vocab_size or get_model_args(cfg.model.name, cfg.model.flavor).vocab_size
    mk = lambda seed: SyntheticBatches(vocab, cfg.training.local_batch_size, cfg.training.seq_len, seed, dp_rank)
    return DataSources(mk(cfg.training.seed), lambda: mk(cfg.training.seed + 1_000_003), vocab,
                       "synthetic uniform random tokens")


def _python_stdlib(cfg, dp_rank: int, dp_size: int) -> DataSources:
    from titanlite.data.stdlib_corpus import build_stdlib_sources

    return build_stdlib_sources(cfg, dp_rank, dp_size)


DATASETS: dict[str, Callable] = {"synthetic": _synthetic, "python_stdlib": _python_stdlib}


def build_data(cfg, dp_rank: int, dp_size: int) -> DataSources:
    from titanlite.config import ConfigError

    if cfg.training.dataset not in DATASETS:
        raise ConfigError(f"training.dataset must be one of {', '.join(DATASETS)}; got '{cfg.training.dataset}'")
    return DATASETS[cfg.training.dataset](cfg, dp_rank, dp_size)

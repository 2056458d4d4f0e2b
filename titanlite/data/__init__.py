"""Datasets by name. Each builder returns train and validation sources for one data-parallel rank.

A builder takes (cfg, dp_rank, dp_size) and returns a `DataSources`. Add one by adding to DATASETS.
The sharding, ordering and resume guarantees are in titanlite/data/loader.py; docs/data.md says
how to prepare a corpus. Importing this package does not import torch (the prepare CLI stays fast).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from titanlite.config import ConfigError

if TYPE_CHECKING:
    import torch

    from titanlite.data.loader import TrainLoader

Batches = Iterator["tuple[torch.Tensor, torch.Tensor]"]  # (inputs, labels), (local_bs, seq_len) int64 on CPU


@dataclass
class DataSources:
    train: "TrainLoader"  # batches, with state_dict()/load_state_dict() for exact resume
    make_val: Callable[[], Batches]  # a fresh pass over the validation split
    vocab_size: int  # tokens the data can contain (the model's vocab must be >= this)
    description: str
    tokenizer_path: str = ""  # tokenizer.json of text datasets (recorded with checkpoints)


def _sources(cfg, train_set, val_set, dp_rank: int, dp_size: int, identity: str, shuffle: bool,
             vocab_size: int, description: str, tokenizer_path: str = "") -> DataSources:
    from titanlite.data.loader import TrainLoader, val_batches

    t, b = cfg.training, cfg.training.local_batch_size
    if cfg.validation.enable and len(val_set) < b * dp_size:
        raise ConfigError(f"the validation split has {len(val_set)} windows of {t.seq_len + 1} tokens, fewer than one "
                          f"global batch ({b} x {dp_size}); prepare with a smaller --val-every or set validation.enable=false")
    train = TrainLoader(train_set, batch=b, rank=dp_rank, world=dp_size, seed=t.seed, shuffle=shuffle,
                        data_cfg=cfg.data, identity={"dataset": identity, "seq_len": t.seq_len, "seed": t.seed,
                                                     "shuffle": shuffle})
    return DataSources(train, lambda: val_batches(val_set, b, dp_rank, dp_size), vocab_size, description, tokenizer_path)


def _synthetic(cfg, dp_rank: int, dp_size: int) -> DataSources:
    from titanlite.data.loader import SyntheticWindows
    from titanlite.models import get_model_args

    vocab = cfg.model.vocab_size or get_model_args(cfg.model.name, cfg.model.flavor).vocab_size
    t = cfg.training
    val_windows = t.local_batch_size * dp_size * cfg.validation.steps
    return _sources(cfg, SyntheticWindows(vocab, t.seq_len, t.seed), SyntheticWindows(vocab, t.seq_len, t.seed + 1, val_windows),
                    dp_rank, dp_size, f"synthetic-{vocab}", False, vocab, "synthetic uniform random tokens")


def _prepared_folder(cfg, folder, dp_rank: int, dp_size: int, name: str) -> DataSources:
    from titanlite.data.loader import ShardWindows
    from titanlite.data.shards import read_meta

    meta = read_meta(folder)
    sl = cfg.training.seq_len
    train, val = ShardWindows(folder, "train", sl, meta), ShardWindows(folder, "val", sl, meta)
    sp = meta["splits"]
    identity = f"{name}:{meta['tokenizer']['sha256'][:16]}:{sp['train']['tokens']}:{sp['val']['tokens']}"
    desc = (f"{name} ({sp['train']['tokens']:,} train / {sp['val']['tokens']:,} val tokens, {len(train):,} windows, "
            f"vocab {meta['vocab_size']:,}, {folder})")
    return _sources(cfg, train, val, dp_rank, dp_size, identity, cfg.data.shuffle, meta["vocab_size"], desc,
                    str(Path(folder) / meta["tokenizer"]["file"]))


def _prepared(cfg, dp_rank: int, dp_size: int) -> DataSources:
    if not cfg.training.dataset_path:
        raise ConfigError("training.dataset=prepared needs training.dataset_path (a folder made by "
                          "python -m titanlite.data.prepare)")
    return _prepared_folder(cfg, cfg.training.dataset_path, dp_rank, dp_size, "prepared")


def _python_stdlib(cfg, dp_rank: int, dp_size: int) -> DataSources:
    from titanlite.data.stdlib_corpus import prepare_stdlib
    from titanlite.models import get_model_args

    vocab = cfg.model.vocab_size or get_model_args(cfg.model.name, cfg.model.flavor).vocab_size
    folder = prepare_stdlib(min(vocab, 2**16))  # the corpus cannot fill more; uint16 shards
    return _prepared_folder(cfg, folder, dp_rank, dp_size, "python_stdlib")


DATASETS: dict[str, Callable[..., DataSources]] = {
    "synthetic": _synthetic, "python_stdlib": _python_stdlib, "prepared": _prepared}


def build_data(cfg, dp_rank: int, dp_size: int) -> DataSources:
    name = cfg.training.dataset
    if name not in DATASETS:
        raise ConfigError(f"training.dataset must be one of {', '.join(DATASETS)}; got '{name}'")
    if cfg.training.dataset_path and name != "prepared":
        raise ConfigError(f"training.dataset_path is read only with training.dataset=prepared (got dataset '{name}')")
    return DATASETS[name](cfg, dp_rank, dp_size)

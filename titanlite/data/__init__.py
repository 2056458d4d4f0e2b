"""Datasets by name. Each builder returns train and validation sources for one data-parallel rank.

A builder takes (cfg, dp_rank, dp_size) and returns a `DataSources`. Add one by adding to DATASETS.
The sharding, ordering and resume guarantees are in titanlite/data/loader.py; docs/data.md says
how to prepare a corpus. Importing this package does not import torch (the prepare CLI stays fast).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from titanlite.config import ConfigError

logger = logging.getLogger("titanlite")

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
    from titanlite.data.shards import again, read_meta, verify_shards

    # python_stdlib is prepared on first use, so a damaged copy is simply deleted
    remedy = f"delete {folder}; it is prepared again on next use" if name == "python_stdlib" else ""
    meta = read_meta(folder, remedy)
    verify_shards(folder, meta, remedy or again(folder, meta), note=dp_rank == 0)
    sl = cfg.training.seq_len
    if (note := _check_windows(cfg, meta, dp_size, name)) and dp_rank == 0:
        logger.info(note)
    train, val = ShardWindows(folder, "train", sl, meta), ShardWindows(folder, "val", sl, meta)
    sp = meta["splits"]
    identity = f"{name}:{meta['tokenizer']['sha256'][:16]}:{sp['train']['tokens']}:{sp['val']['tokens']}"
    desc = (f"{name} ({sp['train']['tokens']:,} train / {sp['val']['tokens']:,} val tokens, {len(train):,} windows, "
            f"vocab {meta['vocab_size']:,}, {folder})")
    return _sources(cfg, train, val, dp_rank, dp_size, identity, cfg.data.shuffle, meta["vocab_size"], desc,
                    str(Path(folder) / meta["tokenizer"]["file"]))


def tokens_for(windows: int, seq_len: int, shard_tokens: int) -> int:
    """Tokens a split needs to hold `windows` windows when written in shards of `shard_tokens`."""
    per_shard = (shard_tokens - 1) // seq_len
    if per_shard < 1:
        return 2**62  # no window fits in a shard
    full, rest = divmod(windows, per_shard)
    return full * shard_tokens + (rest * seq_len + 1 if rest else 0)


def _largest_seq_len(shard_tokens: list[int], windows: int) -> int:
    """The largest seq_len at which shards of these sizes hold `windows` windows (0 if none)."""
    from titanlite.data.shards import windows_in

    lo, hi = 0, max(shard_tokens, default=1)  # windows_in(., lo) >= windows, windows_in(., hi) < windows
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if windows_in(shard_tokens, mid) >= windows else (lo, mid)
    return lo


def _val_every_for(meta: dict, need_tokens: int) -> int:
    """The largest --val-every whose validation split would hold `need_tokens` tokens: exact when the
    split is the corpus' tail (fewer documents than --val-every), by token share for whole documents."""
    total = sum(meta["splits"][s]["tokens"] for s in ("train", "val"))
    docs, now = meta.get("documents", 1), meta.get("val_every", 0)
    n = total // need_tokens
    if n <= docs:  # whole documents: floor(docs / n) of them, each docs/total tokens on average
        n = min(n, docs // -(-need_tokens * docs // total))
    return min(n, now - 1) if now else n


def _check_windows(cfg, meta: dict, dp_size: int, name: str) -> str:
    """Both splits hold enough windows for this run, or one line that says what to change, with numbers.
    A validation split with fewer windows than a global batch validates on those: returned is the
    line that says so (empty otherwise)."""
    from titanlite.data.shards import windows_in

    t, b = cfg.training, cfg.training.local_batch_size
    sizes = {s: [sh["tokens"] for sh in meta["splits"][s]["shards"]] for s in ("train", "val")}
    need_val = b * dp_size if cfg.validation.enable else 0
    have = {s: windows_in(sizes[s], t.seq_len) for s in sizes}
    if have["train"] >= 1 and (have["val"] >= 1 or not need_val):
        if have["val"] >= need_val:
            return ""
        return (f"validation: the split has {have['val']} windows of {t.seq_len + 1} tokens, fewer than one global "
                f"batch ({b} x {dp_size}): each validation reads those {have['val']}")
    if have["train"] < 1:
        fit_train = _largest_seq_len(sizes["train"], 1)
        fit_val = _largest_seq_len(sizes["val"], 1) if need_val else fit_train
        if fit_train < 1:
            advice = "prepare more text"
        elif fit_val < 1:
            advice = f"lower training.seq_len to {fit_train} or less and set validation.enable=false"
        else:
            advice = f"lower training.seq_len to {min(fit_train, fit_val)} or less"
        longest = max(sizes["train"], default=0)
        if longest == meta.get("shard_tokens"):  # full shards: they are what is too short
            advice += f", or prepare the dataset again with --shard-tokens {t.seq_len + 1} or more"
        raise ConfigError(f"the train split has no window of training.seq_len + 1 = {t.seq_len + 1} tokens (its "
                          f"largest shard holds {longest:,}); {advice}")
    what = f"the validation split has no window of training.seq_len + 1 = {t.seq_len + 1} tokens"
    off = "set validation.enable=false"
    if name == "python_stdlib":  # a fixed corpus: only the run can change
        fit = _largest_seq_len(sizes["val"], 1)
        raise ConfigError(f"{what}; {off}" + (f", or lower training.seq_len to {fit} or less" if fit else ""))
    n = _val_every_for(meta, tokens_for(need_val, t.seq_len, meta.get("shard_tokens", 2**62)))
    if n < 2:
        raise ConfigError(f"{what}, and the corpus is too small for one validation batch beside training; {off}")
    now = meta.get("val_every", 0)
    raise ConfigError(f"{what}; prepare the dataset again with --val-every {n} (it was {now}), or {off}")


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

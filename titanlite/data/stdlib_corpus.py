"""The `python_stdlib` dataset: the running interpreter's own standard-library .py files.

Real text on any machine, nothing fetched, nothing copied into the repo. On first use a byte-level
BPE tokenizer is trained on it with `tokenizers` and the token stream is cached under
~/.cache/titanlite (TITANLITE_CACHE overrides); later runs load the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from pathlib import Path

import numpy as np
import torch

MAX_BYTES = 8 * 1024 * 1024  # enough text for the debug model; keeps first-use under ~20 s on 2 cores
VAL_EVERY = 20  # every 20th file (sorted order) is validation


def cache_root() -> Path:
    return Path(os.environ.get("TITANLITE_CACHE", Path.home() / ".cache" / "titanlite"))


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3"}
    files = sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))
    out, total = [], 0
    for p in files:
        size = p.stat().st_size
        if total + size > MAX_BYTES:
            break
        out.append(p)
        total += size
    return out


def _read(p: Path) -> str:
    return p.read_text(encoding="utf-8", errors="replace")


def prepare_stdlib(vocab_size: int) -> tuple[Path, np.ndarray, np.ndarray]:
    """Tokenizer path, train tokens and validation tokens (uint16), built once and cached."""
    files = stdlib_files()
    key = hashlib.sha1(("\n".join(str(p) for p in files) + f"|{vocab_size}|v1").encode()).hexdigest()[:12]
    folder = cache_root() / f"python_stdlib-{key}"
    tok_path, train_path, val_path = folder / "tokenizer.json", folder / "train.npy", folder / "val.npy"
    if not (tok_path.exists() and train_path.exists() and val_path.exists()):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        folder.mkdir(parents=True, exist_ok=True)
        texts = [_read(p) for p in files]
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator(texts, trainer=trainer)
        eos = tok.token_to_id("<|endoftext|>")
        encoded = tok.encode_batch(texts)
        splits: dict[bool, list[int]] = {True: [], False: []}
        for i, enc in enumerate(encoded):
            splits[i % VAL_EVERY == VAL_EVERY - 1].extend(enc.ids + [eos])
        # Write to temporary names and rename, so a killed first run never leaves a half cache.
        for path, ids in ((train_path, splits[False]), (val_path, splits[True])):
            tmp = path.with_suffix(".tmp.npy")
            np.save(tmp, np.asarray(ids, dtype=np.uint16))
            os.replace(tmp, path)
        tmp = folder / "tokenizer.tmp.json"
        tok.save(str(tmp))
        os.replace(tmp, tok_path)
        (folder / "meta.json").write_text(json.dumps({"files": len(files), "vocab_size": vocab_size}))
    return tok_path, np.load(train_path), np.load(val_path)


class PackedWindows:
    """Non-overlapping windows of seq_len + 1 tokens over a token array, shuffled per epoch by seed.

    Rank r of d takes every d-th window of the epoch's permutation: no overlap, and together the
    ranks cover the epoch (up to d - 1 windows dropped so every rank has the same count).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, rank: int, world: int,
                 shuffle: bool = True):
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.seed, self.rank, self.world, self.shuffle = seed, rank, world, shuffle
        n_windows = (len(tokens) - 1) // seq_len
        self.per_rank = n_windows // world
        if self.per_rank < batch_size:
            raise ValueError(f"dataset too small: {n_windows} windows of {seq_len + 1} tokens for "
                             f"{world} ranks x batch {batch_size}")
        self.n_windows, self.epoch, self.pos = n_windows, 0, 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> np.ndarray:
        perm = (np.random.default_rng([self.seed, self.epoch]).permutation(self.n_windows) if self.shuffle
                else np.arange(self.n_windows))
        return perm[: self.per_rank * self.world][self.rank :: self.world]

    def __iter__(self):
        return self

    def __next__(self):
        rows = []
        for _ in range(self.batch_size):
            if self.pos >= len(self._order):
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._epoch_order()
            start = int(self._order[self.pos]) * self.seq_len
            rows.append(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
            self.pos += 1
        window = torch.from_numpy(np.stack(rows))
        return window[:, :-1], window[:, 1:]

    def state_dict(self):
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state):
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._order = self._epoch_order()


def build_stdlib_sources(cfg, dp_rank: int, dp_size: int):
    from titanlite.data import DataSources
    from titanlite.models import get_model_args

    vocab = cfg.model.vocab_size or get_model_args(cfg.model.name, cfg.model.flavor).vocab_size
    vocab = min(vocab, 65535)  # uint16 cache
    tok_path, train, val = prepare_stdlib(vocab)
    bs, sl, seed = cfg.training.local_batch_size, cfg.training.seq_len, cfg.training.seed
    return DataSources(
        train=PackedWindows(train, sl, bs, seed, dp_rank, dp_size),
        make_val=lambda: PackedWindows(val, sl, bs, seed, dp_rank, dp_size, shuffle=False),
        vocab_size=vocab,
        description=f"python_stdlib ({len(train):,} train / {len(val):,} val tokens, tokenizer {tok_path})",
    )

"""The prepared-dataset format: fixed-size token shards plus one metadata JSON.

A prepared folder holds `meta.json`, `tokenizer.json` and `<split>_<index>.bin` files of raw
little-endian uint16 (vocab <= 65536) or uint32 tokens, documents separated by the EOS token.
`meta.json` is the only entry point: a shard is read only if it is listed there with its exact size.

Writers never touch the output folder until the end: everything goes into a hidden staging folder
next to it (`.NAME.partial-PID`) that is renamed into place after `meta.json` is written. A killed
preparation therefore leaves either no folder or the previous complete one, never half a dataset.
This module imports no torch, so `python -m titanlite.data.prepare` starts quickly.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from titanlite.config import ConfigError

FORMAT, VERSION = "titanlite-token-shards", 1
SPLITS = ("train", "val")


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ShardWriter:
    """Appends token arrays per split into fixed-size shards inside a staging folder.

    Use as a context manager: leaving the block with an exception removes the staging folder;
    `commit(meta)` writes meta.json and moves the staging folder to `output`.
    """

    def __init__(self, output: str | Path, vocab_size: int, shard_tokens: int, overwrite: bool = False):
        self.output = Path(output)
        self.dtype = dtype_for_vocab(vocab_size)
        self.shard_tokens = shard_tokens
        self.overwrite = overwrite
        self._check_output()
        self.staging = self.output.parent / f".{self.output.name}.partial-{os.getpid()}"
        try:
            self.output.parent.mkdir(parents=True, exist_ok=True)
            self._remove_stale_staging()
            if self.staging.exists():
                shutil.rmtree(self.staging)
            self.staging.mkdir()
        except FileExistsError as e:  # a file where a parent folder should be
            raise ConfigError(f"cannot write the output folder {self.output}: {e.filename} is a file") from None
        except OSError as e:
            raise ConfigError(f"cannot write the output folder {self.output}: {e.strerror or e}") from None
        self.shards: dict[str, list[dict]] = {s: [] for s in SPLITS}
        self.tokens = {s: 0 for s in SPLITS}
        self._fh: dict[str, object] = {}
        self._fill = {s: 0 for s in SPLITS}

    def _check_output(self) -> None:
        out = self.output
        if out.exists() and not out.is_dir():
            raise ConfigError(f"output {out} exists and is not a folder")
        if out.is_dir() and any(out.iterdir()):
            if not (out / "meta.json").exists():
                raise ConfigError(f"output folder {out} is not empty and holds no prepared dataset; choose a new folder")
            if not self.overwrite:
                raise ConfigError(f"output folder {out} already holds a prepared dataset; pass --overwrite to replace it")

    def _remove_stale_staging(self) -> None:
        """Staging folders of killed preparations (their process is gone) are garbage."""
        for p in self.output.parent.glob(f".{self.output.name}.partial-*"):
            pid = p.name.rsplit("-", 1)[-1]
            if pid.isdigit() and not _pid_alive(int(pid)):
                shutil.rmtree(p, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self._close_all()
        if exc_type is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
        return False

    def add(self, split: str, ids: np.ndarray) -> None:
        """Append tokens to `split`, opening a new shard whenever the current one is full."""
        ids = np.asarray(ids)
        if len(ids) and ids.max() > np.iinfo(self.dtype).max:  # would wrap around silently
            raise ValueError(f"token id {ids.max()} does not fit the dataset's {self.dtype.name}")
        ids = ids.astype(self.dtype, copy=False)
        while len(ids):
            if split not in self._fh:
                name = f"{split}_{len(self.shards[split]):05d}.bin"
                self.shards[split].append({"file": name, "tokens": 0})
                self._fh[split] = open(self.staging / name, "wb")
                self._fill[split] = 0
            room = self.shard_tokens - self._fill[split]
            part, ids = ids[:room], ids[room:]
            part.tofile(self._fh[split])
            self._fill[split] += len(part)
            self.shards[split][-1]["tokens"] += len(part)
            self.tokens[split] += len(part)
            if self._fill[split] == self.shard_tokens:
                self._fh.pop(split).close()

    def _close_all(self) -> None:
        for fh in self._fh.values():
            fh.close()
        self._fh.clear()

    def commit(self, meta: dict) -> dict:
        """Write meta.json and move the finished dataset into place; returns the full metadata."""
        self._close_all()
        meta = {"format": FORMAT, "version": VERSION, "dtype": self.dtype.name, **meta,
                "splits": {s: {**meta.get("splits", {}).get(s, {}), "tokens": self.tokens[s],
                               "shards": self.shards[s]} for s in SPLITS}}
        (self.staging / "meta.json").write_text(json.dumps(meta, indent=1))
        old = None
        if self.output.exists():  # an empty folder, or a dataset being replaced with --overwrite
            old = self.output.parent / f".{self.output.name}.old-{os.getpid()}"
            os.rename(self.output, old)
        os.rename(self.staging, self.output)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return meta


def read_meta(folder: str | Path) -> dict:
    """Load and check a prepared folder's metadata: every listed shard must exist with its exact size."""
    folder = Path(folder)
    path = folder / "meta.json"
    if not path.exists():
        why = "does not exist" if not folder.exists() else "has no meta.json (not prepared, or preparation did not finish)"
        raise ConfigError(f"dataset folder {folder} {why}; run python -m titanlite.data.prepare")
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is unreadable: {e}") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ConfigError(f"{path} is not a {FORMAT} v{VERSION} dataset; prepare it again")
    itemsize = np.dtype(meta["dtype"]).itemsize
    for split in SPLITS:
        for shard in meta["splits"][split]["shards"]:
            f = folder / shard["file"]
            size = f.stat().st_size if f.exists() else -1
            if size != shard["tokens"] * itemsize:
                raise ConfigError(f"shard {f} is missing or has the wrong size ({size} bytes, expected "
                                  f"{shard['tokens'] * itemsize}); prepare the dataset again")
    return meta

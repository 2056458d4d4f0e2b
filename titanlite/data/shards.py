"""The prepared-dataset format: fixed-size token shards plus one metadata JSON.

A prepared folder holds `meta.json`, `tokenizer.json` and `<split>_<index>.bin` files of raw
little-endian uint16 (vocab <= 65536) or uint32 tokens, documents separated by the EOS token.
`meta.json` is the only entry point: a shard is read only if it is listed there with its exact size.
Since format version 2 it also records each shard's CRC32 and largest token id, which
`verify_shards` checks before training (version 1 folders still load; see there).

Writers never touch the output folder until the end: everything goes into a hidden staging folder
next to it (`.NAME.partial-PID`) that is renamed into place after `meta.json` is written. A killed
preparation therefore leaves either no folder or the previous complete one, never half a dataset.
This module imports no torch, so `python -m titanlite.data.prepare` starts quickly.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
import zlib
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import numpy as np

from titanlite.config import ConfigError
from titanlite.output_folder import StagedFolder

FORMAT, VERSION = "titanlite-token-shards", 2
READABLE_VERSIONS = (1, 2)  # version 1: no CRC32 or largest id per shard
SPLITS = ("train", "val")
SCAN_CHUNK = 4 << 20  # bytes read per CRC32 update: large enough that zlib releases the GIL and threads overlap
SCAN_THREADS = 16  # shards read at once; beyond this the disk, not the CPU, is the limit
ANNOUNCE_BYTES = 1 << 30  # a verification of more than this says so before it starts
PROGRESS_EVERY_S = 30.0  # a line this often while a long verification runs

logger = logging.getLogger("titanlite")


def cache_root() -> Path:
    """Machine-local state of titanlite (the python_stdlib corpus, the verified-shards record)."""
    return Path(os.environ.get("TITANLITE_CACHE", Path.home() / ".cache" / "titanlite"))


def windows_in(shard_tokens: list[int], seq_len: int) -> int:
    """Windows of seq_len + 1 tokens (consecutive ones sharing a token) that shards of these sizes hold."""
    return sum(max(0, (t - 1) // seq_len) for t in shard_tokens)


def scan_shard(path: str | Path, dtype: np.dtype) -> tuple[int, int]:
    """CRC32 of a shard's bytes and its largest token id (-1 if empty), in one read."""
    crc, top = 0, -1
    buf = bytearray(SCAN_CHUNK - SCAN_CHUNK % dtype.itemsize)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
            top = max(top, int(np.frombuffer(view[:n], dtype=dtype).max()))
    return crc, top


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


class ShardWriter:
    """Appends token arrays per split into fixed-size shards inside a staging folder
    (titanlite.output_folder.StagedFolder: meta.json marks a prepared dataset).

    Use as a context manager: leaving the block with an exception removes the staging folder;
    `commit(meta)` writes meta.json and moves the staging folder to `output`.
    """

    def __init__(self, output: str | Path, vocab_size: int, shard_tokens: int, overwrite: bool = False):
        self.output = Path(output)
        self.dtype = dtype_for_vocab(vocab_size)
        self.shard_tokens = shard_tokens
        self._folder = StagedFolder(self.output, overwrite, "meta.json", "prepared dataset")
        self.staging = self._folder.path
        self.shards: dict[str, list[dict]] = {s: [] for s in SPLITS}
        self.tokens = {s: 0 for s in SPLITS}
        self._fh: dict[str, object] = {}
        self._fill = {s: 0 for s in SPLITS}

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self._close_all()
        return self._folder.__exit__(exc_type, exc, tb)

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

    def move_tail(self, src: str, dst: str, tokens: int) -> None:
        """Move the last `tokens` tokens of split `src` to the end of split `dst`, in order."""
        if not 0 < tokens < self.tokens[src]:
            raise ValueError(f"cannot move {tokens} of the {self.tokens[src]} tokens of {src}")
        self._close_all()
        shards, keep = self.shards[src], self.tokens[src] - tokens
        first, before = 0, 0
        while before + shards[first]["tokens"] <= keep:  # the shard in which the cut falls
            before += shards[first]["tokens"]
            first += 1
        cut = keep - before
        for j, shard in enumerate(shards[first:]):  # one shard in memory at a time
            offset = cut * self.dtype.itemsize if j == 0 else 0
            self.add(dst, np.fromfile(self.staging / shard["file"], dtype=self.dtype, offset=offset))
        self._close_all()
        for shard in shards[first + 1:]:
            os.remove(self.staging / shard["file"])
        del shards[first + 1:]
        if cut:
            os.truncate(self.staging / shards[first]["file"], cut * self.dtype.itemsize)
            shards[first]["tokens"] = cut
        else:
            os.remove(self.staging / shards.pop(first)["file"])
        self.tokens[src] = keep

    def commit(self, meta: dict) -> dict:
        """Write meta.json (with each shard's CRC32 and largest id) and move the finished dataset
        into place; returns the full metadata."""
        self._close_all()
        vocab = meta.get("vocab_size", np.iinfo(self.dtype).max + 1)
        for split in SPLITS:
            for shard in self.shards[split]:
                shard["crc32"], shard["max_id"] = scan_shard(self.staging / shard["file"], self.dtype)
                if shard["max_id"] >= vocab:
                    raise ValueError(f"{shard['file']} holds token id {shard['max_id']}, beyond vocab_size {vocab}")
        meta = {"format": FORMAT, "version": VERSION, "dtype": self.dtype.name, **meta,
                "splits": {s: {**meta.get("splits", {}).get(s, {}), "tokens": self.tokens[s],
                               "shards": self.shards[s]} for s in SPLITS}}
        (self.staging / "meta.json").write_text(json.dumps(meta, indent=1))
        self._folder.commit()
        return meta


def again(folder: str | Path, meta: dict | None = None) -> str:
    """The advice for a damaged prepared folder: the command that rebuilds it with the same tokenizer
    and, when `meta` is known, the same split (so a checkpoint's data stream still matches)."""
    if meta is None:
        how, opts = "from its corpus with the options used before", ""
    else:
        how = "from its corpus"
        opts = f" --val-every {meta.get('val_every', 0)}" + (f" --shard-tokens {meta['shard_tokens']}"
                                                            if "shard_tokens" in meta else "")
    return (f"prepare it again {how}: python -m titanlite.data.prepare --input CORPUS --output {folder} "
            f"--tokenizer {Path(folder) / 'tokenizer.json'}{opts} --overwrite")


def read_meta(folder: str | Path, remedy: str = "") -> dict:
    """Load and check a prepared folder's metadata: every listed shard must exist with its exact size.

    `remedy` is the advice that errors about a damaged folder end with (default: `again(folder)`).
    """
    folder = Path(folder)
    path = folder / "meta.json"
    if not path.exists():
        why = "does not exist" if not folder.exists() else "has no meta.json (not prepared, or preparation did not finish)"
        raise ConfigError(f"dataset folder {folder} {why}; run python -m titanlite.data.prepare")
    try:
        meta = json.loads(path.read_text())
        if not isinstance(meta, dict):
            raise ValueError(f"a JSON {type(meta).__name__}, not an object")
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is unreadable ({e}); {remedy or again(folder)}") from None
    if meta.get("format") != FORMAT or meta.get("version") not in READABLE_VERSIONS:
        raise ConfigError(f"{path} is not a {FORMAT} dataset of version {' or '.join(map(str, READABLE_VERSIONS))}; "
                          f"{remedy or again(folder)}")
    remedy = remedy or again(folder, meta)
    itemsize = np.dtype(meta["dtype"]).itemsize
    for split in SPLITS:
        for shard in meta["splits"][split]["shards"]:
            f = folder / shard["file"]
            size = f.stat().st_size if f.exists() else -1
            if size != shard["tokens"] * itemsize:
                raise ConfigError(f"shard {f} is missing or has the wrong size ({size} bytes, expected "
                                  f"{shard['tokens'] * itemsize}); {remedy}")
            if meta["version"] >= 2 and not {"crc32", "max_id"} <= shard.keys():
                raise ConfigError(f"{path} lists {shard['file']} without its crc32 and max_id; {remedy}")
    return meta


class VerifiedRecord:
    """What this machine has already read of which shard files: path -> file identity, CRC32, largest id.

    One JSON file per host under cache_root(), held under an exclusive lock while in use, so ranks
    of one host verify a dataset once between them (the others wait, then find it recorded). An
    entry counts only while the file keeps its device, inode, size, modification and change times;
    any write to the file changes them, and the change time cannot be set back. A record that
    cannot be written (read-only cache) only costs a new verification at the next start.
    """

    def __init__(self):
        self.path = cache_root() / f"verified-shards-{socket.gethostname()}.json"
        self.entries: dict[str, list[int]] = {}
        self._lock = None

    def __enter__(self):
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._lock = open(self.path.with_suffix(".lock"), "w")
        except OSError:
            return self
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info(f"data: waiting for another process on this machine that is verifying shards ({self.path})")
            fcntl.flock(self._lock, fcntl.LOCK_EX)
        try:
            self.entries = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.entries = {}
        return self

    def __exit__(self, *exc):
        if self._lock is not None:
            self._lock.close()  # releases the lock
        return False

    @staticmethod
    def identity(path: Path) -> list[int]:
        st = path.stat()
        return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]

    def get(self, path: Path) -> tuple[int, int] | None:
        """(CRC32, largest id) recorded for this very file, or None."""
        entry = self.entries.get(str(path))
        if entry is None or entry[:5] != self.identity(path):
            return None
        return entry[5], entry[6]

    def put(self, path: Path, identity: list[int], crc: int, top: int) -> None:
        """Record what was read from the file that had `identity` when the read began."""
        self.entries[str(path)] = [*identity, crc, top]

    def save(self) -> None:
        if self._lock is None:
            return
        self.entries = {p: e for p, e in self.entries.items() if os.path.exists(p)}  # forget deleted files
        tmp = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}")
        try:
            tmp.write_text(json.dumps(self.entries))
            os.replace(tmp, self.path)
        except OSError:
            tmp.unlink(missing_ok=True)


def verify_shards(folder: str | Path, meta: dict, remedy: str = "", log=logger.info, note: bool = True) -> None:
    """Refuse, before training, a shard whose bytes are not those prepared or that holds a token id
    beyond the dataset's vocabulary (the Trainer checks the model's vocabulary against that one).

    Version 2 records each shard's largest id, so out-of-vocabulary ids are refused at once. The
    bytes are checked by one pass over each shard (CRC32 and largest id together, in threads) the
    first time this machine sees the shard file (`VerifiedRecord`); later starts read only new or
    changed files. Version 1 folders have no CRC32: the same pass finds their largest ids, and a
    note (if `note`) says that their bytes are not verified.
    """
    folder = Path(folder).resolve()
    remedy = remedy or again(folder, meta)
    vocab, dtype = meta["vocab_size"], np.dtype(meta["dtype"])
    shards = [s for split in SPLITS for s in meta["splits"][split]["shards"]]

    def check_ids(shard: dict, top: int) -> None:
        if top >= vocab:
            raise ConfigError(f"shard {folder / shard['file']} holds token id {top}, beyond the dataset's vocabulary "
                              f"of {vocab} (its tokenizer's); {remedy}")

    for shard in shards:  # version 2: no read needed
        check_ids(shard, shard.get("max_id", -1))
    if meta["version"] < 2 and note:
        log(f"data: {folder} was prepared without checksums (format version 1): its token ids are checked, its "
            f"bytes are unverified. To add checksums, {remedy}")
    with VerifiedRecord() as record:
        found = {s["file"]: record.get(folder / s["file"]) for s in shards}
        todo = [s for s in shards if found[s["file"]] is None]
        if todo:
            found.update(_scan_all(folder, todo, dtype, record, log, remedy))
            record.save()
    for shard in shards:  # in listing order, so every rank names the same first bad shard
        crc, top = found[shard["file"]]
        if "crc32" in shard and crc != shard["crc32"]:
            raise ConfigError(f"shard {folder / shard['file']} is damaged: its CRC32 is {crc:08x}, meta.json "
                              f"records {shard['crc32']:08x}; {remedy}")
        check_ids(shard, top)


def scan_shards(paths: list[Path], dtype: np.dtype, threads: int = 0, log=None) -> list[tuple[int, int]]:
    """scan_shard of every path, in `threads` threads (0: one per CPU, at most SCAN_THREADS), in order;
    a line every PROGRESS_EVERY_S seconds if `log`. An unreadable file raises OSError."""
    sizes = [p.stat().st_size for p in paths]
    threads = threads or min(len(paths), os.cpu_count() or 1, SCAN_THREADS)
    out: list = [None] * len(paths)
    last, read = time.perf_counter(), 0
    with ThreadPoolExecutor(threads) as pool:
        futures = {pool.submit(scan_shard, p, dtype): i for i, p in enumerate(paths)}
        for fut in as_completed(futures):
            out[futures[fut]] = fut.result()
            read += sizes[futures[fut]]
            if log and time.perf_counter() - last > PROGRESS_EVERY_S:
                last = time.perf_counter()
                log(f"data: verified {read / 2**30:.2f} of {sum(sizes) / 2**30:.2f} GiB")
    return out


def _scan_all(folder: Path, todo: list[dict], dtype: np.dtype, record: VerifiedRecord, log,
              remedy: str) -> dict[str, tuple[int, int]]:
    """Read the shards in `todo` and record what they hold, with a line before (if long) and after."""
    total = sum(s["tokens"] for s in todo) * dtype.itemsize
    size = f"{len(todo)} shard file{'s' * (len(todo) > 1)} of {folder} ({total / 2**20:,.1f} MiB)"
    if total > ANNOUNCE_BYTES:
        log(f"data: verifying {size}: CRC32 and largest token id, once per machine")
    start = time.perf_counter()
    paths = [folder / s["file"] for s in todo]
    try:
        before = [record.identity(p) for p in paths]  # so that a write during the read shows next time
        found = scan_shards(paths, dtype, log=log)
    except OSError as e:
        raise ConfigError(f"cannot read shard {e.filename}: {e.strerror or e}; {remedy}") from None
    for path, ident, result in zip(paths, before, found):
        record.put(path, ident, *result)
    log(f"data: read {size} for CRC32 and largest token id in {time.perf_counter() - start:.1f} s "
        f"(recorded in {record.path})")
    return {s["file"]: result for s, result in zip(todo, found)}

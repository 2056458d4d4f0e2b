"""The `python_stdlib` dataset: the running interpreter's own standard-library .py files.

Real text on any machine, nothing fetched, nothing copied into the repo. On first use it goes
through the same path as `python -m titanlite.data.prepare --train-tokenizer` (each file read like
a .txt document, a byte-level BPE trained on them, shards + meta.json written) into
~/.cache/titanlite/python_stdlib-<key> (TITANLITE_CACHE overrides); later runs read the cache.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import sysconfig
from pathlib import Path

from titanlite.data.prepare import Skips, prepare_dataset, read_txt
from titanlite.data.shards import VERSION, cache_root

MAX_BYTES = 8 * 1024 * 1024  # enough text for the debug model, and a short first use on a small CPU
VAL_EVERY = 20  # every 20th file (sorted order) is validation

logger = logging.getLogger("titanlite")


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3"}
    found = []
    # the skipped folders are not walked at all (site-packages alone can hold ~100k files); symlinked
    # folders are listed but not entered, as Path.rglob does
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip]
        found += [Path(folder, n) for n in names if n.endswith(".py") and n not in skip]
    files = sorted(found)
    out, total = [], 0
    for p in files:
        size = p.stat().st_size
        if total + size > MAX_BYTES:
            break
        out.append(p)
        total += size
    return out


def prepare_stdlib(vocab_size: int) -> Path:
    """The prepared folder for this interpreter's stdlib and vocabulary, built once and cached.

    A file lock makes concurrent ranks (or test processes) build it once; the others wait and read it.
    """
    files = stdlib_files()
    text = "\n".join(str(p) for p in files) + f"|{vocab_size}|shards-v{VERSION}"
    key = hashlib.sha1(text.encode()).hexdigest()[:12]
    folder = cache_root() / f"python_stdlib-{key}"
    if (folder / "meta.json").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".python_stdlib-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "meta.json").exists():
            def pieces(skips: Skips):
                for p in files:
                    yield from read_txt(p, "text", skips)

            logger.info(f"python_stdlib: first use, preparing {len(files)} files into {folder}")
            prepare_dataset(pieces, folder, train_vocab=vocab_size, val_every=VAL_EVERY, workers=1,
                            source=f"python_stdlib: {len(files)} .py files of {sysconfig.get_paths()['stdlib']}",
                            log=logger.info)
    return folder

"""Tokenize a text corpus into packed token shards: `python -m titanlite.data.prepare --help`.

    python -m titanlite.data.prepare --input 'corpus/*.jsonl' --output data/corpus --tokenizer tokenizer.json
    python -m titanlite.data.prepare --input corpus/ --output data/corpus --train-tokenizer --vocab-size 32000

    python -m titanlite.data.prepare --hf-dataset saved/ --text-field content --output data/corpus --tokenizer tokenizer.json

Inputs: .txt (one document per file, read in line-aligned pieces of about 1 MB), .jsonl (one
document per line, in --text-field), .parquet (column --text-field; needs pyarrow: the parquet extra)
and a Hugging Face dataset (--hf-dataset: a save_to_disk folder or a name in the local hub cache,
column --text-field of split --hf-split, read a batch of rows at a time from its memory-mapped Arrow
files; needs datasets: the hf extra). Every
document is followed by the EOS token; every --val-every-th document goes to the validation split,
or, when the corpus has fewer documents than that (a single .txt), the last 1/val_every of its tokens,
raised to one default global batch of 2048-token windows where a tenth of the corpus holds them.
Output: see titanlite/data/shards.py. Bad input stops with one line and exit code 2 and leaves no
output; a bad jsonl/parquet record is skipped, counted and reported at the end.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
import time
from collections import deque
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from titanlite.config import ConfigError
from titanlite.errors import require
from titanlite.data.shards import ShardWriter
from titanlite.data.tokenizer import eos_id, file_sha256, load_tokenizer, train_bpe, vocab_size

Piece = tuple[str, bool]  # (text, whether it ends a document)

PIECE_CHARS = 1 << 20  # long .txt documents are tokenized in pieces of about this many characters
CHUNK_CHARS = 1 << 20  # characters sent to a tokenizer process per task
DEFAULT_SHARD_TOKENS = 1 << 27  # 256 MiB of uint16 per shard
DEFAULT_VAL_EVERY = 200  # 0.5% of documents
TAIL_SEQ_LEN = 2048  # a tail validation split holds a global batch of windows this long where the corpus allows
MISSING_FIELD_ABORT = 1000  # a file whose first this-many records all lack the field is an error, not skips


class Skips:
    """Counts of skipped records per reason, with the first place each happened."""

    def __init__(self):
        self.counts: dict[str, int] = {}
        self.first: dict[str, str] = {}

    def add(self, reason: str, where: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        self.first.setdefault(reason, where)

    def report(self) -> str:
        parts = [f"{n:,} {reason} (first at {self.first[reason]})" for reason, n in self.counts.items()]
        return ", ".join(parts)


# ----------------------------------------------------------------------------------------- readers
def read_txt(path: Path, field: str, skips: Skips) -> Iterator[Piece]:
    buf, n, emitted = [], 0, False
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"{path}:{lineno}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column "
                                  f"{e.start + 1}); re-encode the file as UTF-8") from None
            buf.append(line)
            n += len(line)
            if n >= PIECE_CHARS:
                yield "".join(buf), False
                buf, n, emitted = [], 0, True
    text = "".join(buf)
    if text or emitted:
        yield text, True
    else:
        skips.add("empty documents", str(path))


def read_jsonl(path: Path, field: str, skips: Skips) -> Iterator[Piece]:
    found = missing = 0
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            where = f"{path}:{lineno}"
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                skips.add("lines not valid UTF-8", where)
                continue
            except ValueError:
                skips.add("lines not valid JSON", where)
                continue
            if not isinstance(record, dict) or field not in record:
                has = ", ".join(list(record)[:8]) if isinstance(record, dict) else f"a JSON {type(record).__name__}"
                skips.add(f"records without field '{field}'", f"{where}, which has: {has}")
                missing += 1
                if missing >= MISSING_FIELD_ABORT and not found:
                    raise ConfigError(f"{path}: none of the first {missing} records has field '{field}' "
                                      f"(line {lineno} has: {has}); set --text-field")
                continue
            text = record[field]
            if not isinstance(text, str):
                skips.add(f"records whose '{field}' is not a string", where)
            elif not text:
                skips.add("empty documents", where)
            else:
                found += 1
                yield text, True


def read_parquet(path: Path, field: str, skips: Skips) -> Iterator[Piece]:
    pq = require("pyarrow.parquet", f"reading {path}")
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise ConfigError(f"{path}: not a readable parquet file ({str(e).splitlines()[0]})") from None
    names = pf.schema_arrow.names
    if field not in names:
        raise ConfigError(f"{path} has no column '{field}' (columns: {', '.join(names[:8])}); set --text-field")
    texts = (text for batch in pf.iter_batches(columns=[field], batch_size=4096) for text in batch.column(0).to_pylist())
    yield from column_documents(texts, field, str(path), skips)


def column_documents(texts: Iterator, field: str, where: str, skips: Skips) -> Iterator[Piece]:
    """The documents of a column of rows (`where` names it in the skips): null, non-string and empty rows skipped."""
    for row, text in enumerate(texts, 1):
        if not isinstance(text, str):
            skips.add(f"rows whose '{field}' is null or not a string", f"{where} row {row}")
        elif not text:
            skips.add("empty documents", f"{where} row {row}")
        else:
            yield text, True


READERS: dict[str, Callable[[Path, str, Skips], Iterator[Piece]]] = {
    ".txt": read_txt, ".jsonl": read_jsonl, ".parquet": read_parquet}


def open_hf_dataset(source: str, split: str, field: str):
    """Column `field` of the `split` of a Hugging Face dataset: a folder written by `save_to_disk` (a
    Dataset, or a DatasetDict holding `split`), else a name in the local hub cache (HF_DATASETS_OFFLINE=1
    keeps `datasets` from the network). Either way its Arrow files are memory-mapped, not read into memory."""
    datasets = require("datasets", f"--hf-dataset {source}")
    where = f"--hf-dataset {source}"
    if Path(source).is_dir():
        try:
            ds = datasets.load_from_disk(source)
        except Exception as e:
            raise ConfigError(f"{where}: not a folder written by save_to_disk ({str(e).splitlines()[0]})") from None
    else:
        try:
            ds = datasets.load_dataset(source, split=split)
        except Exception as e:
            raise ConfigError(f"{where}: no such folder, and no such dataset in the hub cache "
                              f"({type(e).__name__}: {(str(e).splitlines() or [''])[0]})") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ConfigError(f"{where} has no split '{split}' (splits: {', '.join(ds)}); set --hf-split")
        ds = ds[split]
    if field not in ds.column_names:
        raise ConfigError(f"{where} has no column '{field}' (columns: {', '.join(ds.column_names[:8])}); "
                          f"set --text-field")
    return ds.select_columns([field])


def hf_pieces(source: str, split: str, field: str) -> Callable[[Skips], Iterator[Piece]]:
    """The documents of a Hugging Face dataset's column `field`, read a batch of rows at a time."""
    def pieces(skips: Skips) -> Iterator[Piece]:
        texts = (text for batch in open_hf_dataset(source, split, field).iter(batch_size=1024) for text in batch[field])
        yield from column_documents(texts, field, source, skips)
    return pieces


def resolve_inputs(specs: list[str]) -> list[Path]:
    """Files named by paths, folders (searched recursively) or globs, sorted, each once."""
    kinds = ", ".join(READERS)
    out: list[Path] = []
    for spec in specs:
        p = Path(spec)
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.suffix in READERS and f.is_file())
            if not files:
                raise ConfigError(f"--input {spec}: the folder holds no {kinds} files")
        elif p.exists():
            if p.suffix not in READERS:
                raise ConfigError(f"--input {spec}: unsupported file type '{p.suffix}' (supported: {kinds})")
            files = [p]
        else:
            files = sorted(Path(m) for m in glob.glob(spec, recursive=True) if Path(m).suffix in READERS)
            if not files:
                raise ConfigError(f"--input {spec}: no such file" if not glob.has_magic(spec)
                                  else f"--input {spec}: matches no {kinds} file")
        out += [f for f in files if f not in out]
    return out


def file_pieces(paths: list[Path], field: str = "text") -> Callable[[Skips], Iterator[Piece]]:
    def pieces(skips: Skips) -> Iterator[Piece]:
        for path in paths:
            yield from READERS[path.suffix](path, field, skips)
    return pieces


def joined(*sources: Callable[[Skips], Iterator[Piece]]) -> Callable[[Skips], Iterator[Piece]]:
    """The documents of every source, one source after the other."""
    def pieces(skips: Skips) -> Iterator[Piece]:
        for source in sources:
            yield from source(skips)
    return pieces


# ----------------------------------------------------------------------------------------- tokenizing
_TOK = None


def _init_worker(tokenizer_file: str, threads: bool) -> None:
    global _TOK
    if not threads:  # one tokenizer thread per process: the processes are the parallelism
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _TOK = load_tokenizer(tokenizer_file)


def _encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of each text, concatenated, and their lengths."""
    encs = _TOK.encode_batch_fast(texts, add_special_tokens=False)
    lengths = np.fromiter((len(e.ids) for e in encs), dtype=np.int64, count=len(encs))
    flat = np.fromiter((i for e in encs for i in e.ids), dtype=np.uint32, count=int(lengths.sum()))
    return flat, lengths


class _Done:
    """Stands in for an AsyncResult when encoding in-process."""

    def __init__(self, value):
        self.value = value

    def get(self):
        return self.value


def _chunks(pieces: Iterator[Piece]) -> Iterator[list[Piece]]:
    buf, n = [], 0
    for piece in pieces:
        buf.append(piece)
        n += len(piece[0])
        if n >= CHUNK_CHARS or len(buf) >= 4096:
            yield buf
            buf, n = [], 0
    if buf:
        yield buf


class _Packer:
    """Appends EOS after each document and routes documents to the train or validation split."""

    def __init__(self, writer: ShardWriter, eos: int, val_every: int):
        self.writer, self.eos, self.val_every = writer, eos, val_every
        self.doc = 0  # index of the document the next piece belongs to
        self.documents = {"train": 0, "val": 0}

    def add(self, chunk: list[Piece], flat: np.ndarray, lengths: np.ndarray) -> int:
        ends = np.fromiter((end for _, end in chunk), dtype=bool, count=len(chunk))
        doc_of_piece = self.doc + np.concatenate([[0], np.cumsum(ends)[:-1]])
        self.doc += int(ends.sum())
        is_val = (doc_of_piece % self.val_every == self.val_every - 1) if self.val_every else np.zeros(len(chunk), bool)
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        tokens = np.insert(flat, bounds[1:][ends], self.eos)
        bounds = bounds + np.concatenate([[0], np.cumsum(ends)])  # piece j is tokens[bounds[j]:bounds[j+1]]
        cuts = [0, *(np.flatnonzero(np.diff(is_val)) + 1).tolist(), len(chunk)]
        for a, b in zip(cuts[:-1], cuts[1:]):  # runs of consecutive pieces in the same split
            self.writer.add("val" if is_val[a] else "train", tokens[bounds[a]:bounds[b]])
        self.documents["val"] += int((ends & is_val).sum())
        self.documents["train"] += int((ends & ~is_val).sum())
        return len(tokens)


def _tokenize(pieces: Iterator[Piece], tokenizer_file: Path, packer: _Packer, workers: int,
              progress: bool | None) -> None:
    from tqdm import tqdm

    bar = tqdm(unit="tok", unit_scale=True, desc="tokenizing", disable=None if progress is None else not progress,
               mininterval=0.5, file=sys.stderr)
    pool = None
    if workers > 1:
        import multiprocessing as mp

        # spawn, not fork: the parent may hold tokenizer threads (after training) or a torch runtime.
        pool = mp.get_context("spawn").Pool(workers, _init_worker, (str(tokenizer_file), False))
        submit = lambda texts: pool.apply_async(_encode, (texts,))
    else:
        _init_worker(str(tokenizer_file), True)
        submit = lambda texts: _Done(_encode(texts))
    pending: deque = deque()  # in submission order, so the output does not depend on `workers`

    def drain_one():
        chunk, result = pending.popleft()
        bar.update(packer.add(chunk, *result.get()))

    try:
        for chunk in _chunks(pieces):
            pending.append((chunk, submit([t for t, _ in chunk])))
            if len(pending) >= (2 * workers if pool else 1):  # keep each process busy, bound memory
                drain_one()
        while pending:
            drain_one()
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()


# ----------------------------------------------------------------------------------------- driver
def prepare_dataset(pieces: Callable[[Skips], Iterator[Piece]], output: str | Path, *, tokenizer: str = "",
                    train_vocab: int = 0, eos_token: str = "", val_every: int = DEFAULT_VAL_EVERY,
                    shard_tokens: int = DEFAULT_SHARD_TOKENS, workers: int = 1, overwrite: bool = False,
                    progress: bool | None = None, tokenizer_train_chars: int = 10**9, source: str = "",
                    log: Callable[[str], None] = print) -> dict:
    """Tokenize the documents from `pieces(skips)` into a prepared folder; returns its metadata.

    `pieces` is called once more to train a tokenizer when `train_vocab` is set. Either way the
    tokenizer is copied into the output, so a prepared folder is self-contained.
    """
    if not train_vocab:
        if not tokenizer:
            raise ConfigError("pass --tokenizer FILE, or --train-tokenizer --vocab-size N")
        vocab = vocab_size(load_tokenizer(tokenizer))
    else:
        vocab = train_vocab
    start = time.perf_counter()
    with ShardWriter(output, vocab, shard_tokens, overwrite) as writer:
        tok_file = writer.staging / "tokenizer.json"
        if train_vocab:
            log(f"training a byte-level BPE tokenizer with {train_vocab:,} tokens")
            train_bpe(_capped_texts(pieces(Skips()), tokenizer_train_chars), train_vocab, tok_file)
        else:
            shutil.copyfile(tokenizer, tok_file)
        tok = load_tokenizer(tok_file)
        eos = eos_id(tok, eos_token)
        skips = Skips()
        packer = _Packer(writer, eos, val_every)
        _tokenize(pieces(skips), tok_file, packer, workers, progress)
        if packer.doc == 0:
            raise ConfigError("the input holds no documents" + (f": skipped {skips.report()}" if skips.counts else ""))
        val_from = _val_split(writer, packer, val_every, log)
        meta = writer.commit({
            "vocab_size": vocab_size(tok), "eos_id": eos,
            "tokenizer": {"file": "tokenizer.json", "sha256": file_sha256(tok_file)},
            "val_every": val_every, "val_from": val_from, "shard_tokens": shard_tokens, "source": source,
            "documents": packer.doc, "skipped": skips.counts,
            "splits": {s: {"documents": n} for s, n in packer.documents.items()},
        })
    secs = time.perf_counter() - start
    total = sum(meta["splits"][s]["tokens"] for s in meta["splits"])
    log(f"prepared {packer.doc:,} document{'s' * (packer.doc != 1)}, {total:,} tokens (train {meta['splits']['train']['tokens']:,} / "
        f"val {meta['splits']['val']['tokens']:,}) as {meta['dtype']} in {secs:.1f} s "
        f"({total / secs:,.0f} tokens/s) -> {output}")
    if skips.counts:
        log(f"skipped {skips.report()}")
    return meta


def tail_tokens(total: int, val_every: int, shard_tokens: int) -> int:
    """Tokens of a validation split cut from the end of a corpus with fewer documents than val_every:
    1/val_every of them, raised to one default global batch of windows at seq_len 2048 (training's
    default local batch on one rank) where a tenth of the corpus holds that, else to that tenth."""
    from titanlite.config.job_config import Training
    from titanlite.data import tokens_for

    batch = tokens_for(Training.local_batch_size, TAIL_SEQ_LEN, shard_tokens)
    return max(total // val_every, min(total // 10, batch))


def _val_split(writer: ShardWriter, packer: _Packer, val_every: int, log: Callable[[str], None]) -> str:
    """How the validation split was made: "documents", "tail" (fewer documents than --val-every: the
    last tokens, `tail_tokens` of them, moved from the train split) or "none" (--val-every 0)."""
    if not val_every:
        return "none"
    if packer.documents["val"]:
        return "documents"
    total = writer.tokens["train"]
    tail = tail_tokens(total, val_every, writer.shard_tokens)
    if tail:
        writer.move_tail("train", "val", tail)
    share = (f"1/{val_every} of them" if tail == total // val_every
             else f"{tail / total:.1%} of them: more than 1/{val_every}, for a validation batch")
    log(f"validation split: the corpus has {packer.doc:,} document{'s' * (packer.doc != 1)}, fewer than --val-every "
        f"{val_every}, so it is the last {tail:,} tokens ({share}) instead of whole documents")
    return "tail"


def _capped_texts(pieces: Iterator[Piece], max_chars: int) -> Iterator[str]:
    n = 0
    for text, _ in pieces:
        yield text
        n += len(text)
        if n >= max_chars:
            return


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m titanlite.data.prepare",
                                 description="Tokenize text into packed token shards for titanlite.")
    ap.add_argument("--input", action="append", default=[], metavar="PATH_OR_GLOB",
                    help="a .txt/.jsonl/.parquet file, a folder, or a glob (quote it); repeatable")
    ap.add_argument("--hf-dataset", default="", metavar="FOLDER_OR_NAME",
                    help="a Hugging Face dataset (read after the --input files): a folder written by save_to_disk, "
                         "or a dataset's name in the local hub cache; its --text-field column is read a batch of "
                         "rows at a time (needs datasets: the hf extra)")
    ap.add_argument("--hf-split", default="train", help="--hf-dataset: the split to read")
    ap.add_argument("--output", required=True, help="folder to create (must be new, empty, or --overwrite)")
    ap.add_argument("--tokenizer", default="", help="tokenizer.json to use (with --train-tokenizer: also save the trained one here)")
    ap.add_argument("--train-tokenizer", action="store_true", help="train a byte-level BPE on the input first")
    ap.add_argument("--vocab-size", type=int, default=0, help="vocabulary of the trained tokenizer")
    ap.add_argument("--tokenizer-train-chars", type=int, default=10**9, help="characters of input to train the tokenizer on")
    ap.add_argument("--text-field", default="text", help="jsonl field / parquet or Hugging Face dataset column "
                                                          "holding the text")
    ap.add_argument("--eos-token", default="", help="end-of-document token (default: the first of <|endoftext|>, </s>, ...)")
    ap.add_argument("--val-every", type=int, default=DEFAULT_VAL_EVERY,
                    help="every N-th document goes to the validation split, or, when there are fewer than N "
                         "documents, the last 1/N of the tokens (at least one default global batch of 2048-token "
                         "windows, at most a tenth of the corpus) (N >= 2; 0 = no validation split)")
    ap.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard file")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizer processes")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing prepared dataset in --output")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.train_tokenizer and not 258 <= args.vocab_size < 2**32:
        raise ConfigError(f"--train-tokenizer needs --vocab-size N with N >= 258 (256 bytes + EOS + merges); got {args.vocab_size}")
    if not args.train_tokenizer and args.vocab_size:
        raise ConfigError("--vocab-size applies only with --train-tokenizer")
    for name in ("shard_tokens", "workers"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
    if args.val_every < 0 or args.val_every == 1:
        raise ConfigError(f"--val-every must be 0 (no validation split) or at least 2 (1 would leave nothing to train "
                          f"on); got {args.val_every}")
    if not args.input and not args.hf_dataset:
        raise ConfigError("pass --input PATH_OR_GLOB (files) or --hf-dataset FOLDER_OR_NAME (a Hugging Face dataset)")
    paths = resolve_inputs(args.input) if args.input else []
    pieces, source = file_pieces(paths, args.text_field), f"{len(paths)} files from {', '.join(args.input)}"
    if args.hf_dataset:
        open_hf_dataset(args.hf_dataset, args.hf_split, args.text_field)  # a bad one is said before anything is written
        pieces = joined(pieces, hf_pieces(args.hf_dataset, args.hf_split, args.text_field))
        hf = f"Hugging Face dataset {args.hf_dataset} (split {args.hf_split})"
        source = f"{source} and {hf}" if paths else hf
    meta = prepare_dataset(
        pieces, args.output, tokenizer="" if args.train_tokenizer else args.tokenizer,
        train_vocab=args.vocab_size if args.train_tokenizer else 0, eos_token=args.eos_token,
        val_every=args.val_every, shard_tokens=args.shard_tokens, workers=args.workers, overwrite=args.overwrite,
        progress=True, tokenizer_train_chars=args.tokenizer_train_chars,
        source=f"{source} (field '{args.text_field}')")
    if args.train_tokenizer and args.tokenizer:
        shutil.copyfile(Path(args.output) / "tokenizer.json", args.tokenizer)
    return meta


if __name__ == "__main__":
    try:
        main()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("error: interrupted; no output was written", file=sys.stderr)
        sys.exit(130)

"""Data pipeline throughput: `prepare` tokens/s, and loader tokens/s per process with 0 and 2 workers.

    python benchmarks/data_bench.py                       # ~30 MB of text in a temp folder
    python benchmarks/data_bench.py --workdir /tmp/dbench  # keep the prepared shards (for a training run)
    python benchmarks/data_bench.py --data-wait outputs/llama-1.36b/run_*.json   # data-wait share of a run
    python benchmarks/data_bench.py --verify-gib 8 --workdir /tmp/vbench   # start-up shard verification GB/s

The text is the interpreter's standard library (the python_stdlib corpus) repeated to --mb
megabytes, so every machine builds the same corpus without a download. The loader is measured at
LLaMA 1.36B shapes (local batch 4 x seq 2048, vocab 32000 -> uint16 shards) and compared with the
rate at which one H100 trains LLaMA 1.36B (H100_TOKENS_PER_SEC). Prints a table; asserts nothing.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import launch  # noqa: E402  (benchmarks/launch.py: the steady-state rule)

H100_TOKENS_PER_SEC = 55_000  # what one H100 trains LLaMA 1.36B at, bf16 + compile (docs/performance.md)


def write_corpus(path: Path, megabytes: float) -> int:
    """jsonl of stdlib files, repeated until `megabytes` of text; returns the byte count."""
    from titanlite.data.stdlib_corpus import stdlib_files

    texts = [t for p in stdlib_files() if (t := p.read_text(encoding="utf-8"))]
    target, written = int(megabytes * 2**20), 0
    with open(path, "w") as fh:
        while written < target:
            for t in texts:
                line = json.dumps({"text": t}) + "\n"
                fh.write(line)
                written += len(t.encode())
                if written >= target:
                    break
    return written


def loader_tokens_per_sec(folder: Path, workers: int, batches: int, batch: int, seq: int) -> float:
    from titanlite.config import load_config
    from titanlite.data import build_data

    cfg = load_config(["--training.dataset", "prepared", "--training.dataset_path", str(folder),
                       "--training.local_batch_size", str(batch), "--training.seq_len", str(seq),
                       f"--data.num_workers={workers}", "--validation.enable=false"])
    it = build_data(cfg, 0, 1).train
    for _ in range(5):  # worker start-up and first memory-mapping are not steady state
        next(it)
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
    return batches * batch * seq / (time.perf_counter() - start)


def data_wait(paths: list[str], skip: int) -> None:
    """Data-wait share of step time in run logs, over their steady state (launch.steady)."""
    for path in paths:
        its = launch.steady(json.load(open(path))["training_iterations"], skip)
        data = [r["data_ms"] for e in its if e.get("breakdown") for r in e["breakdown"]["ranks"]]
        step = [r["step_ms"] for e in its if e.get("breakdown") for r in e["breakdown"]["ranks"]]
        if not step:
            print(f"{path}: no breakdown entries in the steady state")
            continue
        print(f"{path}: data wait {sum(data) / len(data):.2f} ms of {sum(step) / len(step):.1f} ms per step "
              f"= {100 * sum(data) / sum(step):.2f}% (max over ranks and log steps {max(d / s for d, s in zip(data, step)) * 100:.2f}%)")


def verify_throughput(work: Path, gib: float, cold: bool) -> None:
    """GB/s of the start-up shard verification (CRC32 + largest id) over `gib` GiB of uint16 shards of
    the default size, per thread count, from the page cache and, with `cold` (root), from disk."""
    import numpy as np

    from titanlite.data.prepare import DEFAULT_SHARD_TOKENS
    from titanlite.data.shards import ShardWriter, scan_shards

    out = work / f"verify_{gib:g}gib"
    if not (out / "meta.json").exists():
        block = np.random.default_rng(0).integers(0, 32000, 1 << 20, dtype=np.uint16)
        t0 = time.perf_counter()
        with ShardWriter(out, 32000, DEFAULT_SHARD_TOKENS, overwrite=True) as w:
            for _ in range(int(gib * 2**30 / block.nbytes)):
                w.add("train", block)
            w.commit({"vocab_size": 32000})
        print(f"wrote {gib:g} GiB of shards (with their CRC32 and largest id) in {time.perf_counter() - t0:.1f} s")
    paths = sorted(out.glob("train_*.bin"))
    total = sum(p.stat().st_size for p in paths)
    print(f"{len(paths)} shards, {total / 2**30:.2f} GiB | {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    for threads in sorted({1, 2, 4, 8, 16, os.cpu_count() or 1}):
        for cache in ("page cache", "disk") if cold else ("page cache",):
            if cache == "disk":
                os.sync()
                Path("/proc/sys/vm/drop_caches").write_text("3\n")
            t0 = time.perf_counter()
            scan_shards(paths, np.dtype(np.uint16), threads)
            print(f"threads {threads:>3}  {cache:<10}  {total / (time.perf_counter() - t0) / 1e9:6.2f} GB/s")


def main() -> None:
    ap = launch.Parser(__doc__)
    ap.add_argument("--mb", type=float, default=30, help="megabytes of text to prepare")
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--workdir", default="", help="keep corpus, tokenizer and shards here (default: a temp folder)")
    ap.add_argument("--batches", type=int, default=200, help="loader batches timed per setting")
    ap.add_argument("--prepare-workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--data-wait", nargs="+", metavar="RUN_JSON", help="only report data-wait share of run logs")
    ap.add_argument("--skip", type=int, default=10, help="--data-wait: log steps up to this one are warm-up")
    ap.add_argument("--verify-gib", type=float, default=0, help="only time shard verification over this many GiB")
    ap.add_argument("--verify-cold", action="store_true",
                    help="with --verify-gib, also read from disk: drops the page cache of the whole machine (root)")
    args = ap.parse_args()
    if args.data_wait:
        return data_wait([p for pat in args.data_wait for p in sorted(glob.glob(pat))], args.skip)
    if args.verify_gib:
        work = Path(args.workdir or tempfile.mkdtemp(prefix="data_bench_"))
        work.mkdir(parents=True, exist_ok=True)
        return verify_throughput(work, args.verify_gib, args.verify_cold)

    from titanlite.data.prepare import file_pieces, prepare_dataset
    from titanlite.data.tokenizer import train_bpe

    work = Path(args.workdir or tempfile.mkdtemp(prefix="data_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    corpus, tok, out = work / "corpus.jsonl", work / "tokenizer.json", work / "prepared"
    nbytes = write_corpus(corpus, args.mb)
    print(f"corpus: {nbytes / 2**20:.1f} MB of text in {corpus} | {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}")
    t0 = time.perf_counter()
    if not tok.exists():
        from titanlite.data.stdlib_corpus import stdlib_files

        train_bpe((p.read_text(encoding="utf-8") for p in stdlib_files()), args.vocab_size, tok)
        print(f"tokenizer: byte-level BPE, {args.vocab_size} tokens, trained in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    meta = prepare_dataset(file_pieces([corpus]), out, tokenizer=str(tok), workers=args.prepare_workers,
                           overwrite=True, progress=True, val_every=200, source=f"data_bench {args.mb} MB")
    prep_secs = time.perf_counter() - t0
    tokens = sum(s["tokens"] for s in meta["splits"].values())

    rows = [("prepare", args.prepare_workers, tokens / prep_secs)]
    for workers in (0, 2):
        rows.append(("loader", workers, loader_tokens_per_sec(out, workers, args.batches, 4, 2048)))
    print(f"\n{'stage':<9}{'workers':>8}{'tokens/s':>14}{'x 55k (1.36B/H100)':>21}")
    for stage, workers, tps in rows:
        print(f"{stage:<9}{workers:>8}{tps:>14,.0f}{tps / H100_TOKENS_PER_SEC:>20.1f}x")
    print(f"\nprepared: {tokens:,} tokens, {meta['dtype']}, {out}"
          f"\nloader shapes: local batch 4 x seq 2048, vocab {meta['vocab_size']} (per process = per rank)")


if __name__ == "__main__":
    main()

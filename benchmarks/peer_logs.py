"""torchtitan's own output from the peer runs of this machine, as diagnose's test fixtures.

Run on the GPU machine after compare_peer.py (or anything that started torchtitan through
launch.peer), on the same machine before it is given back, since the runs' outputs stay in launch.WORK:
  python3 benchmarks/peer_logs.py --out $OUT

For each torchtitan run in WORK that printed step lines it packs two files into
OUT/torchtitan_logs.tar.gz (one archive: a device call returns at most 8 files), named as
torchtitan_tests/data/diagnose/torchtitan/ expects them:
  real_<version>_<N>gpu_<mode>.rank0.log  rank 0's whole output as torchtitan printed it (colours and
                                          all; torchrun's per-rank file, WORK/<name>.ranks/)
  real_<version>_<N>gpu_<mode>.runsh.log  what run.sh printed: step and error lines only, with
                                          torchrun's "[rank0]:" prefix, colours removed (WORK/<name>.log)
and prints a table of what diagnose reads in each. Unpack the archive into
torchtitan_tests/data/diagnose/torchtitan/ and the tests take the files up by name.
"""

from __future__ import annotations

import io
import re
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import launch  # noqa: E402  (benchmarks/launch.py: where the runs and their outputs are)

# launch.peer's run names: torchtitan_<version>_<N>gpu_<its overrides, sanitized>
NAME = re.compile(r"^torchtitan_(\d+\.\d+\.\d+)_(\d+)gpu_(.*)$")


def fixture_stem(run_name: str) -> str | None:
    """real_<version>_<N>gpu_<mode> for a launch.peer run name; None for a run of another kind
    (float8, or a name launch.peer did not make)."""
    m = NAME.match(run_name)
    if not m or "float8" in m[3]:
        return None
    mode = "ddp" if "data_parallel_replicate_degree" in m[3] else "fsdp"
    return f"real_{m[1]}_{m[2]}gpu_{mode}"


def collect(work: Path = launch.WORK) -> list[tuple[str, str, Path]]:
    """(fixture file name, kind, source file) of every peer run in `work` with step lines."""
    out = []
    for printed in sorted(work.glob("torchtitan_*.log")):
        stem = fixture_stem(printed.stem)
        if stem is None or not launch.parse_peer(printed.read_text(errors="replace")):
            continue
        out.append((f"{stem}.runsh.log", "runsh", printed))
        rank0 = launch.peer_ranks_output(printed.stem, 0, work)
        if rank0 is not None:
            out.append((f"{stem}.rank0.log", "rank0", rank0))
    return out


def reading(path: Path) -> str:
    """What diagnose reads in a log, without flags: world size, mode, model, GPU; or its one-line error."""
    from titanlite.diagnose.readers import read
    from titanlite.diagnose.reconstruct import model_args
    from titanlite.metrics.run_log import RunLogError

    try:
        log = read(path)
    except RunLogError as e:
        return str(e).replace(str(path), path.name)
    cfg = log.config
    known = "model known" if model_args(log) else "model not known"
    return (f"{cfg['world_size']} GPU(s), {cfg.get('data_parallel', '-')}, local {cfg['batch_size']} x accum "
            f"{cfg['gradient_accumulation_steps']} x seq {cfg['seq_len']}, {known}, {log.hardware.get('name')}")


def main(argv: list[str] | None = None) -> int:
    ap = launch.Parser(__doc__)
    ap.add_argument("--out", required=True, help="folder for torchtitan_logs.tar.gz ($OUT on the GPU machine)")
    ap.add_argument("--work", default=str(launch.WORK), help="where launch keeps the runs' outputs")
    a = ap.parse_args(argv)
    found = collect(Path(a.work))
    if not found:
        print(f"no torchtitan run with step lines in {a.work}: run compare_peer.py --peers ... first", file=sys.stderr)
        return 1
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out / "torchtitan_logs.tar.gz", "w:gz") as tar:
        for name, _, src in found:
            data = src.read_bytes()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    print("| file | lines | what diagnose reads, no flags |\n|---|---|---|")
    for name, _, src in found:
        print(f"| {name} | {len(src.read_text(errors='replace').splitlines())} | {reading(src)} |")
    print(f"\n{len(found)} files in {out / 'torchtitan_logs.tar.gz'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

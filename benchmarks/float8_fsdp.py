"""float8 under fsdp against bf16 fsdp and torchtitan 0.2.2's float8 fsdp, batch by batch, in one call.

    python benchmarks/float8_fsdp.py --ngpus 4 --batches 4,16                 # LLaMA 1.36B, seq 2048
    python benchmarks/float8_fsdp.py --ngpus 4 --model 8B --batches 2 --peer-bf16 --ac none   # LLaMA-3.1-8B, seq 8192

Every run is fsdp over all `--ngpus` GPUs with compile, one after another through benchmarks/launch.py:
for each local batch titanlite in bf16 and in float8 (tensorwise, weights all-gathered in float8),
and torchtitan 0.2.2 with float8 (`quantize.linear.float8`, its fsdp float8 all-gather and scale
precompute; output layer in bf16 as titanlite's), and with --peer-bf16 its bf16 too. `--unfused`
adds titanlite's bf16 and float8 runs with `--optimizer.fused false` at the first batch (the optimizer's
eager path), whose optimizer phase the table gives beside the fused runs'. Ratios: each float8 row
against titanlite's best bf16 row of the call and against the peer's float8 at the same batch.
Writes float8_fsdp.md and float8_fsdp.json to --out.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import launch  # noqa: E402  (benchmarks/launch.py: the one launcher)

MODELS = {  # titanlite's options, the peer's, and the sequence length
    "1.36B": (["--model.name", "llama", "--model.flavor", "1.36B"], [], 2048),
    "8B": (["--model.name", "llama", "--model.flavor", "8B"], ["--model.flavor", "8B"], 8192),
}
PEER_FLOAT8 = ["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.filter_fqns", "output",
               "--quantize.linear.float8.enable_fsdp_float8_all_gather",
               "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"]
PEER_AC = {"none": [], "selective": ["--activation_checkpoint.mode", "selective"],
           "full": ["--activation_checkpoint.mode", "full"]}


def optimizer_ms(r: launch.Result, skip: int) -> float | None:
    """Rank 0's optimizer phase, the median over the steady log steps (titanlite's run log only)."""
    vals = sorted(e["breakdown"]["ranks"][0]["optimizer_ms"] for e in launch.steady(r.entries, skip)
                  if e.get("breakdown"))
    return vals[len(vals) // 2] if vals else None


def main() -> int:
    p = launch.Parser(__doc__)
    p.add_argument("--ngpus", type=int, default=4)
    p.add_argument("--model", choices=list(MODELS), default="1.36B")
    p.add_argument("--batches", default="4,16", help="comma-separated local batch sizes")
    p.add_argument("--ac", choices=list(PEER_AC), default="none")
    p.add_argument("--peer-bf16", action="store_true", help="also torchtitan 0.2.2 in bf16 at each batch")
    p.add_argument("--unfused", action="store_true", help="also titanlite with --optimizer.fused false (first batch)")
    p.add_argument("--float8-only", action="store_true", help="titanlite's float8 rows alone (bf16 measured elsewhere)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=15)
    p.add_argument("--timeout", type=int, default=480)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "outputs/float8_fsdp")))
    a = p.parse_args()
    ours, theirs, seq = MODELS[a.model]
    batches = [int(b) for b in a.batches.split(",")]
    base = ["--training.dataset", "synthetic", "--training.seq_len", str(seq), "--lr_scheduler.warmup_steps", "10",
            "--validation.enable=false", "--checkpoint.enable=false", "--metrics.progress_bar=false",
            "--compile.enable", "--parallelism.data_parallel", "fsdp", "--activation_checkpoint.mode", a.ac, *ours]
    peer_base = [*theirs, "--training.seq_len", str(seq), "--training.steps", str(a.steps), *PEER_AC[a.ac]]
    rows: list[tuple[str, int, launch.Result]] = []
    for b in batches:
        batch = ["--training.local_batch_size", str(b)]
        for precision, extra in (("bf16", []), ("float8", ["--float8.enable"]))[1 if a.float8_only else 0:]:
            runs = [("", [])] + ([(" unfused", ["--optimizer.fused", "false"])] if a.unfused and b == batches[0] else [])
            for tag, opt in runs:
                name = f"titanlite_{a.model}_{precision}{tag.strip() and '_unfused'}_b{b}"
                rows.append((f"titanlite {precision}{tag}", b,
                             launch.titanlite(name, [*batch, *extra, *opt], a.ngpus, a.steps, 5, a.timeout, base=base)))
        rows.append(("torchtitan 0.2.2 float8", b, launch.peer("0.2.2", a.ngpus, [*peer_base, *batch, *PEER_FLOAT8],
                                                                timeout=a.timeout + 180)))
        if a.peer_bf16:
            rows.append(("torchtitan 0.2.2 bf16", b, launch.peer("0.2.2", a.ngpus, [*peer_base, *batch],
                                                                  timeout=a.timeout + 180)))
    figs = [(name, b, r, r.figures(a.skip)) for name, b, r in rows]
    best = max((f.get("tps_gpu") or 0 for n, _, _, f in figs if n == "titanlite bf16"), default=0)
    peer_f8 = {b: f.get("tps_gpu") for n, b, _, f in figs if n == "torchtitan 0.2.2 float8"}
    first = next((r for _, _, r in rows if r.startup), None)
    where = f"{a.ngpus} x {first.startup['hardware'].get('name')}, torch {first.startup['software'].get('torch')}, " if first else ""
    lines = [f"{where}LLaMA {a.model}, seq {seq}, fsdp, compile, AC {a.ac}, {a.steps} steps, steady after {a.skip}", "",
             "| run | local batch | tok/s/GPU | MFU % | peak GiB | optimizer ms | vs best titanlite bf16 | vs peer float8 | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, b, r, f in figs:
        tps = f.get("tps_gpu")
        vs_best = tps / best if tps and best and "float8" in name else None
        vs_peer = tps / peer_f8[b] if tps and peer_f8.get(b) and name.startswith("titanlite") else None
        mem = f.get("mem") if f.get("mem") is not None else f.get("reserved")
        lines.append(f"| {name} | {b} | {launch.fmt(tps, ',.0f')} | {launch.fmt(f.get('mfu'), '.1f')} | "
                     f"{launch.fmt(mem, '.2f')} | {launch.fmt(optimizer_ms(r, a.skip), '.1f')} | "
                     f"{launch.fmt(vs_best, '.3f')} | {launch.fmt(vs_peer, '.3f')} | {(r.error or '')[:80]} |")
    text = "\n".join(lines)
    print("\n" + text)
    launch.save(a.out, "float8_fsdp", text, [r for _, _, r in rows], {"argv": sys.argv[1:]})
    return 0


if __name__ == "__main__":
    sys.exit(main())

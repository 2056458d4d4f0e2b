"""The one-GPU presets in train_configs/ against titanlite's defaults at the same global batch, and
each preset with the opt-in settings that change numerics, in one call.

  python benchmarks/presets.py [--only "llama preset,llama defaults"] [--steps 16]

A row is a whole training command (synthetic tokens, no validation or checkpoints): "defaults" sets
only the model, seq 2048, the preset's global batch and compile, so every other value is the
default; "preset" is the file as shipped; "+ float8 + bf16 moments" the preset with both opt-in
settings; "recommended" what `python -m estimation --estimate.recommend` picks with them allowed.
Prints the table (tokens/s per GPU and MFU: the steady mean after --skip; memory: peaks) and writes
presets.md and presets.json to --out.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import launch  # noqa: E402  (benchmarks/launch.py: the one launcher)

RUN = ["--training.dataset", "synthetic", "--validation.enable=false", "--checkpoint.enable=false",
       "--metrics.progress_bar=false", "--data.num_workers", "0"]
OPT_IN = ["--float8.enable", "--optimizer.moments_dtype", "bfloat16"]
LLAMA = str(launch.ROOT / "train_configs" / "llama_1.36b_1xh100.toml")
QWEN3 = str(launch.ROOT / "train_configs" / "qwen3_1.8b_1xh100.toml")


def defaults(name: str, flavor: str, global_batch: int) -> list[str]:
    return ["--model.name", name, "--model.flavor", flavor, "--training.seq_len", "2048",
            "--training.global_batch_size", str(global_batch), "--compile.enable"]


# name -> options (one GPU, global batch 32 x 2048 tokens in every row)
ROWS: dict[str, list[str]] = {
    "llama defaults": defaults("llama", "1.36B", 32),
    "llama preset": ["--job.config_file", LLAMA],
    "llama preset + float8 + bf16 moments": ["--job.config_file", LLAMA, *OPT_IN],
    "llama recommended (opt-in allowed)": ["--job.config_file", LLAMA, *OPT_IN, "--training.local_batch_size", "32"],
    "qwen3 defaults": defaults("qwen3", "1.8B", 32),
    "qwen3 preset": ["--job.config_file", QWEN3],
    "qwen3 preset + float8 + bf16 moments": ["--job.config_file", QWEN3, *OPT_IN],
}


def table(results: list[tuple[str, launch.Result]], skip: int) -> str:
    lines = ["| run | local x accum | tok/s/GPU | MFU % | alloc GiB | rsrvd GiB | vs defaults | note |",
             "|---|---|---|---|---|---|---|---|"]
    base: dict[str, float] = {}
    for name, r in results:
        f = r.figures(skip)
        cfg = r.startup.get("config", {})
        shape = f"{cfg.get('training.local_batch_size', '?')} x {cfg.get('gradient_accumulation_steps', '?')}"
        model = name.split()[0]
        if name.endswith("defaults") and f.get("tps_gpu"):
            base[model] = f["tps_gpu"]
        ratio = f"{f['tps_gpu'] / base[model]:.3f}" if f.get("tps_gpu") and base.get(model) else "-"
        lines.append(f"| {name} | {shape} | {launch.fmt(f.get('tps_gpu'), ',.0f')} | {launch.fmt(f.get('mfu'), '.1f')} | "
                     f"{launch.fmt(f.get('mem'), '.2f')} | {launch.fmt(f.get('reserved'), '.2f')} | {ratio} | "
                     f"{r.error or ''} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = launch.Parser(__doc__)
    ap.add_argument("--only", default="", help="comma-separated row names")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--skip", type=int, default=8, help="log steps up to this one are warm-up (compile)")
    ap.add_argument("--timeout", type=int, default=150)
    ap.add_argument("--out", default=os.environ.get("OUT", "outputs/presets"))
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    only = [s.strip() for s in a.only.split(",") if s.strip()]
    unknown = [s for s in only if s not in ROWS]
    if unknown:
        ap.error(f"unknown row {', '.join(unknown)}; choose from {', '.join(ROWS)}")
    if a.steps <= a.skip:
        ap.error("--steps must exceed --skip")
    results = []
    for name, opts in ROWS.items():
        if only and name not in only:
            continue
        run = "presets_" + "_".join(name.replace("+", "").replace("(", "").replace(")", "").split())
        results.append((name, launch.titanlite(run, opts, 1, a.steps, 2, a.timeout, base=RUN)))
    text = table(results, a.skip)
    print("\n" + text)
    launch.save(Path(a.out), "presets", text, [r for _, r in results], {"argv": sys.argv[1:] if argv is None else argv})


if __name__ == "__main__":
    main()

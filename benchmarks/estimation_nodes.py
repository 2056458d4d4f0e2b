"""Estimation beyond one node (CPU only): what `--estimate.recommend` picks on many H100 nodes.

    python benchmarks/estimation_nodes.py [--gpus 16,64,256] [--flavors 1.36B,8B] [--out DIR]

For LLaMA 1.36B and 8B on 16, 64 and 256 H100s (nodes of 8, 400 Gb/s InfiniBand per GPU, the defaults
of `estimate.gpus_per_node` and `estimate.inter_node_gbps`), compiled, seq 2048, the default numerics
(`--estimate.recommend_opt_in=false`), at a fixed number of tokens per optimizer step (TARGET_TOKENS),
the recommender ranks ddp, zero1, fsdp and hsdp at every local batch x accumulation that reaches it.
The table gives its pick and, beside it, the best candidate of fsdp and of hsdp (peak memory per GPU,
tokens/s per GPU). It is docs/estimation.md's table for several nodes: a model, not a measurement.
Writes estimation_nodes.md and estimation_nodes.json to --out; progress on stderr.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import launch  # noqa: E402  (benchmarks/launch.py: the bad-input rule)

PRESET = "train_configs/llama_1.36b_h100.toml"  # LLaMA, seq 2048, bf16, compile
TARGET_TOKENS = {"1.36B": 512 * 2048, "8B": 2048 * 2048}  # tokens per optimizer step: 1M and 4M
GIB = 2**30


def recommend_case(flavor: str, gpus: int, top: int) -> dict:
    """The recommender's ranked candidates for one model and GPU count, and the best of each mode."""
    from estimation.recommend import recommend
    from titanlite.config import load_config

    cfg = load_config(["--job.config_file", str(ROOT / PRESET), "--model.flavor", flavor, "--estimate.ngpu", str(gpus),
                       "--estimate.hardware", "h100", "--estimate.target_tokens", str(TARGET_TOKENS[flavor]),
                       "--estimate.recommend", "--estimate.recommend_opt_in=false",
                       "--estimate.recommend_top", str(top)])
    t0 = time.perf_counter()
    r = recommend(cfg, progress=lambda m: print(f"[{flavor} x {gpus}] {m}", file=sys.stderr, flush=True))
    rows = [{"mode": c.knobs.mode, "label": c.knobs.label(), "local": c.local, "accum": c.accum,
             "peak_gib": round(c.peak_bytes / GIB, 2), "tok_s_gpu": round(c.tokens_per_sec_per_gpu),
             "mfu_pct": round(c.mfu_pct, 1), "dominant": c.dominant} for c in r["best"]]
    best = {m: next((row for row in rows if row["mode"] == m), None) for m in ("fsdp", "hsdp")}
    return {"flavor": flavor, "gpus": gpus, "nodes": gpus // 8, "target_tokens": TARGET_TOKENS[flavor],
            "pick": rows[0] if rows else None, "best": best, "candidates": rows,
            "elapsed_s": round(time.perf_counter() - t0, 1)}


def cell(row: dict | None, what: str) -> str:
    if row is None:
        return "not in the ranked list"
    if what == "pick":
        return f"{row['label']}, {row['local']} x {row['accum']}: {row['peak_gib']:.1f} GiB, {row['tok_s_gpu']:,}"
    return f"{row['tok_s_gpu']:,} ({row['local']} x {row['accum']}, {row['peak_gib']:.1f} GiB)"


def table(cases: list[dict]) -> str:
    lines = ["| model | H100s (nodes of 8) | tokens a step | recommended: mode, local x accum: peak GiB, tok/s/GPU | "
             "best fsdp: tok/s/GPU (local x accum, GiB) | best hsdp |",
             "|---|---|---|---|---|---|"]
    for c in cases:
        lines.append(f"| LLaMA {c['flavor']} | {c['gpus']} ({c['nodes']}) | {c['target_tokens'] / 2**20:g}M | "
                     f"{cell(c['pick'], 'pick')} | {cell(c['best']['fsdp'], 'mode')} | {cell(c['best']['hsdp'], 'mode')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = launch.Parser(__doc__)
    ap.add_argument("--gpus", default="16,64,256", help="comma-separated GPU counts (whole nodes of 8)")
    ap.add_argument("--flavors", default="1.36B,8B", help=f"LLaMA flavors among {', '.join(TARGET_TOKENS)}")
    ap.add_argument("--top", type=int, default=12, help="candidates the recommender verifies and ranks")
    ap.add_argument("--out", default=".", help="folder for estimation_nodes.md and .json")
    a = ap.parse_args(argv)
    try:
        gpus = [int(g) for g in a.gpus.split(",")]
    except ValueError:
        ap.error(f"--gpus wants comma-separated whole numbers; got '{a.gpus}'")
    if any(g < 16 or g % 8 for g in gpus):
        ap.error(f"--gpus wants whole nodes of 8, more than one; got '{a.gpus}'")
    flavors = a.flavors.split(",")
    if unknown := [f for f in flavors if f not in TARGET_TOKENS]:
        ap.error(f"--flavors: unknown {', '.join(unknown)}; choose from {', '.join(TARGET_TOKENS)}")
    cases = [recommend_case(f, g, a.top) for f in flavors for g in gpus]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    text = table(cases)
    (out / "estimation_nodes.md").write_text(text + "\n")
    (out / "estimation_nodes.json").write_text(json.dumps(cases, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

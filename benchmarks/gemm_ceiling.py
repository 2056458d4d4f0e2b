"""The GEMM ceiling of a training step: every linear layer's forward and its two backward GEMMs at the step's
shapes, alone on one GPU, in bf16 and in float8 tensorwise (torch._scaled_mm, as torchao runs them).

  python benchmarks/gemm_ceiling.py                                  # LLaMA-3.1-8B, 16384 tokens (2 x 8192)
  python benchmarks/gemm_ceiling.py --model llama --flavor 1.36B --tokens 16384 [--no-float8] [--iters 20]

Shapes come from titanlite.models: with T tokens a GPU's step, a linear of `in` -> `out` features runs the
forward x[T, in] @ W[out, in]^T, the input gradient dy[T, out] @ W, and the weight gradient dy^T @ x; each
is 2 * M * N * K FLOPs, counted as often as the step runs it (its layers; q/o, k/v and w1/w3 share shapes).
Layouts follow nn.Linear's (the weight's transpose read in place), and float8 follows torchao's tensorwise
recipe: e4m3 for activations and weights, e5m2 for the output gradient, the weight transposed in
memory for the input gradient and dy, x transposed for the weight gradient, fast accumulation in the
forward only (titanlite's default; --float8.backward_fast_accum would add it to the backward). Casts and
scales are not timed: this is the GEMMs' own ceiling. The output layer stays in bf16 under float8 (both
titanlite and torchtitan leave it out), so the float8 step's mean takes its bf16 figures.

Per shape: ms, TFLOP/s and the fraction of the GPU's dense bf16 peak (twice that for float8); then the
step's flop-weighted mean (all GEMM FLOPs over all GEMM time) beside the rate estimation/calibration.json
gives `python -m estimation`. Writes gemm_ceiling.md and gemm_ceiling.json to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import launch  # noqa: E402  (benchmarks/launch.py: the benchmarks' argument parser)

GEMMS = ("forward", "input grad", "weight grad")


def linears(model: str, flavor: str) -> list[tuple[str, int, int, int]]:
    """(names, in, out, count per step) of the model's linear layers, those of one shape together."""
    from titanlite.models import get_model_args

    a = get_model_args(model, flavor)
    q, kv, L = a.n_heads * a.hdim, a.kv_heads * a.hdim, a.n_layers
    shapes: dict[tuple[int, int], list] = {}
    for name, i, o, n in (("wq", a.dim, q, L), ("wk", a.dim, kv, L), ("wv", a.dim, kv, L), ("wo", q, a.dim, L),
                          ("w1", a.dim, a.ffn_dim, L), ("w3", a.dim, a.ffn_dim, L), ("w2", a.ffn_dim, a.dim, L),
                          ("output", a.dim, a.vocab_size, 1)):
        entry = shapes.setdefault((i, o), [[], 0])
        entry[0].append(name)
        entry[1] += n
    return [("/".join(names), i, o, n) for (i, o), (names, n) in shapes.items()]


def mnk(gemm: str, tokens: int, fin: int, fout: int) -> tuple[int, int, int]:
    """(M, N, K) of one of a linear's three GEMMs."""
    return {"forward": (tokens, fout, fin), "input grad": (tokens, fin, fout), "weight grad": (fout, fin, tokens)}[gemm]


def flops(m: int, n: int, k: int) -> float:
    return 2.0 * m * n * k


def mean_rate(rows: list[dict], precision: str) -> float | None:
    """The step's flop-weighted TFLOP/s: every GEMM's FLOPs over their time, each as often as the step runs it.
    In float8 the output layer's GEMMs are bf16 (it stays out of float8), so they take their bf16 rows."""
    keep = [r for r in rows if r["precision"] == precision or (precision == "float8" and r["output"])]
    if not any(r["precision"] == precision for r in keep) or any(r.get("ms") is None for r in keep):
        return None
    return sum(r["flops"] * r["count"] for r in keep) / sum(r["ms"] / 1e3 * r["count"] for r in keep) / 1e12


def operands(gemm: str, precision: str, x, w, dy) -> tuple:
    """(a, b, fast accumulation) of one GEMM, from the activations x[T, in], the weight w[out, in] and the output
    gradient dy[T, out]; in float8 the first operand row-major and the second column-major, as
    torch._scaled_mm needs them and torchao lays them out."""
    import torch

    if precision == "bf16":
        a, b = {"forward": (x, w.t()), "input grad": (dy, w), "weight grad": (dy.t(), x)}[gemm]
        return a, b, False
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    return {"forward": (x.to(e4), w.to(e4).t(), True),
            "input grad": (dy.to(e5), w.t().contiguous().to(e4).t(), False),
            "weight grad": (dy.t().contiguous().to(e5), x.t().contiguous().to(e4).t(), False)}[gemm]


def time_gemm(gemm: str, precision: str, tokens: int, fin: int, fout: int, iters: int, warmup: int = 5) -> float:
    """ms per GEMM: the mean of `iters` after `warmup`, timed with CUDA events."""
    import torch

    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(tokens, fin, device=dev, dtype=bf, generator=g)
    w = torch.randn(fout, fin, device=dev, dtype=bf, generator=g) * 0.02
    dy = torch.randn(tokens, fout, device=dev, dtype=bf, generator=g) * 0.01
    a, b, fast = operands(gemm, precision, x, w, dy)
    del x, w, dy
    if precision == "bf16":
        run = lambda: torch.mm(a, b)  # noqa: E731
    else:
        one = torch.ones((), device=dev, dtype=torch.float32)
        run = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=bf, use_fast_accum=fast)  # noqa: E731
    for _ in range(warmup):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def calibrated(hw_key: str | None) -> dict[str, float]:
    """The GEMM rates `python -m estimation` takes (estimation/calibration.json), as fractions of the bf16
    peak (float8: of twice it), this GPU's own fit where it has one."""
    path = Path(__file__).resolve().parents[1] / "estimation" / "calibration.json"
    try:
        rates = json.loads(path.read_text())["rates"]
    except (OSError, ValueError, KeyError):
        return {}
    out = {}
    for precision, name in (("bf16", "gemm_efficiency"), ("float8", "float8_efficiency")):
        entry = rates.get(name) or {}
        own = entry.get(hw_key) if hw_key else None
        value = (own or {}).get("value", entry.get("value"))
        if value is not None:
            out[precision] = value
    return out


def table(rows: list[dict], peak: float | None, calib: dict[str, float]) -> str:
    """Markdown: every GEMM's ms, TFLOP/s and fraction of the peak (bf16's, or twice it for float8), then the
    step's flop-weighted means beside the calibrated rates."""
    lines = ["| linear (in -> out) | per step | GEMM | M x N x K | precision | ms | TFLOP/s | of peak |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m, n, k = r["mnk"]
        of = r["tflops"] / (peak * (2 if r["precision"] == "float8" else 1)) if peak and r.get("tflops") else None
        lines.append(f"| {r['names']} ({r['in']} -> {r['out']}) | {r['count']} | {r['gemm']} | {m} x {n} x {k} | "
                     f"{r['precision']} | {r.get('error') or launch.fmt(r.get('ms'), '.3f')} | "
                     f"{launch.fmt(r.get('tflops'), '.0f')} | {launch.fmt(of, '.3f')} |")
    lines += ["", "| step's GEMMs | flop-weighted TFLOP/s | of peak | calibrated (estimation) | TFLOP/s the estimate takes |",
              "|---|---|---|---|---|"]
    for precision in ("bf16", "float8"):
        if not any(r["precision"] == precision for r in rows):
            continue
        mean = mean_rate(rows, precision)
        scale = peak * (2 if precision == "float8" else 1) if peak else None
        c = calib.get(precision)
        label = "bf16" if precision == "bf16" else "float8 (output layer in bf16)"
        lines.append(f"| {label} | {launch.fmt(mean, '.0f')} | {launch.fmt(mean / scale if mean and scale else None, '.3f')} | "
                     f"{launch.fmt(c, '.3f')} | {launch.fmt(c * scale if c and scale else None, '.0f')} |")
    return "\n".join(lines)


def plan(model: str, flavor: str, tokens: int, float8: bool) -> list[dict]:
    """Every GEMM to time, bf16 first, then float8 for every linear but the output layer."""
    rows = []
    for precision in ("bf16", "float8") if float8 else ("bf16",):
        for names, fin, fout, count in linears(model, flavor):
            output = names == "output"
            if precision == "float8" and output:
                continue
            for gemm in GEMMS:
                m, n, k = mnk(gemm, tokens, fin, fout)
                rows.append({"names": names, "in": fin, "out": fout, "count": count, "output": output, "gemm": gemm,
                             "precision": precision, "mnk": (m, n, k), "flops": flops(m, n, k)})
    return rows


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = launch.Parser(__doc__)
    ap.add_argument("--model", default="llama")
    ap.add_argument("--flavor", default="8B")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens a GPU's step runs (local batch x sequence)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-float8", action="store_true", help="bf16 only")
    ap.add_argument("--out", default=os.environ.get("OUT", "outputs/gemm_ceiling"))
    a = ap.parse_args(argv)
    if a.tokens < 1 or a.iters < 1:
        ap.error("--tokens and --iters must be positive")
    try:
        a.rows = plan(a.model, a.flavor, a.tokens, not a.no_float8)
    except (KeyError, ValueError) as e:
        ap.error(f"no model {a.model}/{a.flavor} in titanlite.models: {e}")
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    import torch

    from titanlite.hardware import lookup

    if not torch.cuda.is_available():
        print("gemm_ceiling: needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    name = torch.cuda.get_device_name(0)
    hw = lookup(name)
    if torch.cuda.get_device_capability(0) < (8, 9):
        a.rows = [r for r in a.rows if r["precision"] == "bf16"]
    for r in a.rows:
        try:
            r["ms"] = time_gemm(r["gemm"], r["precision"], a.tokens, r["in"], r["out"], a.iters)
            r["tflops"] = r["flops"] / (r["ms"] / 1e3) / 1e12
        except Exception as e:  # a GEMM that cannot run here is a row, not a stop
            r["error"] = launch.exception_line(e)
        print(f"  {r['names']} {r['gemm']} {r['precision']}: " + (r.get("error") or f"{r['ms']:.3f} ms, "
              f"{r['tflops']:.0f} TFLOP/s"), flush=True)
        torch.cuda.empty_cache()
    text = (f"{name}, torch {torch.__version__}: {a.model} {a.flavor}'s GEMMs at {a.tokens} tokens, {a.iters} "
            f"iterations each; peak {launch.fmt(hw.peak_tflops if hw else None, '.0f')} TFLOP/s dense bf16 "
            f"(float8: twice)\n\n" + table(a.rows, hw.peak_tflops if hw else None, calibrated(hw.key if hw else None)))
    print("\n" + text)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemm_ceiling.md").write_text(text + "\n")
    (out / "gemm_ceiling.json").write_text(json.dumps({"device": name, "torch": torch.__version__, "model": a.model,
                                                       "flavor": a.flavor, "tokens": a.tokens, "rows": a.rows}, indent=1))


if __name__ == "__main__":
    main()

"""Attention kernels, forward + backward, causal bf16: every backend available here, one table.

  python benchmarks/attention.py [--backends flash_attn_4,sdpa_cudnn] [--iters 20] [--shapes 8b]

Shapes are the models' own (titanlite.models): by default LLaMA 1.36B at batch 4 and 8 (18 heads of 128)
and Qwen3 1.8B at batch 4 (GQA: 16 query, 8 K/V heads of 128), sequence 2048; `--shapes 8b`: LLaMA-3.1-8B
and Qwen3-8B at batch 2, sequence 8192 (GQA: 32 query, 8 K/V heads of 128), the 8B step's attention. Each backend runs as
titanlite's model calls it (titanlite.ops.attention): cuDNN SDPA and flash-attn take grouped K/V as
they are, the other pinned SDPA kernels get them expanded to the query heads. TFLOP/s counts causal FLOPs: the forward's two
matmuls over half the S x S square, 2 * B * Hq * S^2 * D, and the backward 2.5 times that (the
convention of flash-attention's benchmarks). `first s` is the first call (flash-attn 4 compiles its
kernels then; cuDNN builds its plan). `auto` (AUTO_ORDER in titanlite/ops/attention.py) is what this
GPU's row picks at each shape's sequence length. The note names the longest forward and backward
kernel of one more call (stream_profile's categories): which kernel unpinned SDPA chose. Writes attention.md and attention.json
to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import launch  # noqa: E402  (benchmarks/launch.py: the benchmarks' argument parser)
from titanlite.models import get_model_args  # noqa: E402

# label -> (model, flavor, batch, sequence); heads and head size come from the flavor
SHAPES = {"llama 1.36B b4": ("llama", "1.36B", 4, 2048), "llama 1.36B b8": ("llama", "1.36B", 8, 2048),
          "qwen3 1.8B b4": ("qwen3", "1.8B", 4, 2048),
          # the 8B step of float8_fsdp.py --model 8B: local batch 2 x 8192, 32 query / 8 K/V heads of 128 (both models)
          "llama 8B b2": ("llama", "8B", 2, 8192), "qwen3 8B b2": ("qwen3", "8B", 2, 8192)}
GROUPS = {"default": ["llama 1.36B b4", "llama 1.36B b8", "qwen3 1.8B b4"], "8b": ["llama 8B b2", "qwen3 8B b2"]}


def shape(label: str) -> tuple[int, int, int, int, int]:
    """(B, Hq, Hkv, S, D) of a SHAPES entry."""
    model, flavor, batch, seq = SHAPES[label]
    a = get_model_args(model, flavor)
    return batch, a.n_heads, a.kv_heads, seq, a.hdim


def shapes(spec: str) -> list[str]:
    """The SHAPES labels a --shapes value names: labels and GROUPS, comma-separated, each once, in order."""
    out = []
    for part in (p.strip() for p in spec.split(",")):
        for label in GROUPS.get(part.lower(), [part] if part else []):
            if label not in out:
                out.append(label)
    return out


def causal_flops(b: int, hq: int, s: int, d: int) -> float:
    """Forward + backward FLOPs of causal attention: 2*B*Hq*S^2*D forward (QK^T and PV over half the square), 2.5x that backward."""
    return 3.5 * 2 * b * hq * s * s * d


def time_backend(name: str, shp: tuple[int, int, int, int, int], iters: int, warmup: int = 3) -> dict:
    """ms per forward + backward (mean of `iters` after warm-up) and the first call's seconds."""
    import torch

    from titanlite.ops.attention import build_attention

    b, hq, hkv, s, d = shp
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda h: torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    q, k, v = mk(hq), mk(hkv), mk(hkv)
    dout = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    attn = build_attention(name)

    def step():
        torch.autograd.grad(attn(q, k, v), (q, k, v), dout)

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    for _ in range(warmup):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        step()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / iters
    return {"ms": ms, "tflops": causal_flops(b, hq, s, d) / (ms / 1e3) / 1e12, "first_s": first,
            "kernels": kernels(step)}


def kernels(step) -> dict[str, str]:
    """The longest kernel of one more call per stream_profile category (what the backend ran: which kernel
    unpinned SDPA chose, and what its forward and backward are); {} if the profiler fails."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from stream_profile import category

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        times: dict[str, float] = {}
        for e in prof.key_averages():
            t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
            if t:
                times[e.key] = times.get(e.key, 0.0) + t
    except Exception:  # a name is a note, not the measurement
        return {}
    best: dict[str, tuple[float, str]] = {}
    for name, t in times.items():
        c = category(name)
        if t > best.get(c, (0.0, ""))[0]:
            best[c] = (t, name)
    return {c: name for c, (t, name) in best.items() if c.startswith("attention")}


def table(rows: list[dict], auto: dict[str, str]) -> str:
    """Markdown: one row per (shape, backend), with each shape's TFLOP/s relative to sdpa_cudnn; `auto`:
    what attention_backend=auto runs at each shape (its order can depend on the sequence length)."""
    lines = ["| shape (B, Hq/Hkv, S, D) | backend | ms fwd+bwd | TFLOP/s | vs sdpa_cudnn | first s | note |",
             "|---|---|---|---|---|---|---|"]
    base = {r["shape"]: r["tflops"] for r in rows if r["backend"] == "sdpa_cudnn" and "tflops" in r}
    for r in rows:
        b, hq, hkv, s, d = r["dims"]
        where = f"{r['shape']} ({b}, {hq}/{hkv}, {s}, {d})"
        name = r["backend"] + (" (auto)" if r["backend"] == auto.get(r["shape"]) else "")
        if "error" in r:
            lines.append(f"| {where} | {name} | - | - | - | - | {r['error']} |")
            continue
        rel = f"{r['tflops'] / base[r['shape']]:.3f}" if r["shape"] in base else "-"
        ks = r.get("kernels") or {}
        note = "; ".join(f"{c[10:]}: {ks[c][:60]}" for c in ("attention fwd", "attention bwd") if c in ks)
        lines.append(f"| {where} | {name} | {r['ms']:.2f} | {r['tflops']:.0f} | {rel} | {r['first_s']:.1f} | {note} |")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    from titanlite.ops.attention import BACKENDS

    ap = launch.Parser(__doc__)
    ap.add_argument("--backends", default="", help=f"comma-separated (default: every available one but manual): "
                                                   f"{', '.join(BACKENDS)}")
    ap.add_argument("--shapes", default="default", help=f"comma-separated shapes ({', '.join(SHAPES)}) or groups "
                                                       f"({', '.join(f'{g}: {len(v)} shapes' for g, v in GROUPS.items())})")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "outputs/attention"))
    a = ap.parse_args(argv)
    a.backends = [n for n in a.backends.split(",") if n]
    a.shapes = shapes(a.shapes)
    bad = [n for n in a.backends if n not in BACKENDS] + [s for s in a.shapes if s not in SHAPES]
    if bad:
        ap.error(f"unknown backend or shape: {', '.join(bad)}")
    if a.iters < 1:
        ap.error("--iters must be positive")
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    import torch

    from titanlite.ops.attention import BACKENDS, resolve_backend

    if not torch.cuda.is_available():
        print("attention: needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    dev = torch.device("cuda")
    names = a.backends or [n for n in BACKENDS if n != "manual"]
    missing = [n for n in names if not BACKENDS[n].available(dev)]
    names = [n for n in names if n not in missing]
    auto = {label: resolve_backend("auto", dev, seq_len=shape(label)[3]) for label in a.shapes}
    rows = []
    for label in a.shapes:
        dims = shape(label)
        for name in names:
            row = {"shape": label, "dims": dims, "backend": name}
            try:
                row.update(time_backend(name, dims, a.iters))
            except Exception as e:  # a backend that cannot run this shape is a row, not a stop
                row["error"] = launch.exception_line(e, 120)
            rows.append(row)
            print(f"  {label} {name}: " + (row.get("error") or f"{row['ms']:.2f} ms, {row['tflops']:.0f} TFLOP/s, "
                                                               f"first call {row['first_s']:.1f} s"), flush=True)
            torch.cuda.empty_cache()
    cap = torch.cuda.get_device_capability(dev)
    text = (f"{torch.cuda.get_device_name(dev)} (sm{cap[0]}{cap[1]}), torch {torch.__version__}, causal bf16, "
            f"forward + backward, {a.iters} iterations; not available here: {', '.join(missing) or 'none'}\n\n"
            + table(rows, auto))
    print("\n" + text)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention.md").write_text(text + "\n")
    (out / "attention.json").write_text(json.dumps({"device": torch.cuda.get_device_name(dev), "capability": cap,
                                                    "torch": torch.__version__, "auto": auto, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

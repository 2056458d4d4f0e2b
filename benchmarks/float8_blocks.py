"""Where float8 pays inside a block: a stack of the model's transformer blocks on one GPU, each block compiled on
its own (torch.compile, as compile.enable compiles a run's blocks), forward and backward at a step's tokens, in bf16
and in float8 variants.

  python benchmarks/float8_blocks.py                                   # LLaMA-3.1-8B, 2 x 8192 tokens
  python benchmarks/float8_blocks.py --model llama --flavor 1.36B --seq 2048 --tokens 32768 \\
      --variants bf16,float8,float8-wq+wk+wv,float8:rowwise,float8:fast

A variant is `bf16`, or `float8` with titanlite's float8 (`titanlite.parallel.apply.apply_float8`, the
tensorwise recipe unless `:rowwise`; `:fast` adds float8.backward_fast_accum) and `-name+name...` the block's
linears (wq wk wv wo w1 w2 w3) that stay bf16. Each variant: ms per block (the best of --repeats timings of
--iters steps over --blocks blocks, after warm-up steps), against bf16 and against the plain `float8` variant
when they ran. What a block does not hold (embeddings, the output layer and loss, the optimizer, communication)
is left out: this says which linears' float8 GEMMs outrun their casts, and by how much, at these shapes.
Writes float8_blocks.md and float8_blocks.json to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import launch  # noqa: E402  (benchmarks/launch.py: the benchmarks' argument parser)

LINEARS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
OPTIONS = ("rowwise", "fast")


@dataclass(frozen=True)
class Variant:
    name: str
    float8: bool
    recipe: str = "tensorwise"
    fast_accum: bool = False
    keep_bf16: frozenset[str] = frozenset()


def parse_variant(text: str) -> Variant:
    """`bf16` | `float8[:rowwise][:fast][-name+name...]` (the named linears stay bf16); ValueError else."""
    head, dash, kept = text.partition("-")
    base, *options = head.split(":")
    names = kept.split("+") if dash else []
    if base not in ("bf16", "float8") or (base == "bf16" and (options or dash)):
        raise ValueError(f"variant {text!r}: bf16, or float8[:rowwise][:fast][-wq+wk...]")
    unknown = [o for o in options if o not in OPTIONS] + [n for n in names if n not in LINEARS]
    if unknown:
        raise ValueError(f"variant {text!r}: unknown {', '.join(map(repr, unknown))} (options: {', '.join(OPTIONS)}; "
                         f"linears: {' '.join(LINEARS)})")
    return Variant(text, base == "float8", "rowwise" if "rowwise" in options else "tensorwise", "fast" in options,
                   frozenset(names))


def convert(blocks, v: Variant, emulate: bool = False) -> None:
    """titanlite's float8 on every linear of `blocks` but those `v` keeps bf16. apply_float8 converts what it
    finds under the module it is given, so each linear to convert goes to it under a holder of its own."""
    import torch.nn as nn

    from titanlite.parallel.apply import apply_float8
    from titanlite.parallel.settings import Float8Settings

    f8 = Float8Settings(enable=True, recipe=v.recipe, emulate=emulate, backward_fast_accum=v.fast_accum)
    for block in blocks:
        for fqn, mod in list(block.named_modules()):
            *path, name = fqn.split(".")
            if isinstance(mod, nn.Linear) and name not in v.keep_bf16:
                holder = nn.Module()
                holder.add_module("linear", mod)
                apply_float8(holder, f8)
                block.get_submodule(".".join(path)).register_module(name, holder.linear)


def build(model: str, flavor: str, n: int, device: str = "cuda"):
    """`n` of the flavor's transformer blocks in bf16 (matrices drawn with std 0.02), and the model's arguments."""
    import torch
    import torch.nn as nn

    from titanlite.models import get_model_args
    from titanlite.models.transformer import TransformerBlock

    args = get_model_args(model, flavor)
    torch.manual_seed(0)
    blocks = nn.ModuleList([TransformerBlock(args, "sdpa") for _ in range(n)]).to(device=device, dtype=torch.bfloat16)
    for p in blocks.parameters():
        if p.dim() > 1:
            nn.init.normal_(p, std=0.02)
    return blocks, args


def time_variant(a: argparse.Namespace, v: Variant) -> dict:
    """ms per block of `v`'s compiled blocks, forward and backward of a mean-square loss. The weights' gradients
    add up over the steps, as a run's do over the micro-steps of gradient accumulation."""
    import torch

    from titanlite.models.transformer import rope_cache

    blocks, args = build(a.model, a.flavor, a.blocks)
    if v.float8:
        convert(blocks, v)
    compiled = [torch.compile(b, fullgraph=True) for b in blocks]  # as titanlite.parallel.apply.apply_compile
    rope = rope_cache(args.hdim, a.seq, args.rope_theta, device="cuda")
    x0 = torch.randn(a.tokens // a.seq, a.seq, args.dim, device="cuda", dtype=torch.bfloat16) * 0.5

    def step():
        h = x0.detach().requires_grad_()
        for b in compiled:
            h = b(h, rope)
        h.float().pow(2).mean().backward()

    for _ in range(a.warmup):
        step()
    times = []
    for _ in range(a.repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(a.iters):
            step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / a.iters / a.blocks)
    return {"ms": min(times), "spread_ms": max(times) - min(times)}


def table(rows: list[dict]) -> str:
    """Markdown: each variant's ms per block, against bf16 and the plain float8 variant (speed-ups: > 1 faster)."""
    ms = {r["variant"]: r.get("ms") for r in rows}
    lines = ["| variant | ms per block | spread ms | vs bf16 | vs float8 |", "|---|---|---|---|---|"]
    for r in rows:
        vs = [base and r.get("ms") and base / r["ms"] for base in (ms.get("bf16"), ms.get("float8"))]
        lines.append(f"| {r['variant']} | {r.get('error') or launch.fmt(r.get('ms'), '.3f')} | "
                     f"{launch.fmt(r.get('spread_ms'), '.3f')} | {launch.fmt(vs[0], '.3f')} | {launch.fmt(vs[1], '.3f')} |")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = launch.Parser(__doc__)
    ap.add_argument("--model", default="llama")
    ap.add_argument("--flavor", default="8B")
    ap.add_argument("--seq", type=int, default=8192, help="sequence length")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens a GPU's step runs (local batch x --seq)")
    ap.add_argument("--variants", default="bf16,float8,float8:fast,float8:rowwise",
                    help="comma-separated variants (the docstring says how they read)")
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", "outputs/float8_blocks"))
    a = ap.parse_args(argv)
    if min(a.seq, a.tokens, a.blocks, a.iters, a.repeats) < 1 or a.warmup < 0:
        ap.error("--seq, --tokens, --blocks, --iters and --repeats must be positive, --warmup not negative")
    if a.tokens % a.seq:
        ap.error(f"--tokens {a.tokens} is not a whole number of --seq {a.seq} sequences")
    try:
        a.plan = [parse_variant(t) for t in a.variants.split(",")]
    except ValueError as e:
        ap.error(str(e))
    from titanlite.models import MODEL_REGISTRY

    flavors = MODEL_REGISTRY[a.model].flavors if a.model in MODEL_REGISTRY else {}
    if a.flavor not in flavors:
        ap.error(f"no model {a.model}/{a.flavor} in titanlite.models (models: {', '.join(sorted(MODEL_REGISTRY))}; "
                 f"{a.model}'s flavors: {', '.join(flavors) or '-'})")
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    import torch

    from titanlite.hardware import FLOAT8_CAPABILITY

    if not torch.cuda.is_available() or torch.cuda.get_device_capability(0) < FLOAT8_CAPABILITY:
        print("float8_blocks: needs a CUDA GPU that runs float8 matmuls (compute capability "
              f"{'.'.join(map(str, FLOAT8_CAPABILITY))} or later)", file=sys.stderr)
        sys.exit(2)
    rows = []
    for v in a.plan:
        t0 = time.time()
        try:
            row = {"variant": v.name, **time_variant(a, v)}
        except Exception as e:  # a variant that cannot run here is a row, not a stop
            row = {"variant": v.name, "error": launch.exception_line(e)}
        row["s"] = round(time.time() - t0)
        rows.append(row)
        figure = row.get("error") or f"{row['ms']:.3f} ms a block"
        print(f"  {v.name}: {figure} ({row['s']} s)", flush=True)
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    name = torch.cuda.get_device_name(0)
    text = (f"{name}, torch {torch.__version__}: {a.model} {a.flavor}, {a.blocks} blocks compiled one by one, "
            f"{a.tokens // a.seq} x {a.seq} tokens, forward and backward, best of {a.repeats} x {a.iters} steps\n\n"
            + table(rows))
    print("\n" + text)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "float8_blocks.md").write_text(text + "\n")
    (out / "float8_blocks.json").write_text(json.dumps({"device": name, "torch": torch.__version__, **{
        k: getattr(a, k) for k in ("model", "flavor", "seq", "tokens", "blocks", "iters", "repeats")}, "rows": rows},
        indent=1))
    if not any("ms" in r for r in rows):
        sys.exit(1)  # nothing timed: every row says why


if __name__ == "__main__":
    main()

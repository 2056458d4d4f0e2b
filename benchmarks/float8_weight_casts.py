"""What the weight side of float8 tensorwise costs per step: every float8 weight's amax, its cast to
e4m3 and the transposed copy the backward GEMM reads, compiled, one GPU (no CUDA graphs: the
per-tensor rows include launch time).

    python benchmarks/float8_weight_casts.py [--model llama] [--flavor 1.36B]

It bounds what moving weight work out of the blocks could save (e.g. an amax taken by the optimizer
kernel, which reads every weight anyway): at most the amax pass, since the casts remain.
"""

import argparse
import time

import torch
import torch.nn as nn

from titanlite.models import MODEL_REGISTRY, build_model, get_model_args
from titanlite.parallel.apply import float8_eligible

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


def float8_weight_shapes(model: str, flavor: str) -> list[tuple[int, int]]:
    """(out, in) of every linear titanlite's float8 filter converts, from the model built on meta."""
    with torch.device("meta"):
        m = build_model(get_model_args(model, flavor))
    return [tuple(mod.weight.shape) for fqn, mod in m.named_modules()
            if isinstance(mod, nn.Linear) and float8_eligible(mod, fqn)]


def amaxes(ws):
    return [w.abs().amax() for w in ws]


def cast(w, amax):
    scale = E4M3_MAX / amax.float().clamp(min=1e-12)
    return (w.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def casts_given_amax(ws, ams):
    return [cast(w, a) for w, a in zip(ws, ams)]


def amax_cast_and_transpose(ws):
    out = []
    for w in ws:
        w8 = cast(w, w.abs().amax())
        out.append((w8, w8.t().contiguous()))
    return out


def ms_per_call(fn, *a, n: int = 20) -> float:
    for _ in range(3):
        fn(*a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn(*a)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama", choices=sorted(MODEL_REGISTRY))
    ap.add_argument("--flavor", default="1.36B")
    a = ap.parse_args()
    if a.flavor not in MODEL_REGISTRY[a.model].flavors:
        ap.error(f"{a.model} has no flavor {a.flavor!r}; it has {', '.join(MODEL_REGISTRY[a.model].flavors)}")
    if not torch.cuda.is_available():
        ap.exit(2, "float8_weight_casts: needs a CUDA GPU\n")
    ws = [torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.02 for s in float8_weight_shapes(a.model, a.flavor)]
    ams = amaxes(ws)
    rows = [
        ("amax pass, compiled, one reduction per weight", ms_per_call(torch.compile(amaxes), ws)),
        ("amax pass, torch._foreach_norm(inf)", ms_per_call(lambda x: torch._foreach_norm(x, float("inf")), ws)),
        ("amax + cast + transposed copy, compiled", ms_per_call(torch.compile(amax_cast_and_transpose), ws)),
        ("cast only (amax given), compiled", ms_per_call(torch.compile(casts_given_amax), ws, ams)),
    ]
    gb = sum(w.numel() for w in ws) * 2 / 1e9
    print(f"{a.model} {a.flavor}: {len(ws)} float8 weights, {gb:.2f} GB in bf16, {torch.cuda.get_device_name()}")
    for name, ms in rows:
        print(f"{name:<50} {ms:7.2f} ms")


if __name__ == "__main__":
    main()

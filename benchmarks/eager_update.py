"""MasterAdamW's updates without titanlite's kernel: the reference over a whole list at once
(titanlite.optim.eager_master_adamw_update_many, what MasterAdamW runs on the CPU) against the same
update parameter by parameter (eager_master_adamw_update), and torch's fused AdamW kernel over fp32
lists (torch_fused_master_adamw_update_many, what it runs on CUDA with optimizer.fused false); on CUDA
the fused Triton kernel beside them. No training run: lists of tensors of mixed sizes, as one group
and kind of a model's parameters.

    python benchmarks/eager_update.py [--device cpu|cuda] [--params 130] [--elements 16e6]
                                      [--moments float32|bfloat16] [--steps 10]

Per kind of master ("own": fp32; "copy": fp32 with a bf16 copy; "lo": bf16 with its low bits) and
way of launching: the time of one step (the least of --steps: the CPU machines are shared); the aten
ops it dispatches when the list is cut into a GPU's chunks (titanlite.optim.UPDATE_CHUNK), each at
least one kernel launch on CUDA, where a foreach op launches one per few dozen tensors; CUDA's
kernels from the profiler; and the bytes the list update reads and writes per element, op by op (each
distinct tensor an op touches counted once; torch's kernel is counted as writing its gradients,
which it does only with a clip scale). The fused kernel moves each element once (its bytes per
element: titanlite/ops/master_adamw.py). `--out DIR` also writes the report to DIR/eager_update.md.
"""

import argparse
import collections
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import titanlite.optim  # noqa: E402
from titanlite.optim import (eager_master_adamw_update, eager_master_adamw_update_many, master_low_bits,  # noqa: E402
                             torch_fused_master_adamw_update_many)

FREE = {"empty_like", "empty", "view", "_unsafe_view", "alias", "slice", "detach", "as_strided", "lift_fresh"}


def sizes(n_params: int, elements: float, seed: int = 0) -> list[int]:
    """`n_params` sizes of about `elements` in all, log-uniform over three decades (norms to matrices),
    each a multiple of 8 elements as a model's are (the fused launch over a list needs that)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.exp(torch.rand(n_params, generator=g) * 7)
    return [max(8, int(x) // 8 * 8) for x in raw / raw.sum() * elements]


STEP = 3.0  # the step every timed update takes (scalars' bias corrections are its)


def build(kind: str, moments: torch.dtype, ns: list[int], device: str) -> dict:
    """One list of each role, as MasterAdamW passes them for one group and kind."""
    ws = [torch.randn(n, device=device) for n in ns]
    ps = [w.bfloat16() for w in ws] if kind == "lo" else ws
    return {"ps": ps, "gs": [torch.randn(n, device=device).to(ps[0].dtype) for n in ns],
            "los": [master_low_bits(w, p) for w, p in zip(ws, ps)] if kind == "lo" else None,
            "ms": [torch.zeros(n, dtype=moments, device=device) for n in ns],
            "vs": [torch.zeros(n, dtype=moments, device=device) for n in ns],
            "copies": [w.bfloat16() for w in ws] if kind == "copy" else None,
            "step": torch.tensor(STEP, device=device)}  # torch's kernel takes the step itself


def scalars(device: str) -> tuple:
    step = torch.tensor(STEP, device=device)
    return (torch.tensor(1e-3, device=device), 0.1, 0.9, 0.95, 1e-8, 1 - 0.9 ** step, (1 - 0.95 ** step).sqrt(),
            torch.tensor(1.5, device=device), torch.zeros((), dtype=torch.bool, device=device))


def per_parameter(t: dict, args: tuple) -> None:
    for i, p in enumerate(t["ps"]):
        pick = lambda k: None if t[k] is None else t[k][i]
        eager_master_adamw_update(p, t["gs"][i], pick("los"), t["ms"][i], t["vs"][i], *args[:-1], None, pick("copies"))


def whole_list(t: dict, args: tuple) -> None:
    # no skip to decide, as MasterAdamW passes it under training.on_nan=stop (the default)
    eager_master_adamw_update_many(t["ps"], t["gs"], t["los"], t["ms"], t["vs"], *args[:-1], None, copies=t["copies"])


def whole_list_skip(t: dict, args: tuple) -> None:
    # with the skip decided on the device (training.on_nan=skip): each fp32 state held, then put back
    eager_master_adamw_update_many(t["ps"], t["gs"], t["los"], t["ms"], t["vs"], *args, copies=t["copies"])


def torch_kernel(t: dict, args: tuple, skip: bool = False) -> None:
    # no skip to decide unless `skip`, as whole_list and whole_list_skip
    torch_fused_master_adamw_update_many(t["ps"], t["gs"], t["los"], t["ms"], t["vs"], *args[:5], t["step"], args[-2],
                                         args[-1] if skip else None, t["copies"])


def torch_kernel_skip(t: dict, args: tuple) -> None:
    torch_kernel(t, args, skip=True)


def fused(t: dict, args: tuple) -> None:
    from titanlite.ops.master_adamw import master_adamw_update_many

    assert master_adamw_update_many(t["ps"], t["gs"], t["los"], t["ms"], t["vs"], *args, t["copies"], cache=t["cache"])


class Count(TorchDispatchMode):
    """The aten ops dispatched, and the bytes each reads and writes (0-d scalars not counted)."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.bytes = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.__name__.split(".")[0]
        if name in FREE:
            return out
        self.calls += 1
        written = {}
        for a, value in zip(func._schema.arguments, list(args) + [kwargs.get(a.name) for a in
                                                                   func._schema.arguments[len(args):]]):
            for t in _tensors(value):
                if a.alias_info is not None and a.alias_info.is_write:
                    written[t.data_ptr()] = t.nbytes
        read = {t.data_ptr(): t.nbytes for v in list(args) + list(kwargs.values()) for t in _tensors(v)
                if not (name.startswith("_foreach_copy") or name == "copy_") or t.data_ptr() not in written}
        written.update({t.data_ptr(): t.nbytes for t in _tensors(out)})
        self.bytes[name] += sum(read.values()) + sum(written.values())
        return out


def _tensors(x):
    ts = x if isinstance(x, (list, tuple)) else [x]
    return [t for t in ts if isinstance(t, torch.Tensor) and t.numel() > 1]


def timed(fn, t: dict, args: tuple, steps: int, device: str) -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(2):
        fn(t, args)
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        fn(t, args)
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return min(times)


def cuda_kernels(fn, t: dict, args: tuple) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(t, args)
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--params", type=int, default=130)
    p.add_argument("--elements", type=float, default=16e6)
    p.add_argument("--moments", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="CPU threads")
    p.add_argument("--out", help="a folder for eager_update.md")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    lines = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    ns = sizes(a.params, a.elements)
    ways = {"per parameter": per_parameter, "list": whole_list, "list, on_nan=skip": whole_list_skip,
            "torch kernel": torch_kernel, "torch kernel, on_nan=skip": torch_kernel_skip}
    if a.device == "cuda":
        ways["fused (Triton)"] = fused
    say(f"{a.params} tensors, {sum(ns) / 1e6:.1f}M elements ({min(ns)} to {max(ns)}), {a.moments} moments, "
        f"{a.device}, {torch.get_num_threads()} threads, best of {a.steps} steps")
    say("| kind | launch | ms/step | aten ops/step | CUDA kernels/step |")
    say("|---|---|---|---|---|")
    passes = {}
    for kind in ("own", "copy", "lo"):
        for way, fn in ways.items():
            t = build(kind, getattr(torch, a.moments), ns, a.device)
            t["cache"] = {}
            args = scalars(a.device)
            ms = timed(fn, t, args, a.steps, a.device)
            cpu_chunk, titanlite.optim.CPU_UPDATE_CHUNK = titanlite.optim.CPU_UPDATE_CHUNK, titanlite.optim.UPDATE_CHUNK
            with Count() as c:
                fn(t, args)
            titanlite.optim.CPU_UPDATE_CHUNK = cpu_chunk
            kernels = cuda_kernels(fn, t, args) if a.device == "cuda" else "-"
            say(f"| {kind} | {way} | {ms:.2f} | {c.calls} | {kernels} |")
            if way.startswith(("list", "torch")):
                passes[f"{kind}, {way}"] = {op: b / sum(ns) for op, b in c.bytes.items()}
    say()
    say("Bytes per element the list update moves, by op (a foreach op is one pass over the list):")
    for kind, ops in passes.items():
        say(f"{kind}: {sum(ops.values()):.0f} B = " + " + ".join(f"{op} {b:.0f}" for op, b in ops.items() if b))
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "eager_update.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

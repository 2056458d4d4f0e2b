"""Bus bandwidth of all-reduce, all-gather and reduce-scatter between the ranks of a torchrun job.

    torchrun --standalone --nproc-per-node 2 benchmarks/collectives.py [--sizes-mb 16,64,256] [--out FILE]

Run by torchrun (one agent, or one per node: benchmarks/multinode.py starts two agents on one host, with
NCCL held to sockets for its estimation check). Each collective runs on tensors of each size (the full
tensor: what all-reduce reduces, what all-gather gathers and reduce-scatter scatters) in bf16, NCCL on
GPUs and gloo on CPUs; a few untimed calls, then --iters timed ones. Reported as nccl-tests does:
algorithm bandwidth = size / time, bus bandwidth = algorithm bandwidth x 2(n-1)/n for all-reduce and
x (n-1)/n for the others, the rate each rank's links carry in a ring, the quantity estimation's
`inter_node_gbps` and link bandwidths stand for. Rank 0 prints a table and writes the JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

# torch 2.13 renames reduce_scatter_tensor; 2.11 (the GPU machine's) has only this name
warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor. is deprecated")

OPS = ("all_reduce", "all_gather", "reduce_scatter")


def bus_factor(op: str, n: int) -> float:
    """Ring traffic per rank over the tensor size (nccl-tests' busBw over algBw)."""
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def time_op(op: str, numel: int, device: torch.device, warmup: int, iters: int) -> float:
    """Seconds per call of `op` on a bf16 tensor of `numel` elements (the full tensor), all ranks in step."""
    n = dist.get_world_size()
    full = torch.ones(numel, dtype=torch.bfloat16, device=device)
    part = torch.ones(numel // n, dtype=torch.bfloat16, device=device)
    call = {"all_reduce": lambda: dist.all_reduce(full),
            "all_gather": lambda: dist.all_gather_into_tensor(full, part),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, full)}[op]
    for _ in range(warmup):
        call()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    sync()
    elapsed = torch.tensor([time.perf_counter() - t0], device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time is the collective's
    return elapsed.item() / iters


def measure(sizes_mb: list[float], warmup: int, iters: int) -> dict:
    """{op: [{size_mb, time_ms, algbw_gbps, busbw_gbps}]} on this job's ranks."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    n = dist.get_world_size()
    out = {}
    for op in OPS:
        rows = []
        for mb in sizes_mb:
            numel = max(n, int(mb * 2**20 / 2) // n * n)  # bf16, divisible by the ranks
            t = time_op(op, numel, device, warmup, iters)
            algbw = 2 * numel / t / 1e9
            rows.append({"size_mb": round(2 * numel / 2**20, 2), "time_ms": round(1e3 * t, 4),
                         "algbw_gbps": round(algbw, 3), "busbw_gbps": round(algbw * bus_factor(op, n), 3)})
        out[op] = rows
    return out


def table(results: dict, world: int, backend: str) -> str:
    lines = [f"bus bandwidth, GB/s ({world} ranks, {backend})", "| op | " + " | ".join(
        f"{r['size_mb']:g} MB" for r in results[OPS[0]]) + " |", "|---" * (1 + len(results[OPS[0]])) + "|"]
    for op in OPS:
        lines.append(f"| {op} | " + " | ".join(f"{r['busbw_gbps']:.2f}" for r in results[op]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mb", default="16,64,256", help="tensor sizes, MB (comma-separated)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default="", help="JSON file rank 0 writes")
    a = ap.parse_args(argv)
    if "RANK" not in os.environ:
        print("error: run it under torchrun (torchrun --standalone --nproc-per-node 2 benchmarks/collectives.py)",
              file=sys.stderr)
        return 2
    try:
        sizes = [float(s) for s in a.sizes_mb.split(",")]
    except ValueError:
        print(f"error: --sizes-mb wants comma-separated numbers; got '{a.sizes_mb}'", file=sys.stderr)
        return 2
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    try:
        results = measure(sizes, a.warmup, a.iters)
        if dist.get_rank() == 0:
            env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
            print(table(results, dist.get_world_size(), backend) + (f"\nwith {env}" if env else ""), flush=True)
            if a.out:
                with open(a.out, "w") as fh:
                    json.dump({"world": dist.get_world_size(), "backend": backend, "nccl_env": env, "ops": results},
                              fh, indent=1)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a (multi-GPU) training step's GPU time goes, stream by stream.

    python benchmarks/stream_profile.py --ngpus 4 \\
        --job.config_file train_configs/llama_1.36b_h100.toml --training.dataset synthetic \\
        --parallelism.data_parallel fsdp [any training option]

--ngpus N starts the profile on N GPUs through benchmarks/launch.py (torchrun, the benchmarks'
environment, a timeout) and prints the reports; without it the script profiles the process it runs in.

After 8 warm-up steps it times 4 steps without the profiler, then profiles 4 more (CUDA activity
only) and prints, for the first and the last rank:
- the compute stream (the one with the most GEMM time): its kernel time per step by category (by
  kernel name: "triton f8 cast" is any Triton kernel with a cast or amax fused in), and its idle
  time, with the part of it spent while communication ran on another stream (exposed
  communication). Communication = NCCL kernels, plus copies on other streams (copy-engine
  collectives; host-to-device batch uploads are counted too, they are small);
- how long each runs per step, and how much compute-kernel time overlaps them: the same GEMMs
  taking longer here than in a one-GPU run is the cost of sharing SMs and memory with the
  collectives, which no timeline of exposed communication shows;
- the other streams' kernels (NCCL, copy-engine memcpy, FSDP's copy-in);
- the compute stream's longest idle stretches (over 30 us), by the kernels either side and what the
  other streams ran meanwhile: where in the step it waits, and on what.
Compare a 1-GPU run with the N-GPU one: `--ngpus 1` profiles the same step alone.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time


def category(name: str) -> str:
    low = name.lower()
    if "nccl" in low:
        return "nccl"
    if "cudnn" in low or "flash" in low or "fmha" in low:
        return "attention"
    if "split_with_sizes_copy" in low or "chunk_cat" in low:
        return "fsdp copy"
    if "triton" in low:
        # torchao's float8 casts and amax reductions fuse into Inductor's kernels
        return "triton f8 cast" if ("scaled_mm" in low or "abs" in low or "clamp" in low) else "triton"
    if "nvjet" in low or "gemm" in low or "cutlass" in low or "xmma" in low:
        return "gemm"
    if "master_adamw" in low:
        return "optimizer (MasterAdamW)"
    if "multi_tensor" in low:
        return "foreach"
    if "memcpy" in low:
        return "memcpy"
    if "memset" in low:
        return "memset"
    return "other"


GAP_FLOOR_US = 30  # shorter idle stretches are launch gaps between dependent kernels, not waits
GAPS_SHOWN = 5


def _union(intervals) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def analyse(events: list[dict], steps: float) -> dict:
    """Per-step figures (ms) from Chrome-trace events (`ts`, `dur` in us; `args.stream`)."""
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    by_stream = collections.defaultdict(list)
    for e in kernels:
        by_stream[e["args"].get("stream", -1)].append(e)
    gemm = {s: sum(e["dur"] for e in es if category(e["name"]) == "gemm") for s, es in by_stream.items()}
    cs = max(gemm, key=gemm.get)
    comp = sorted(by_stream[cs], key=lambda e: e["ts"])
    t0, t1 = comp[0]["ts"], max(e["ts"] + e["dur"] for e in comp)

    def spans(keep) -> list[tuple[float, float]]:  # (start, end) of the other streams' events kept
        return sorted((e["ts"], e["ts"] + e["dur"]) for s, es in by_stream.items() if s != cs for e in es if keep(e))

    nccl = spans(lambda e: category(e["name"]) == "nccl")
    # copies on other streams: copy-engine collectives (fsdp_copy_engine_all_gather), batch uploads
    copies = spans(lambda e: e.get("cat") == "gpu_memcpy")
    comm = sorted(nccl + copies)
    cats = collections.Counter()
    for e in comp:
        cats[category(e["name"])] += e["dur"]
    idle = idle_comm = overlap = 0.0
    end, before = t0, comp[0]
    gaps = collections.defaultdict(lambda: [0.0, 0, collections.Counter()])  # (previous kernel, next) -> us, n, beside
    others_events = [e for s, es in by_stream.items() if s != cs for e in es]
    for e in comp:
        s, f = e["ts"], e["ts"] + e["dur"]
        if s > end:
            idle += s - end
            idle_comm += _union([(max(a, end), min(b, s)) for a, b in comm if a < s and b > end])
            if s - end > GAP_FLOOR_US:
                g = gaps[(_short(before["name"]), _short(e["name"]))]
                g[0] += s - end
                g[1] += 1
                for o in others_events:
                    if o["ts"] < s and o["ts"] + o["dur"] > end:
                        g[2][category(o["name"])] += min(o["ts"] + o["dur"], s) - max(o["ts"], end)
        overlap += _union([(max(a, s), min(b, f)) for a, b in comm if a < f and b > s])
        if f > end:
            end, before = f, e
    others = {}
    for s, es in by_stream.items():
        if s != cs:
            c = collections.Counter()
            for e in es:
                c[category(e["name"])] += e["dur"] / 1000 / steps
            others[s] = dict(c.most_common())
    ms = 1000 * steps

    def active(intervals) -> float:  # ms per step within the compute stream's span
        return _union([(max(a, t0), min(b, t1)) for a, b in intervals]) / ms

    return {"stream": cs, "span": (t1 - t0) / ms, "busy": {k: v / ms for k, v in cats.most_common()},
            "idle": idle / ms, "idle_during_comm": idle_comm / ms, "nccl_active": active(nccl),
            "copies_active": active(copies), "compute_overlapping_comm": overlap / ms, "other_streams": others,
            # the idle gaps longer than GAP_FLOOR_US, by the kernels either side, longest first: ms and count per
            # step, and what the other streams ran meanwhile (ms per step by category)
            "gaps": [{"prev_kernel": k[0], "next_kernel": k[1], "ms": us / ms, "per_step": n / steps,
                      "beside": {c: v / ms for c, v in b.most_common()}}
                     for k, (us, n, b) in sorted(gaps.items(), key=lambda kv: -kv[1][0])]}


def report(r: dict, title: str) -> str:
    lines = [f"== {title}",
             f"   compute stream {r['stream']}: span {r['span']:.1f} ms/step, kernels {sum(r['busy'].values()):.1f}, "
             f"idle {r['idle']:.1f} (while communication runs: {r['idle_during_comm']:.1f}); NCCL kernels active "
             f"{r['nccl_active']:.1f}, copies on other streams {r['copies_active']:.1f}, compute kernels "
             f"overlapping either {r['compute_overlapping_comm']:.1f}"]
    lines += [f"   {k:<26} {v:7.2f} ms" for k, v in r["busy"].items()]
    lines += [f"   stream {s}: " + ", ".join(f"{k} {v:.2f}" for k, v in c.items()) for s, c in r["other_streams"].items()]
    for g in r["gaps"][:GAPS_SHOWN]:
        beside = ", ".join(f"{k} {v:.2f}" for k, v in g["beside"].items()) or "nothing"
        lines.append(f"   idle {g['ms']:.2f} ms ({g['per_step']:.1f} a step) after {g['prev_kernel']} before {g['next_kernel']}; "
                     f"beside it: {beside}")
    return "\n".join(lines)


def _short(name: str) -> str:
    return f"{category(name)}:{name[:40]}"


def launch_and_report(ngpus: int, args: list[str]) -> int:
    """Run this script on `ngpus` GPUs through the benchmark launcher; print its reports."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import launch

    rc, text, _ = launch.execute("stream_profile", launch.command(ngpus, [os.path.abspath(__file__), *args]), 900)
    lines = text.splitlines()
    first = next((i for i, ln in enumerate(lines) if ln.startswith("== rank")), len(lines))
    print("\n".join(lines[first:]))
    if rc != 0:
        print(f"stream_profile: {launch.error_line(text, rc, 900)} (whole output: {launch.WORK / 'stream_profile.log'})",
              file=sys.stderr)
    return 0 if rc == 0 else 1


def main() -> None:
    if sys.argv[1:2] == ["--ngpus"] and "LOCAL_RANK" not in os.environ:
        if len(sys.argv) < 3 or not sys.argv[2].isdigit() or int(sys.argv[2]) < 1:
            print("stream_profile: --ngpus takes a positive integer", file=sys.stderr)
            sys.exit(2)
        sys.exit(launch_and_report(int(sys.argv[2]), sys.argv[3:]))
    import torch
    from torch.profiler import ProfilerActivity, profile

    from titanlite.config import load_config
    from titanlite.train import Trainer

    if not torch.cuda.is_available():
        print("stream_profile: needs a CUDA GPU (it reads kernel timelines)", file=sys.stderr)
        sys.exit(2)
    cfg = load_config(sys.argv[1:])
    trainer = Trainer(cfg)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    for _ in range(8):
        trainer.train_step()
    torch.cuda.synchronize()
    steps = 4
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    torch.cuda.synchronize()
    step_ms = 1000 * (time.perf_counter() - t0) / steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            trainer.train_step()
        torch.cuda.synchronize()
    path = os.path.join(cfg.job.dump_folder, f"stream_trace_rank{rank}.json")
    os.makedirs(cfg.job.dump_folder, exist_ok=True)
    prof.export_chrome_trace(path)
    if rank in (0, world - 1):
        time.sleep(0.5 * rank)  # keep the two ranks' reports apart
        tokens = cfg.training.local_batch_size * cfg.training.seq_len * trainer.grad_accum
        with open(path) as fh:
            r = analyse(json.load(fh)["traceEvents"], steps)
        print(report(r, f"rank {rank}/{world}: {step_ms:.1f} ms/step without the profiler "
                        f"({tokens / step_ms * 1000:,.0f} tok/s per GPU); trace {path}"), flush=True)
    trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

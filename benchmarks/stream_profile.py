"""Where a (multi-GPU) training step's GPU time goes, stream by stream.

    python benchmarks/stream_profile.py --ngpus 4 [--out DIR] [--timeout S] \\
        --job.config_file train_configs/llama_1.36b_h100.toml --training.dataset synthetic \\
        --parallelism.data_parallel fsdp [any training option]

--ngpus N starts the profile on N GPUs through benchmarks/launch.py (torchrun, the benchmarks'
environment, killed with every worker after --timeout seconds, 900 unless given) and prints the
reports; without it the script profiles the process it runs in. --out DIR: the reports also go to
DIR/stream_profile.md.

After 8 warm-up steps it times 4 steps without the profiler, then profiles 4 more (CUDA activity
only) and prints, for the first and the last rank:
- the compute stream (the one with the most GEMM time): a table of its step in ms by kernel category
  (CATEGORIES, by kernel name: GEMMs in bf16 and in float8 (cuBLAS's _scaled_mm kernels, named with
  e4m3/e5m2 or, nvjet's, with q/r among their type letters), attention forward and backward (cuDNN,
  flash, mem-efficient, FlexAttention), Inductor's Triton kernels ("triton f8 cast": one with a float8 cast or amax fused in), ATen's element-wise
  kernels, MasterAdamW's Triton update, foreach kernels, FSDP's copies, NCCL), each with its longest
  kernel, and its idle time, with the part of it spent while communication ran on another stream
  (exposed communication). Communication = NCCL kernels, plus copies on other streams (copy-engine
  collectives; host-to-device batch uploads are counted too, they are small);
- how long each runs per step, and how much compute-kernel time overlaps them: the same GEMMs
  taking longer here than in a one-GPU run is the cost of sharing SMs and memory with the
  collectives, which no timeline of exposed communication shows;
- the other streams' kernels (NCCL, copy-engine memcpy, FSDP's copy-in);
- the compute stream's longest idle stretches (over 30 us), by the kernels either side and what the
  other streams ran meanwhile: where in the step it waits, and on what.
Compare a 1-GPU run with the N-GPU one: `--ngpus 1` profiles the same step alone.

    python benchmarks/stream_profile.py --trace A.json [--trace B.json] [--steps N] [--out DIR]

reads traces already written instead (no GPU): titanlite's `--profiling.enable` (one file per rank under
<dump_folder>/profile_traces/), torchtitan's `--profiling.enable_profiling`, any torch.profiler Chrome trace
(.json or .json.gz). The steps a trace holds are its ProfilerStep marks, or --steps N where it has none
(titanlite's). Each trace gets the report above; two or more also get their compute streams' longest kernels
side by side (ms per step, Inductor's numbering of its kernels left out, so that the same fused kernel of two
runs meets), which is where two libraries' steps differ.
"""

from __future__ import annotations

import collections
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import launch  # noqa: E402  (benchmarks/launch.py: the one launcher, its trace reader)


# Kernel name fragments (lower case). Inductor names a generated kernel (triton_poi_/red_/per_) after the ATen ops
# fused into it, which can include _scaled_mm or the attention op: those are matched as Triton before any GEMM or
# attention name. Triton templates (triton_tem_) are FlexAttention or autotuned GEMMs.
GENERATED = ("triton_poi_", "triton_red_", "triton_per_")
F8_CAST = ("scaled_mm", "abs", "clamp")  # torchao's float8 casts and amax reductions, fused into Inductor's kernels
ATTENTION = ("cudnn", "flash", "fmha", "flex_attention")
BACKWARD = ("bprop", "bwd", "backward", "cutlassb")  # cuDNN's bprop, flash-attn's bwd, mem-efficient's fmha_cutlassB
FLOAT8_GEMM = ("e4m3", "e5m2", "fp8", "f8f8")  # cuBLAS's sm90_xmma _scaled_mm kernels carry their operand types
# cuBLAS's nvjet kernels carry them as letters after the architecture: nvjet_sm90_qqtst_... (q e4m3, r e5m2; t bf16,
# s fp32, h fp16), as torch 2.11's cuBLAS names its float8 GEMMs on H200; only a group of such letters is read as
# types (a word there, "reduce" say, is not)
NVJET_TYPES = re.compile(r"nvjet_(?:sm\d+_)?([bcdehiqrstz]{2,6})_")
GEMM = ("nvjet", "gemm", "cutlass", "xmma", "cublas", "triton_tem_")
CATEGORIES = ("gemm bf16", "gemm float8", "attention fwd", "attention bwd", "triton", "triton f8 cast",
              "elementwise (aten)", "optimizer (MasterAdamW)", "foreach", "fsdp copy", "nccl", "memcpy", "memset",
              "other")


def category(name: str) -> str:
    """The kernel's category, one of CATEGORIES, by its name."""
    low = name.lower()
    if "nccl" in low:
        return "nccl"
    if "master_adamw" in low:  # titanlite/ops/master_adamw.py's Triton kernels: _master_adamw_kernel, _many_kernel
        return "optimizer (MasterAdamW)"
    if low.startswith(GENERATED) or ("triton" in low and not low.startswith("triton_tem_")):
        return "triton f8 cast" if any(f in low for f in F8_CAST) else "triton"
    if any(f in low for f in ATTENTION):
        return "attention bwd" if any(f in low for f in BACKWARD) else "attention fwd"
    if "split_with_sizes_copy" in low or "chunk_cat" in low:
        return "fsdp copy"
    if any(f in low for f in GEMM):
        nvjet = NVJET_TYPES.search(low)
        float8 = any(f in low for f in FLOAT8_GEMM) or (nvjet is not None and bool(set(nvjet.group(1)) & set("qr")))
        return "gemm float8" if float8 else "gemm bf16"
    if "multi_tensor" in low or "foreach" in low:
        return "foreach"
    if "memcpy" in low:
        return "memcpy"
    if "memset" in low:
        return "memset"
    if "at::native" in low or "elementwise" in low or "reduce_kernel" in low:
        return "elementwise (aten)"
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
        by_stream[e.get("args", {}).get("stream", -1)].append(e)
    gemm = {s: sum(e["dur"] for e in es if category(e["name"]).startswith("gemm")) for s, es in by_stream.items()}
    cs = max(gemm, key=gemm.get)
    comp = sorted(by_stream[cs], key=lambda e: e["ts"])
    t0, t1 = comp[0]["ts"], max(e["ts"] + e["dur"] for e in comp)

    def spans(keep) -> list[tuple[float, float]]:  # (start, end) of the other streams' events kept
        return sorted((e["ts"], e["ts"] + e["dur"]) for s, es in by_stream.items() if s != cs for e in es if keep(e))

    nccl = spans(lambda e: category(e["name"]) == "nccl")
    # copies on other streams: copy-engine collectives (fsdp_copy_engine_all_gather), batch uploads
    copies = spans(lambda e: e.get("cat") == "gpu_memcpy")
    comm = sorted(nccl + copies)
    cats, names = collections.Counter(), collections.defaultdict(collections.Counter)
    for e in comp:
        cats[category(e["name"])] += e["dur"]
        names[category(e["name"])][e["name"]] += e["dur"]
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

    per_kernel = collections.Counter()
    for e in comp:
        per_kernel[re.sub(r"_\d+$", "", e["name"])] += e["dur"] / ms
    return {"stream": cs, "span": (t1 - t0) / ms, "busy": {k: v / ms for k, v in cats.most_common()},
            # every kernel of the compute stream (ms per step), Inductor's trailing number left out
            "kernels": dict(per_kernel.most_common()),
            "idle": idle / ms, "idle_during_comm": idle_comm / ms, "nccl_active": active(nccl),
            "copies_active": active(copies), "compute_overlapping_comm": overlap / ms, "other_streams": others,
            # each category's longest kernel on the compute stream (ms per step): what a category holds
            "top_kernel": {c: (n.most_common(1)[0][0], n.most_common(1)[0][1] / ms) for c, n in names.items()},
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
    lines += ["", step_table(r), ""]
    lines += [f"   stream {s}: " + ", ".join(f"{k} {v:.2f}" for k, v in c.items()) for s, c in r["other_streams"].items()]
    for g in r["gaps"][:GAPS_SHOWN]:
        beside = ", ".join(f"{k} {v:.2f}" for k, v in g["beside"].items()) or "nothing"
        lines.append(f"   idle {g['ms']:.2f} ms ({g['per_step']:.1f} a step) after {g['prev_kernel']} before {g['next_kernel']}; "
                     f"beside it: {beside}")
    return "\n".join(lines)


def step_table(r: dict) -> str:
    """Markdown: the compute stream's step, ms per step by kernel category (CATEGORIES' order) and its idle time,
    each with its share of the step (the stream's span) and the category's longest kernel."""
    span = r["span"] or float("nan")
    lines = ["| compute stream, per step | ms | % of step | longest kernel (ms) |", "|---|---|---|---|"]
    for c in [*CATEGORIES, *sorted(set(r["busy"]) - set(CATEGORIES))]:
        if c in r["busy"]:
            name, ms = r.get("top_kernel", {}).get(c, ("", 0.0))
            lines.append(f"| {c} | {r['busy'][c]:.2f} | {100 * r['busy'][c] / span:.1f} | {name[:70]} ({ms:.2f}) |")
    for label, ms in (("idle while communication runs", r["idle_during_comm"]),
                      ("idle otherwise", r["idle"] - r["idle_during_comm"])):
        lines.append(f"| {label} | {ms:.2f} | {100 * ms / span:.1f} | |")
    lines.append(f"| step (the stream's span) | {r['span']:.2f} | 100.0 | |")
    return "\n".join(lines)


def side_by_side(reports: list[tuple[str, dict]], rows: int = 20) -> str:
    """Markdown: the longest kernels of the compute streams of several analysed traces, ms per step in each
    (`reports`: (label, analyse's result)), longest first by their largest figure (ties by name)."""
    names = {n for _, r in reports for n in r["kernels"]}
    top = sorted(names, key=lambda n: (-max(r["kernels"].get(n, 0.0) for _, r in reports), n))[:rows]
    lines = ["| kernel | category | " + " | ".join(label for label, _ in reports) + " |",
             "|---|---|" + "---|" * len(reports)]
    for n in top:
        lines.append(f"| {n[:90]} | {category(n)} | " + " | ".join(f"{r['kernels'][n]:.2f}" if n in r["kernels"] else "-"
                                                               for _, r in reports) + " |")
    lines.append("| compute-stream kernels | - | " + " | ".join(f"{sum(r['busy'].values()):.2f}" for _, r in reports) + " |")
    return "\n".join(lines)


def labels(paths: list[str]) -> list[str]:
    """Each path by its shortest ending (in folders) that no other path shares: the column names of side_by_side."""
    parts = [os.path.normpath(p).split(os.sep) for p in paths]
    for k in range(1, max(len(q) for q in parts) + 1):
        ends = ["/".join(q[-k:]) for q in parts]
        if len(set(ends)) == len(ends):
            return ends
    return [f"{i + 1}: {p}" for i, p in enumerate(paths)]  # the same file given twice


def read_traces(paths: list[str], steps: int = 0, out: str = "") -> int:
    """The reports of Chrome traces written before (`--trace`); 2 on a file that cannot be read, one line."""
    reports, texts = [], []
    for path, label in zip(paths, labels(paths)):
        try:
            events = launch.trace_events(path)
        except (OSError, ValueError) as e:
            print(f"stream_profile: cannot read the trace {path}: {e.__class__.__name__}: {e}", file=sys.stderr)
            return 2
        if events is None:
            print(f"stream_profile: {path} is not a Chrome trace (a list of events, or an object with traceEvents)",
                  file=sys.stderr)
            return 2
        # a profiled step is marked once on the host and once on the GPU (gpu_user_annotation): count the host's
        marks = sum(1 for e in events if str(e.get("name", "")).startswith("ProfilerStep#")
                    and e.get("cat") != "gpu_user_annotation")
        n = marks or steps
        if not n:
            print(f"stream_profile: {path} has no ProfilerStep marks: give --steps N, the steps it holds", file=sys.stderr)
            return 2
        if not any(e.get("cat") == "kernel" and "dur" in e for e in events):
            print(f"stream_profile: {path} holds no GPU kernels (a trace of CUDA activity is needed)", file=sys.stderr)
            return 2
        r = analyse(events, n)
        reports.append((label, r))
        texts.append(report(r, f"{path}: {n} steps"))
    if len(reports) > 1:
        texts.append(side_by_side(reports))
    text = "\n\n".join(texts)
    print(text)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "stream_profile.md"), "w") as fh:
            given = f" --steps {steps}" if steps else ""
            fh.write(f"stream_profile.py{given} {' '.join('--trace ' + p for p in paths)}\n\n{text}\n")
    return 0


def _short(name: str) -> str:
    return f"{category(name)}:{name[:40]}"


# this script's options, before the training options: --trace repeats, --out and --trace take a path
OWN = {"--ngpus": 0, "--out": "", "--timeout": 900, "--trace": (), "--steps": 0}


def own_options(argv: list[str]) -> tuple[dict, list[str]]:
    """The leading --ngpus N, --out DIR, --timeout S, --trace FILE (repeated), --steps N (any order, `--x v` or
    `--x=v`) and the training options after them. A bad value is one line on stderr and exit 2."""
    opts, i = dict(OWN), 0
    while i < len(argv) and argv[i].split("=", 1)[0] in OWN:
        name, eq, value = argv[i].partition("=")
        if not eq:
            value, i = (argv[i + 1] if i + 1 < len(argv) else ""), i + 1
        i += 1
        if name == "--trace":
            if not value:
                print("stream_profile: --trace takes a path", file=sys.stderr)
                sys.exit(2)
            opts[name] = (*opts[name], value)
        elif name == "--out":
            opts[name] = value
        elif value.isdigit() and int(value) > 0:
            opts[name] = int(value)
        else:
            print(f"stream_profile: {name} takes a positive integer", file=sys.stderr)
            sys.exit(2)
    return opts, argv[i:]


def launch_and_report(ngpus: int, args: list[str], out: str = "", timeout: int = 900) -> int:
    """Run this script on `ngpus` GPUs through the benchmark launcher (its run killed at `timeout` s, every
    worker with it); print its reports, and write them to OUT/stream_profile.md."""
    rc, text, _ = launch.execute("stream_profile", launch.command(ngpus, [os.path.abspath(__file__), *args]), timeout)
    lines = text.splitlines()
    first = next((i for i, ln in enumerate(lines) if ln.startswith("== rank")), len(lines))
    print("\n".join(lines[first:]))
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "stream_profile.md"), "w") as fh:
            fh.write(f"stream_profile.py --ngpus {ngpus} {' '.join(args)}\n\n" + "\n".join(lines[first:]) + "\n")
    if rc != 0:
        print(f"stream_profile: {launch.error_line(text, rc, timeout)} (whole output: {launch.WORK / 'stream_profile.log'})",
              file=sys.stderr)
    return 0 if rc == 0 else 1


def main() -> None:
    opts, args = own_options(sys.argv[1:])
    if opts["--trace"]:
        extra = [o for o in ("--ngpus", "--timeout") if opts[o] != OWN[o]] + args[:1]
        if extra:
            print(f"stream_profile: --trace reads traces written before: it takes no training options, --ngpus or "
                  f"--timeout (got {extra[0]})", file=sys.stderr)
            sys.exit(2)
        sys.exit(read_traces(list(opts["--trace"]), opts["--steps"], opts["--out"]))
    if opts["--steps"]:
        print("stream_profile: --steps counts the steps of a --trace file without ProfilerStep marks", file=sys.stderr)
        sys.exit(2)
    if opts["--ngpus"] and "LOCAL_RANK" not in os.environ:
        sys.exit(launch_and_report(opts["--ngpus"], args, opts["--out"], opts["--timeout"]))
    import torch
    from torch.profiler import ProfilerActivity, profile

    from titanlite.config import load_config
    from titanlite.train import Trainer

    if not torch.cuda.is_available():
        print("stream_profile: needs a CUDA GPU (it reads kernel timelines)", file=sys.stderr)
        sys.exit(2)
    cfg = load_config(args)
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
        r = analyse(launch.trace_events(path), steps)
        text = report(r, f"rank {rank}/{world}: {step_ms:.1f} ms/step without the profiler "
                         f"({tokens / step_ms * 1000:,.0f} tok/s per GPU); trace {path}")
        print(text, flush=True)
        if opts["--out"] and world == 1:  # under torchrun, the launching process writes the ranks' reports
            os.makedirs(opts["--out"], exist_ok=True)
            with open(os.path.join(opts["--out"], "stream_profile.md"), "w") as fh:
                fh.write(text + "\n")
    trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

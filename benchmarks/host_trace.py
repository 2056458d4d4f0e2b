"""Where a step's host time goes, from a profiler trace with Python calls (step_host_time.py --trace).

    python benchmarks/host_trace.py DIR/host_trace.json.gz [--top 20]

Every host event (Python call, op, annotation) is nested by time on its thread; each event's own time
(its length less its children's) goes to the code that ran it: the innermost Python frame on its
stack whose file belongs to a known part (`PARTS`, first match from the inside out), else the
innermost frame's file. Ops with no Python frame above them (the autograd engine's own work on its
thread) count as `autograd engine (C++)`. The table gives each thread's busy time, then per part its
milliseconds and share, then the functions with the most own time.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import launch  # noqa: E402  (benchmarks/launch.py: its trace reader)

# (part, pattern on a Python frame's "file(line): function" name), tried from the innermost frame out
PARTS = (
    ("triton launches", r"triton/|/triton_heuristics\.py|CompiledKernel"),
    ("inductor generated code", r"torchinductor|/tmp/.*/\w{2}/c\w+\.py"),
    ("inductor runtime", r"torch/_inductor/"),
    ("aot autograd runtime", r"torch/_functorch/"),
    ("dynamo (guards, frames)", r"torch/_dynamo/|torch/compiler/"),
    ("fsdp hooks", r"torch/distributed/fsdp/"),
    ("ddp", r"torch/nn/parallel/distributed\.py"),
    ("dtensor", r"torch/distributed/tensor/"),
    ("symmetric memory", r"_symmetric_memory"),
    ("c10d collectives", r"torch/distributed/distributed_c10d\.py|torch/distributed/c10d"),
    ("optimizer", r"titanlite/optim\.py|titanlite/ops/master_adamw\.py|torch/optim/"),
    ("titanlite grads (clip, release)", r"titanlite/parallel/grads\.py"),
    ("titanlite timing hooks", r"titanlite/metrics/"),
    ("titanlite model", r"titanlite/models/|titanlite/ops/"),
    ("titanlite step", r"titanlite/step\.py|titanlite/train\.py"),
    ("autograd (Python)", r"torch/autograd/|torch/_tensor\.py"),
    ("nn.Module calls", r"torch/nn/modules/module\.py"),
    ("data loader", r"torch/utils/data/"),
    ("profiler / benchmark", r"torch/profiler|torch/autograd/profiler|benchmarks/"),
)
ENGINE = "autograd engine (C++)"


def part_of(frames: list[str]) -> str:
    for name in reversed(frames):  # innermost first
        for part, pattern in PARTS:
            if re.search(pattern, name):
                return part
    if frames:
        return "other: " + frames[-1].split("(")[0]
    return ENGINE


def analyse(events: list[dict]) -> dict:
    """{tid: (busy_ms, {part: ms}, {function: ms})} over the trace's host events. Events are cut to the
    span of the recorded ops and each to its parent's end (a Python call still open when recording
    stopped is written as lasting to an arbitrary end)."""
    ops = [e for e in events if e.get("cat") == "cpu_op" and "dur" in e]
    if not ops:
        return {}
    lo, hi = min(e["ts"] for e in ops), max(e["ts"] + e["dur"] for e in ops)
    by_tid = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("python_function", "cpu_op", "user_annotation") and "dur" in e:
            start, end = max(e["ts"], lo), min(e["ts"] + e["dur"], hi)
            if end > start:
                by_tid[e["tid"]].append((start, end, e))
    out = {}
    for tid, evs in by_tid.items():
        if sum(e["cat"] == "cpu_op" for _, _, e in evs) < 10:
            continue  # threads that run no ops: the data loader's feeders and pin thread waiting
        evs.sort(key=lambda x: (x[0], -x[1]))
        ends = [end for _, end, _ in evs]
        own = [end - start for start, end, _ in evs]
        parent = [-1] * len(evs)
        stack: list[int] = []
        busy = 0.0
        for i, (start, _, _) in enumerate(evs):
            while stack and ends[stack[-1]] <= start:
                stack.pop()
            if stack:
                parent[i] = stack[-1]
                ends[i] = min(ends[i], ends[stack[-1]])
                own[i] = ends[i] - start
                own[stack[-1]] -= own[i]
            else:
                busy += own[i]
            stack.append(i)
        parts, funcs = collections.Counter(), collections.Counter()
        frames_of: dict[int, list[str]] = {}
        for i, (_, _, e) in enumerate(evs):  # parents come before children
            up = frames_of.get(parent[i], []) if parent[i] >= 0 else []
            frames_of[i] = up + [e["name"]] if e["cat"] == "python_function" else up
            ms = max(own[i], 0.0) / 1e3
            parts[part_of(frames_of[i])] += ms
            funcs[frames_of[i][-1] if frames_of[i] else e["name"]] += ms
        out[tid] = (busy / 1e3, parts, funcs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    try:
        events = launch.trace_events(a.trace)
    except (OSError, ValueError) as e:
        print(f"host_trace: cannot read {a.trace}: {e}", file=sys.stderr)
        sys.exit(2)
    if events is None:
        print(f"host_trace: cannot read {a.trace}: not a Chrome trace (no traceEvents)", file=sys.stderr)
        sys.exit(2)
    for tid, (busy, parts, funcs) in sorted(analyse(events).items(), key=lambda kv: -kv[1][0]):
        print(f"\n## thread {tid}: {busy:.1f} ms of host events (the step's wall time includes waits outside them)")
        print("| part | ms | share |\n|---|---|---|")
        total = sum(parts.values()) or 1.0
        for part, ms in parts.most_common():
            if ms >= 0.05:
                print(f"| {part} | {ms:.1f} | {ms / total:.0%} |")
        print(f"\nfunctions with the most own time (ops inside a Python call count as its own)")
        for name, ms in funcs.most_common(a.top):
            print(f"- {ms:6.2f} ms  {name[:120]}")


if __name__ == "__main__":
    main()

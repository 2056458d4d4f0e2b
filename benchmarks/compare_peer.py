"""titanlite against torchtitan (the PyTorch reference trainer, "the peer") on identical shapes, in one call.

Each titanlite configuration of the chosen suites and each torchtitan version asked for runs as its
own process through benchmarks/launch.py (a failure is a table row with the line that says why), at
torchtitan's shapes: LLaMA 1.36B, local batch 4, seq 2048, bf16, compile. One table: tokens/s per
GPU, MFU, peak memory, and every titanlite row's ratio to every torchtitan version run beside it (the
same data-parallel mode at the same world size). Only ratios from one call count: the machines drift.

  python benchmarks/compare_peer.py --suite single --peer                   # 1 GPU; torchtitan 0.2.2 and 0.3.0
  python benchmarks/compare_peer.py --only compile --peers 0.2.2 --extra="--model.attention_backend flash_attn_4"
  python benchmarks/compare_peer.py --suite scaling,knobs --ngpus 4 --peer  # several GPUs of one host
--extra adds, beside each configuration, its variant with those options (rows "NAME +EXTRA"): an A/B
of one knob in the same call; give it once per variant. Steady state: launch.steady (log steps after
--skip). Each row on several GPUs gets its weak scaling against its library's one-GPU runs of the same
configuration, from this call or from --baseline files (one-GPU calls run side by side, one per GPU of
the host, before the GPUs are taken together), and each row its spread: how unsteady its log steps were,
the bar a difference between two rows has to clear. Writes compare_peer.md (the table) and
compare_peer.json (every run) to --out.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import launch  # noqa: E402  (benchmarks/launch.py: the one launcher)

COMPILE = ["--compile.enable"]
AUTOCAST = ["--training.bf16_params=false"]  # fp32 weights cast by autocast (the default before bf16 copies)
BF16_MOMENTS = ["--optimizer.moments_dtype", "bfloat16"]
FLOAT8 = ["--float8.enable"]
QWEN3 = ["--model.name", "qwen3", "--model.flavor", "1.8B"]


def _dp(mode: str, *extra: str) -> list[str]:
    return [*COMPILE, "--parallelism.data_parallel", mode, *extra]


# name -> titanlite options on top of launch.PEER_SHAPES. Earlier experiments live in the git history.
SUITES: dict[str, dict[str, list[str]]] = {
    # One GPU: the defaults (eager, and with compile as torchtitan runs) and each opt-in speed knob.
    "single": {
        "eager": [],
        "compile": COMPILE,
        "compile autocast": COMPILE + AUTOCAST,
        "compile bf16_moments": COMPILE + BF16_MOMENTS,
        "compile cuda_graphs": COMPILE + ["--training.cuda_graphs"],
        "compile float8": COMPILE + FLOAT8,
        "compile float8 bf16_moments fast_accum": COMPILE + FLOAT8 + BF16_MOMENTS + ["--float8.backward_fast_accum"],
    },
    # Several GPUs: each data-parallel mode at the same per-GPU work (weak scaling).
    "scaling": {mode: _dp(mode) for mode in ("ddp", "fsdp", "zero1")},
    # Several GPUs: the opt-in communication knobs.
    "knobs": {
        "ddp autocast": _dp("ddp", *AUTOCAST),
        "ddp reduce=bf16": _dp("ddp", "--parallelism.ddp_reduce_dtype", "bfloat16"),
        "fsdp reduce=bf16": _dp("fsdp", "--parallelism.fsdp_reduce_dtype", "bfloat16"),
        "fsdp sm_all_gather": _dp("fsdp", "--parallelism.fsdp_copy_engine_all_gather", "off"),
        "fsdp reshard=never": _dp("fsdp", "--parallelism.fsdp_reshard_after_forward", "never"),
        "fsdp one_block_groups": _dp("fsdp", "--parallelism.fsdp_blocks_per_group", "1"),
    },
    # Qwen3 1.8B (GQA 16/8 heads, qk-norm) at the same batch and sequence.
    "qwen3": {
        "qwen3 compile": QWEN3 + COMPILE,
        "qwen3 compile autocast": QWEN3 + COMPILE + AUTOCAST,
    },
}

# torchtitan's data-parallel modes as its options: fsdp shards over every GPU, ddp replicates.
PEER_MODES = {"fsdp": lambda n: [],
              "ddp": lambda n: ["--parallelism.data_parallel_replicate_degree", str(n),
                                "--parallelism.data_parallel_shard_degree", "1"]}
# torchtitan 0.2.2's float8 (0.3.0 dropped tensorwise float8); the output layer stays bf16, as titanlite's.
PEER_FLOAT8 = ["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.filter_fqns", "output"]


def dp_mode(args: list[str]) -> str:
    """The data-parallel mode a titanlite row runs (titanlite's default, fsdp, when not given)."""
    return next((args[i + 1] for i, x in enumerate(args[:-1]) if x == "--parallelism.data_parallel"), "fsdp")


def configurations(suites: list[str], only: set[str], extras: list[str]) -> list[tuple[str, list[str]]]:
    """(row name, options) of the suites' configurations kept by --only, each followed by its --extra variants."""
    rows = []
    for suite in suites:
        for name, args in SUITES[suite].items():
            if only and name not in only:
                continue
            rows.append((name, args))
            rows += [(f"{name} +{extra.replace('--', '')}", args + shlex.split(extra)) for extra in extras]
    return rows


# titanlite options that do not change what one GPU runs: with one rank every data-parallel mode runs the
# single-device path (so no parallelism.* option reaches it), and the rest say how long and where the run logs
NOT_ONE_GPU_WORK = {"--training.steps", "--metrics.log_freq", "--job.dump_folder"}
NOT_ONE_GPU_SECTION = "--parallelism."


def one_gpu_key(r: launch.Result) -> str:
    """Which one-GPU run a run's weak scaling is taken against: the same torchtitan version, or titanlite
    with the same options (its data-parallel mode aside)."""
    if m := re.match(r"torchtitan_([0-9.]+)_", r.name):
        return f"torchtitan {m.group(1)}"
    args = r.cmd[r.cmd.index("titanlite.train") + 1:] if "titanlite.train" in r.cmd else list(r.cmd)
    kept, i = [], 0
    while i < len(args):
        name = args[i].split("=", 1)[0]
        if name in NOT_ONE_GPU_WORK or name.startswith(NOT_ONE_GPU_SECTION):
            bare = "=" in args[i] or i + 1 == len(args) or args[i + 1].startswith("--")  # no value of its own
            i += 1 if bare else 2
            continue
        kept.append(args[i])
        i += 1
    return "titanlite " + " ".join(kept)


def one_gpu_rates(results: list[launch.Result], skip: int) -> dict[str, float]:
    """one_gpu_key -> the mean tokens/s of the one-GPU runs among `results` (the same configuration run on
    several GPUs of the host, as --baseline files can bring, counts once per GPU)."""
    rates: dict[str, list[float]] = {}
    for r in results:
        if r.ngpus == 1 and not r.error and (tps := r.figures(skip).get("tps_gpu")):
            rates.setdefault(one_gpu_key(r), []).append(tps)
    return {k: sum(v) / len(v) for k, v in rates.items()}


def table(rows: list[tuple[str, launch.Result, dict[str, launch.Result]]], versions: list[str], skip: int,
          baseline: list[launch.Result] = ()) -> str:
    """Markdown table. rows: (label, result, {version: the torchtitan result it is compared with}).
    "of 1 GPU": a run on several GPUs against the one-GPU runs of its library and configuration (one_gpu_key)
    among the rows and `baseline`; "spread %": launch.spread of its steady log steps."""
    base = one_gpu_rates([r for _, r, _ in rows] + list(baseline), skip)
    head = ["config", "GPUs", "tok/s/GPU", "of 1 GPU", "spread %", "MFU %", "alloc GiB", "rsrvd GiB",
            *[f"vs {v}" for v in versions], "note"]
    lines = ["Memory: peaks over the run. torchtitan prints the caching allocator's max reserved memory, so "
             "compare the rsrvd column; titanlite's max allocated is beside it. Weak scaling (of 1 GPU) is "
             "against the mean of the same library's one-GPU runs of the same configuration; spread is the "
             "inter-quartile range of the steady log steps' tokens/s over their mean.",
             "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, r, refs in rows:
        f = r.figures(skip)
        if r.error:
            cells = [label, str(r.ngpus), *["-"] * (6 + len(versions)), r.error]
        else:
            ratios = []
            for v in versions:
                ref = refs.get(v)
                rf = ref.figures(skip) if ref is not None and not ref.error else {}
                ratios.append(f"{f['tps_gpu'] / rf['tps_gpu']:.3f}" if rf.get("tps_gpu") and f.get("tps_gpu") else "-")
            note = r.startup.get("config", {}).get("attention_backend") or ""
            one = base.get(one_gpu_key(r)) if r.ngpus > 1 else None
            scaling = f"{f['tps_gpu'] / one:.1%}" if one and f.get("tps_gpu") else "-"
            cells = [label, str(r.ngpus), launch.fmt(f.get("tps_gpu"), ",.0f"), scaling, launch.fmt(f.get("spread"), ".1f"),
                     launch.fmt(f.get("mfu"), ".1f"), launch.fmt(f.get("mem"), ".2f"), launch.fmt(f.get("reserved"), ".2f"),
                     *ratios, note]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = launch.Parser(__doc__)
    ap.add_argument("--suite", default="single", help=f"comma-separated: {', '.join(SUITES)}")
    ap.add_argument("--only", default="", help="comma-separated configuration names to keep")
    ap.add_argument("--ngpus", default="1", help="comma-separated world sizes")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=15, help="log steps up to this one are warm-up")
    ap.add_argument("--peer", action="store_true", help="run every torchtitan version (same as --peers 0.2.2,0.3.0)")
    ap.add_argument("--peers", default="", help=f"comma-separated torchtitan versions: {', '.join(launch.PEERS)}")
    ap.add_argument("--peer-modes", default="fsdp", help="torchtitan modes on several GPUs: fsdp,ddp")
    ap.add_argument("--peer-float8", action="store_true", help="also torchtitan 0.2.2 with float8 tensorwise")
    ap.add_argument("--peers-only", action="store_true",
                    help="run the torchtitan rows alone (their one-GPU rows on each GPU, for --baseline)")
    ap.add_argument("--extra", action="append", default=[], metavar="OPTIONS",
                    help="titanlite options of a variant row beside each configuration; write --extra=\"--a.b v\" "
                         "(a value that starts with -- needs the =); repeat for more variants")
    ap.add_argument("--baseline", action="append", default=[], metavar="JSON",
                    help="compare_peer.json of one-GPU runs on this host (e.g. one per GPU, run side by side) "
                         "that the weak-scaling column takes beside this call's own; repeat for more")
    ap.add_argument("--timeout", type=int, default=420, help="seconds per run")
    ap.add_argument("--out", default=os.environ.get("OUT", "outputs/compare_peer"))
    a = ap.parse_args(argv)
    unknown = [s for s in a.suite.split(",") if s not in SUITES]
    if unknown:
        ap.error(f"unknown suite {', '.join(unknown)}; choose from {', '.join(SUITES)}")
    a.versions = list(launch.PEERS) if a.peer else [v for v in a.peers.split(",") if v]
    bad = [v for v in a.versions if v not in launch.PEERS] + [m for m in a.peer_modes.split(",") if m not in PEER_MODES]
    if bad:
        ap.error(f"unknown torchtitan version or mode {', '.join(bad)}; versions: {', '.join(launch.PEERS)}, "
                 f"modes: {', '.join(PEER_MODES)}")
    try:
        a.world_sizes = [int(n) for n in a.ngpus.split(",")]
    except ValueError:
        ap.error(f"--ngpus takes comma-separated integers; got {a.ngpus!r}")
    all_names = {n for s in SUITES.values() for n in s}
    missing = set(filter(None, a.only.split(","))) - all_names
    if missing:
        ap.error(f"--only names no configuration: {', '.join(sorted(missing))}")
    try:
        a.baseline_runs = [r for path in a.baseline for r in launch.load(path)]
    except (OSError, ValueError, KeyError, TypeError) as e:
        ap.error(f"--baseline takes compare_peer.json files: {type(e).__name__}: {e}")
    if a.peers_only:
        if not a.versions:
            ap.error("--peers-only runs torchtitan alone: name the versions with --peers or --peer")
        a.rows = []
        return a
    a.rows = configurations(a.suite.split(","), set(filter(None, a.only.split(","))), a.extra)
    if not a.rows:
        ap.error("no configuration of the chosen suites is kept by --only")
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    out = Path(a.out)
    rows = []
    steps = ["--training.steps", str(a.steps)]  # torchtitan runs as many steps as titanlite
    for n in a.world_sizes:
        peers: dict[str, dict[str, launch.Result]] = {}  # mode -> version -> result
        for mode in (["fsdp"] if n == 1 else a.peer_modes.split(",")):
            for v in a.versions:
                r = launch.peer(v, n, PEER_MODES[mode](n) + steps, timeout=a.timeout + 180)
                peers.setdefault(mode, {})[v] = r
                rows.append((f"torchtitan {v}" + (f" {mode}" if n > 1 else ""), r, {}))
        if a.peer_float8:
            r = launch.peer("0.2.2", n, PEER_FLOAT8 + steps, timeout=a.timeout + 180)
            rows.append(("torchtitan 0.2.2 float8", r, {}))
        for name, args in a.rows:
            r = launch.titanlite(re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{name}_{n}gpu"), args, n, a.steps, 5, a.timeout)
            rows.append((name, r, peers.get(dp_mode(args)) or peers.get("fsdp", {})))
    first = next((r for _, r, _ in rows if r.startup), None)
    where = (f"{first.startup['hardware'].get('name')}, torch {first.startup['software'].get('torch')}, "
             if first else "")
    text = (f"{where}LLaMA 1.36B (qwen3 rows: Qwen3 1.8B), local batch 4, seq 2048, {a.steps} steps, "
            f"steady state after step {a.skip}\n\n" + table(rows, a.versions, a.skip, a.baseline_runs))
    print("\n" + text)
    launch.save(out, "compare_peer", text, [r for _, r, _ in rows], {"argv": sys.argv[1:] if argv is None else argv})


if __name__ == "__main__":
    main()

"""titanlite vs the peer (torchtitan 0.2.2) on identical shapes, in one device call.

Runs each titanlite configuration of a suite as its own process (a failure is a table row, not a
crash), runs the peer from its published wheel (../shared/bench/torchtitan_anchor, carried as .bench)
when asked, and prints one table: tokens/s per GPU, MFU, peak memory, titanlite / peer.

  python benchmarks/compare_peer.py --suite h100 --peer          # on 1 GPU
  python benchmarks/compare_peer.py --suite scaling --ngpus 1,2,4 --peer
  python benchmarks/compare_peer.py --only compile --extra="--training.cuda_graphs"   # A/B one knob
Steady state = log steps after --skip (compile and warm-up excluded), averaged.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_parallel import figures, launch  # noqa: E402  (one launcher and one steady-state rule for both)
# On top of gpu_parallel.MODEL (which pins local batch 4 and in-process data; the suites override the batch).
SHAPES = ["--data.num_workers", "2", "--checkpoint.enable=false"]

# name -> extra titanlite arguments (on top of SHAPES). Local batch 4 = the peer's shapes.
SUITES = {
    "h100": {
        "eager": ["--training.local_batch_size", "4", "--compile.enable=false"],
        "compile": ["--training.local_batch_size", "4", "--compile.enable"],
        "compile autocast": ["--training.local_batch_size", "4", "--compile.enable", "--training.bf16_params=false"],
        "compile accum8": ["--training.local_batch_size", "4", "--training.global_batch_size", "32", "--compile.enable"],
        "compile accum8 autocast": ["--training.local_batch_size", "4", "--training.global_batch_size", "32",
                                    "--compile.enable", "--training.bf16_params=false"],
        "compile loss=cross_entropy": ["--training.local_batch_size", "4", "--compile.enable",
                                       "--training.loss", "cross_entropy"],
        "compile fuse_clip=false": ["--training.local_batch_size", "4", "--compile.enable",
                                    "--optimizer.fuse_clip=false"],
        "compile loss_chunk=4096": ["--training.local_batch_size", "4", "--compile.enable",
                                    "--training.loss_chunk_tokens", "4096"],
        "compile loss_chunk=1024": ["--training.local_batch_size", "4", "--compile.enable",
                                    "--training.loss_chunk_tokens", "1024"],
        "compile+float8": ["--training.local_batch_size", "4", "--compile.enable", "--float8.enable"],
        "compile+float8 autocast": ["--training.local_batch_size", "4", "--compile.enable", "--float8.enable",
                                    "--training.bf16_params=false"],
        "compile bf16_params": ["--training.local_batch_size", "4", "--compile.enable", "--training.bf16_params"],
        "compile+float8 bf16_params": ["--training.local_batch_size", "4", "--compile.enable", "--float8.enable",
                                       "--training.bf16_params"],
        "compile bf16_moments": ["--training.local_batch_size", "4", "--compile.enable",
                                 "--optimizer.moments_dtype", "bfloat16"],
        "compile bf16_params bf16_moments": ["--training.local_batch_size", "4", "--compile.enable",
                                             "--training.bf16_params", "--optimizer.moments_dtype", "bfloat16"],
        "compile+float8 bf16_params bf16_moments": ["--training.local_batch_size", "4", "--compile.enable",
                                                    "--float8.enable", "--training.bf16_params",
                                                    "--optimizer.moments_dtype", "bfloat16"],
        "compile+float8 fast_accum": ["--training.local_batch_size", "4", "--compile.enable", "--float8.enable",
                                      "--float8.backward_fast_accum"],
        "compile+float8 bf16_params fast_accum": ["--training.local_batch_size", "4", "--compile.enable",
                                                  "--float8.enable", "--float8.backward_fast_accum",
                                                  "--training.bf16_params"],
        "compile+float8 bf16_params bf16_moments fast_accum": ["--training.local_batch_size", "4", "--compile.enable",
                                                               "--float8.enable", "--float8.backward_fast_accum",
                                                               "--training.bf16_params", "--optimizer.moments_dtype",
                                                               "bfloat16"],
        "compile+cuda_graphs": ["--training.local_batch_size", "4", "--compile.enable", "--training.cuda_graphs"],
        "compile+cuda_graphs bf16_params": ["--training.local_batch_size", "4", "--compile.enable",
                                            "--training.cuda_graphs", "--training.bf16_params"],
    },
    "best": {
        "compile b4": ["--training.local_batch_size", "4", "--compile.enable"],
        "compile b8": ["--training.local_batch_size", "8", "--compile.enable"],
        "compile b8 accum4": ["--training.local_batch_size", "8", "--training.global_batch_size", "32",
                              "--compile.enable"],
        "compile b16 accum2": ["--training.local_batch_size", "16", "--training.global_batch_size", "32",
                               "--compile.enable"],
        "compile b16 accum2 bf16_params": ["--training.local_batch_size", "16", "--training.global_batch_size", "32",
                                           "--compile.enable", "--training.bf16_params"],
        "compile b16 accum2 bf16_params bf16_moments": ["--training.local_batch_size", "16",
                                                        "--training.global_batch_size", "32", "--compile.enable",
                                                        "--training.bf16_params", "--optimizer.moments_dtype",
                                                        "bfloat16"],
    },
    "qwen3": {
        "qwen3 1.8B compile b4": ["--model.name", "qwen3", "--model.flavor", "1.8B", "--training.local_batch_size",
                                  "4", "--compile.enable"],
        "qwen3 1.8B compile b4 bf16_params": ["--model.name", "qwen3", "--model.flavor", "1.8B",
                                              "--training.local_batch_size", "4", "--compile.enable",
                                              "--training.bf16_params"],
        "qwen3 1.8B compile b4 bf16_params bf16_moments": ["--model.name", "qwen3", "--model.flavor", "1.8B",
                                                           "--training.local_batch_size", "4", "--compile.enable",
                                                           "--training.bf16_params", "--optimizer.moments_dtype",
                                                           "bfloat16"],
        "qwen3 1.8B compile b8 accum4": ["--model.name", "qwen3", "--model.flavor", "1.8B",
                                         "--training.local_batch_size", "8", "--training.global_batch_size", "32",
                                         "--compile.enable"],
    },
    "knobs": {  # the data-parallel settings that trade bytes or SMs for overlap (weak-scaling study)
        "ddp bucket_view=false": ["--training.local_batch_size", "4", "--compile.enable", "--parallelism.data_parallel",
                                  "ddp", "--parallelism.ddp_bucket_view=false"],
        "ddp bf16_params": ["--training.local_batch_size", "4", "--compile.enable", "--parallelism.data_parallel",
                            "ddp", "--training.bf16_params"],
        "ddp bf16_params bf16_moments": ["--training.local_batch_size", "4", "--compile.enable",
                                         "--parallelism.data_parallel", "ddp", "--training.bf16_params",
                                         "--optimizer.moments_dtype", "bfloat16"],
        "ddp reduce=bf16": ["--training.local_batch_size", "4", "--compile.enable", "--parallelism.data_parallel", "ddp",
                            "--parallelism.ddp_reduce_dtype", "bfloat16"],
        "fsdp reduce=bf16": ["--training.local_batch_size", "4", "--compile.enable", "--parallelism.data_parallel",
                             "fsdp", "--parallelism.fsdp_reduce_dtype", "bfloat16"],
        "fsdp copy_engine": ["--training.local_batch_size", "4", "--compile.enable", "--parallelism.data_parallel",
                             "fsdp", "--parallelism.fsdp_copy_engine_all_gather"],
        "fsdp reduce=bf16 copy_engine": ["--training.local_batch_size", "4", "--compile.enable",
                                         "--parallelism.data_parallel", "fsdp", "--parallelism.fsdp_reduce_dtype",
                                         "bfloat16", "--parallelism.fsdp_copy_engine_all_gather"],
        "fsdp reshard=never": ["--training.local_batch_size", "4", "--compile.enable", "--parallelism.data_parallel",
                               "fsdp", "--parallelism.fsdp_reshard_after_forward", "never"],
    },
    "scaling": {
        "ddp": ["--training.local_batch_size", "4", "--compile.enable", "--parallelism.data_parallel", "ddp"],
        "fsdp": ["--training.local_batch_size", "4", "--compile.enable", "--parallelism.data_parallel", "fsdp"],
        "zero1": ["--training.local_batch_size", "4", "--compile.enable", "--parallelism.data_parallel", "zero1"],
    },
}


def run_titanlite(name: str, args: list[str], ngpu: int, steps: int, skip: int, out: Path, timeout: int) -> dict:
    """One titanlite configuration through gpu_parallel's launcher; steady-state figures or an error."""
    res = launch(re.sub(r"[^A-Za-z0-9_.-]", "_", f"{name}_{ngpu}gpu"), ngpu, SHAPES + args, steps, 5, timeout, out)
    if res["error"]:
        return {"error": res["error"]}
    f = figures(res, skip)
    return {"tps_gpu": f["tps_gpu"], "mfu": f["mfu"], "mem": f["mem"], "reserved": f["reserved"],
            "wall": res["wall_s"], "backend": res["log"]["startup_info"]["config"].get("attention_backend")}


PEER_LINE = re.compile(r"step:\s*(\d+).*memory:\s*([\d.]+)GiB.*tps:\s*([\d,]+).*mfu:\s*([\d.]+)%")


def run_peer(ngpu: int, overrides: list[str], skip: int, out: Path, timeout: int) -> dict:
    script = ROOT / ".bench" / "torchtitan_anchor" / "run.sh"
    if not script.exists():
        return {"error": "peer not carried (.bench missing)"}
    try:
        r = subprocess.run(["bash", str(script), str(ngpu), *overrides], cwd=ROOT, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout}s"}
    (out / f"peer_{ngpu}gpu{'_'.join(overrides).replace('-', '')}.log").write_text(r.stdout + r.stderr)
    rows = [(int(m[1]), float(m[2]), float(m[3].replace(",", "")), float(m[4])) for m in PEER_LINE.finditer(r.stdout)]
    steady = [x for x in rows if x[0] > skip]
    if not steady:
        return {"error": "no step lines from the peer"}
    # torchtitan's "memory" is the caching allocator's max reserved, so it is compared with ours
    return {"tps_gpu": sum(x[2] for x in steady) / len(steady), "mfu": sum(x[3] for x in steady) / len(steady),
            "mem": None, "reserved": max(x[1] for x in steady)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="h100", help=f"comma-separated: {', '.join(SUITES)}")
    ap.add_argument("--only", default="", help="comma-separated config names to keep")
    ap.add_argument("--ngpus", default="1", help="comma-separated world sizes")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=15, help="log steps <= this are warm-up")
    ap.add_argument("--peer", action="store_true", help="also run the peer at each world size (bf16)")
    ap.add_argument("--peer-float8", action="store_true", help="also run the peer with float8 tensorwise")
    ap.add_argument("--peer-modes", default="fsdp", help="peer parallel modes for >1 GPU: fsdp,ddp")
    ap.add_argument("--extra", default="", help="titanlite arguments appended to every configuration "
                    "(its rows are named 'NAME +EXTRA'), for A/B of one knob against the suite; write it "
                    "--extra=\"--a.b ...\" (a value starting with -- needs the =)")
    ap.add_argument("--timeout", type=int, default=420)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/compare_peer"))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    only = set(filter(None, a.only.split(",")))
    rows = []
    for ngpu in map(int, a.ngpus.split(",")):
        peer = {}
        if a.peer:
            modes = ["fsdp"] if ngpu == 1 else a.peer_modes.split(",")
            for mode in modes:
                ov = [] if mode == "fsdp" else ["--parallelism.data_parallel_replicate_degree", str(ngpu),
                                               "--parallelism.data_parallel_shard_degree", "1"]
                peer[mode] = run_peer(ngpu, ov, a.skip, out, a.timeout)
                rows.append((f"peer {mode if ngpu > 1 else 'bf16+compile'}", ngpu, peer[mode], None))
                print(f"[{time.strftime('%H:%M:%S')}] peer {mode} {ngpu} GPU: {peer[mode]}", flush=True)
        if a.peer_float8:
            pf8 = run_peer(ngpu, ["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.filter_fqns", "output"], a.skip, out, a.timeout)
            rows.append(("peer +float8", ngpu, pf8, None))
            print(f"[{time.strftime('%H:%M:%S')}] peer float8 {ngpu} GPU: {pf8}", flush=True)
        for suite in a.suite.split(","):
            for name, args in SUITES[suite].items():
                if only and name not in only:
                    continue
                if a.extra:
                    name, args = f"{name} +{a.extra.replace('--', '')}", args + shlex.split(a.extra)
                res = run_titanlite(name, args, ngpu, a.steps, a.skip, out, a.timeout)
                mode = next((args[i + 1] for i, x in enumerate(args) if x == "--parallelism.data_parallel"), "fsdp")
                ref = peer.get(mode) or peer.get("fsdp")
                rows.append((name, ngpu, res, ref))
                print(f"[{time.strftime('%H:%M:%S')}] {name} {ngpu} GPU: {res}", flush=True)
    print(f"\n{'config':<30} {'GPUs':>4} {'tok/s/GPU':>10} {'MFU %':>7} {'alloc GiB':>9} {'rsrvd GiB':>9} "
          f"{'vs peer':>8}  note")
    print("-" * 94)
    for name, ngpu, r, ref in rows:
        if "error" in r:
            print(f"{name:<30} {ngpu:>4} {'-':>10} {'-':>7} {'-':>9} {'-':>9} {'-':>8}  {r['error']}")
            continue
        ratio = f"{r['tps_gpu'] / ref['tps_gpu']:.3f}" if ref and "error" not in ref else "-"
        mfu = f"{r['mfu']:.1f}" if r.get("mfu") is not None else "-"
        alloc = f"{r['mem']:.1f}" if r.get("mem") is not None else "-"
        print(f"{name:<30} {ngpu:>4} {r['tps_gpu']:>10,.0f} {mfu:>7} {alloc:>9} {r['reserved']:>9.1f} {ratio:>8}  "
              f"{r.get('backend') or ''}")


if __name__ == "__main__":
    main()

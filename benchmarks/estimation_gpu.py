"""Predicted vs measured: peak memory, tokens/s and the largest batch, for LLaMA 1.36B on real GPUs.

    python benchmarks/estimation_gpu.py                 # 1 GPU: batch 2/4/8, AC full, float8, OOM search
    python benchmarks/estimation_gpu.py --only fsdp2    # needs 2 GPUs: fsdp over 2 ranks
    python benchmarks/estimation_gpu.py --compile       # the same with torch.compile (memory is predicted eager)

Each measured run is the real trainer (torchrun, synthetic data, a few steps) in a subprocess; its
peak is torch.cuda.max_memory_allocated from the run log, its tokens/s the mean after the first log
step. Predictions come from estimation.estimate on fake tensors (CPU), with the GPU picked from the
device name. The OOM search probes the real trainer at growing batches until one fails. Prints a table.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BASE = ["--job.config_file", os.path.join(ROOT, "train_configs/llama_1.36b_h100.toml"), "--training.steps", "8",
        "--metrics.log_freq", "4", "--validation.enable=false", "--checkpoint.enable=false",
        "--metrics.progress_bar=false", "--training.dataset", "synthetic", "--data.num_workers", "0"]

CASES = {  # name -> (ranks, overrides)
    "b2": (1, ["--training.local_batch_size", "2"]),
    "b4": (1, ["--training.local_batch_size", "4"]),
    "b8": (1, ["--training.local_batch_size", "8"]),
    "b8_ac_full": (1, ["--training.local_batch_size", "8", "--activation_checkpoint.mode", "full"]),
    "b4_float8": (1, ["--training.local_batch_size", "4", "--float8.enable"]),
    "b4_bf16_params": (1, ["--training.local_batch_size", "4", "--training.bf16_params"]),
    "b4_bf16_params_bf16_moments": (1, ["--training.local_batch_size", "4", "--training.bf16_params",
                                        "--optimizer.moments_dtype", "bfloat16"]),
    "fsdp2_b4": (2, ["--training.local_batch_size", "4", "--parallelism.data_parallel", "fsdp"]),
}


def hardware_name() -> str:
    import torch

    from titanlite.hardware import lookup

    hw = lookup(torch.cuda.get_device_name(0))
    if hw is None:
        raise SystemExit(f"no row in titanlite/hardware.py for '{torch.cuda.get_device_name(0)}'")
    return hw.key


def measure(ranks: int, overrides: list[str], timeout: int = 240) -> dict | None:
    """Run the trainer; None if it ran out of memory (or failed)."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
               "-m", "titanlite.train", *BASE, *overrides, "--job.dump_folder", out]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        logs = glob.glob(os.path.join(out, "run_*.json"))
        if p.returncode != 0 or not logs:
            oom = "out of memory" in (p.stderr + p.stdout).lower()
            if not oom:
                print(f"  run failed ({' '.join(overrides)}): {p.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            return None
        s = json.load(open(logs[0]))["summary"]
        return {"peak_gib": s["peak_memory_gb"], "tokens_per_sec": s.get("tokens_per_sec")}


def predict(ranks: int, overrides: list[str], hw: str, search: bool = False) -> dict:
    from estimation.estimate import estimate
    from titanlite.config import load_config

    cfg = load_config(BASE + overrides + ["--estimate.ngpu", str(ranks), "--estimate.hardware", hw,
                                          f"--estimate.search={str(search).lower()}"])
    return estimate(cfg, progress=lambda m: None)


def oom_boundary(guess: int, extra: list[str], limit: int = 64) -> int:
    """Largest local batch the real trainer runs on one GPU. The prediction and one past it settle
    it when the prediction is right; otherwise bisect (doubling first while everything fits)."""
    def ok(b):
        r = measure(1, ["--training.local_batch_size", str(b), "--training.steps", "2", "--metrics.log_freq", "1"]
                    + extra) is not None
        print(f"  oom search: batch {b} {'ok' if r else 'OOM'}", file=sys.stderr)
        return r

    lo, hi = 0, limit + 1
    for b in (guess, guess + 1):
        if ok(b):
            lo = max(lo, b)
        else:
            hi = min(hi, b)
            break
    while hi - lo > 1:
        b = min(2 * lo, hi - 1) if hi == limit + 1 and lo else (lo + hi) // 2
        if ok(b):
            lo = b
        else:
            hi = b
    return lo


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="comma-separated case names (default: every case that fits the GPUs)")
    ap.add_argument("--compile", action="store_true", help="measure with torch.compile")
    ap.add_argument("--no-oom-search", action="store_true")
    ap.add_argument("--oom-search", action="store_true", help="search the OOM boundary even with --only")
    opts = ap.parse_args()
    import torch

    hw, ngpu = hardware_name(), torch.cuda.device_count()
    print(f"# {torch.cuda.get_device_name(0)} x {ngpu}: total_memory "
          f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.2f} GiB (table: estimation hardware '{hw}')")
    names = [n for n in opts.only.split(",") if n] if opts.only else [n for n, (r, _) in CASES.items() if r <= ngpu]
    extra = ["--compile.enable"] if opts.compile else ["--compile.enable=false"]
    rows, t0 = [], time.time()
    for name in names:
        ranks, ov = CASES[name]
        ov = ov + extra
        m = measure(ranks, ov)
        p = predict(ranks, ov, hw)
        pm, pt = p["memory"]["peak_gib"], p["throughput"]["overlap"]["tokens_per_sec"]
        rows.append((name, ranks, pm, m and m["peak_gib"], pt, m and m["tokens_per_sec"], p["throughput"]["dominant"]))
        print(f"  {name}: done [{time.time() - t0:.0f}s]", file=sys.stderr)
    print("| case | GPUs | predicted peak GiB | measured peak GiB | err % | predicted tok/s | measured tok/s | "
          "err % | dominant term |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r, pm, mm, pt, mt, dom in rows:
        em = f"{100 * (pm - mm) / mm:+.1f}" if mm else "-"
        et = f"{100 * (pt - mt) / mt:+.1f}" if mt else "-"
        print(f"| {name} | {r} | {pm:.2f} | {mm if mm is not None else 'failed'} | {em} | {pt:,.0f} | "
              f"{f'{mt:,.0f}' if mt else '-'} | {et} | {dom} |")
    if not opts.no_oom_search and (not opts.only or opts.oom_search):
        pred = predict(1, ["--training.local_batch_size", "8"] + extra, hw, search=True)["batch_search"]
        real = oom_boundary(max(1, pred["largest_local_batch"]), extra)
        print(f"\nlargest local batch on 1 x {hw}: predicted {pred['largest_local_batch']}, measured {real} "
              f"[{time.time() - t0:.0f}s]")


if __name__ == "__main__":
    main()

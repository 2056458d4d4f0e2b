"""GPU benchmark of the parallelism features: LLaMA 1.36B, local batch 4, seq 2048, synthetic data.

Groups (each fits one ~8-minute device call; pick with --group):
  single  1 GPU: eager, compile, compile+float8, compile+cuda_graphs
  multi   N GPUs (torchrun): ddp, fsdp, zero1 (with compile)
  graphs  per-step losses over 20 steps, CUDA graphs (captured after 5 warm-up steps; 11 under DDP)
          against the same run never captured (cuda_graphs_warmup past the last step: the same
          capturable AdamW, run eagerly), so any difference from the capture on is the replay's:
          1 GPU, and DDP on 2 GPUs if present

Every configuration runs as its own subprocess with a timeout; a failure or a timeout becomes a row
of the table, not a crash. Figures come from the run log's summary and iterations:
tokens/s and MFU averaged over steps 11-30 (the first 10 hold compilation and graph capture),
tokens/s per GPU = tokens/s / GPUs, peak memory = max allocated over the run.

  python benchmarks/gpu_parallel.py --group single
  python benchmarks/gpu_parallel.py --group multi --ngpus 4
  python benchmarks/gpu_parallel.py --group graphs [--flavor debug] [--ngpus 1|2] [--noise]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The lent GPU machines offer no NVLink multicast (NVLS): NCCL, torch's symmetric memory and NVSHMEM
# are told not to try it. A setting of these machines, so it lives here, not in run_train.sh.
LENT_MACHINE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

MODEL = ["--model.name", "llama", "--model.flavor", "1.36B", "--training.dataset", "synthetic",
         "--training.local_batch_size", "4", "--training.seq_len", "2048", "--validation.enable=false",
         "--metrics.progress_bar=false", "--lr_scheduler.warmup_steps", "10", "--data.num_workers", "0"]
COMPILE = ["--compile.enable"]

SINGLE = {
    "eager": [],
    "compile": COMPILE,
    "compile+float8": COMPILE + ["--float8.enable"],
    "compile+cuda_graphs": COMPILE + ["--training.cuda_graphs", "--training.cuda_graphs_warmup", "5"],
}
MULTI = {mode: COMPILE + ["--parallelism.data_parallel", mode] for mode in ("ddp", "fsdp", "zero1")}


def launch(name: str, ngpus: int, extra: list[str], steps: int, log_freq: int, timeout: int, folder: Path) -> dict:
    """Run one configuration; return its run log (or an error) and the tail of its output."""
    out = folder / name.replace("+", "_")
    args = [*MODEL, *extra, "--training.steps", str(steps), "--metrics.log_freq", str(log_freq),
            "--job.dump_folder", str(out)]
    if ngpus == 1:
        cmd = [sys.executable, "-m", "titanlite.train", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ngpus}",
               "-m", "titanlite.train", *args]
    env = {**os.environ, **LENT_MACHINE_ENV}
    t0 = time.time()
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        text, rc = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        text, rc = ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")), None
    (folder / f"{out.name}.log").write_text(text)  # the whole output, beside the run folder
    logs = sorted(out.glob("run_*.json"))
    log = json.loads(logs[-1].read_text()) if logs else None
    error = None
    if rc is None:
        error = f"timeout after {timeout}s"
    elif rc != 0:
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        error = f"exit {rc}: {lines[-1][:160] if lines else ''}"
    notes = [ln.strip()[:160] for ln in text.splitlines()
             if not ln.startswith("run log") and ("CUDA graph" in ln or "cuda_graphs" in ln)]
    return {"name": name, "ngpus": ngpus, "log": log, "error": error, "notes": notes, "wall_s": time.time() - t0,
            "cmd": "python " + " ".join(cmd[1:])}


def figures(res: dict, skip: int = 10) -> dict:
    """Steady-state tokens/s, tokens/s/GPU, MFU and peak memory from a run log."""
    its = (res["log"] or {}).get("training_iterations", [])
    steady = [e for e in its if e["iter"] > skip] or its[1:] or its
    if not steady:
        return {}
    mean = lambda k: sum(e[k] for e in steady) / len(steady) if steady[0].get(k) is not None else None
    return {"tps": mean("tokens_per_sec"), "tps_gpu": mean("tokens_per_sec_per_gpu"), "mfu": mean("mfu"),
            "mem": max(e["memory_peak_gb"] for e in its), "ms": mean("time_ms"),
            "reserved": max(e.get("memory_reserved_peak_gb", 0) for e in its)}


def print_table(rows: list[dict]) -> None:
    print(f"\n{'config':<22} {'GPUs':>4} {'tokens/s':>10} {'tok/s/GPU':>10} {'MFU %':>6} {'ms/step':>8} "
          f"{'peak GiB':>8}  status")
    for r in rows:
        f = figures(r)
        fmt = lambda v, spec: format(v, spec) if v is not None else "-"
        status = r["error"] or "ok"
        print(f"{r['name']:<22} {r['ngpus']:>4} {fmt(f.get('tps'), ',.0f'):>10} {fmt(f.get('tps_gpu'), ',.0f'):>10} "
              f"{fmt(f.get('mfu'), '.1f'):>6} {fmt(f.get('ms'), '.0f'):>8} {fmt(f.get('mem'), '.1f'):>8}  {status}")
        for n in r["notes"][:3]:
            print(f"{'':<28}note: {n}")
    print("\ncommands (run from the repository root):")
    for r in rows:
        print(f"  [{r['name']}] {r['cmd']}")


def step_losses(res: dict) -> list[float]:
    its = (res["log"] or {}).get("training_iterations", [])
    return [v for e in its for v in e.get("step_losses", [e["loss"]])]


def compare_losses(pairs: list[tuple[dict, dict]]) -> None:
    """Per-step losses of eager vs CUDA-graph runs, with the largest relative difference."""
    for eager, graph in pairs:
        a, b = step_losses(eager), step_losses(graph)
        print(f"\n{graph['name']} vs {eager['name']} ({graph['ngpus']} GPU)")
        if eager["error"] or graph["error"] or not a or len(a) != len(b):
            print(f"  not comparable: eager {eager['error'] or len(a)} / graphs {graph['error'] or len(b)}")
            continue
        label = "graphs" if "graphs" in graph["name"] else "again"
        print(f"  {'step':>4} {'eager':>12} {label:>12} {'rel diff':>10}")
        for i, (x, y) in enumerate(zip(a, b), 1):
            print(f"  {i:>4} {x:>12.6f} {y:>12.6f} {abs(x - y) / abs(x):>10.2e}")
        worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
        captured = any("captured the training step" in n for n in graph["notes"])
        print(f"  max relative difference {worst:.2e}" + (f"; graph captured: {captured}" if "graphs" in graph["name"] else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group", choices=["single", "multi", "graphs"], required=True)
    ap.add_argument("--ngpus", type=int, default=0, help="multi: GPUs to use (default: all visible); graphs: only the "
                                                         "1- or the 2-GPU comparison")
    ap.add_argument("--only", default="", help="comma-separated config names of the group to run")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--timeout", type=int, default=200, help="seconds per configuration")
    ap.add_argument("--flavor", default="1.36B", help="LLaMA flavor (debug: a quick functional check)")
    ap.add_argument("--noise", action="store_true", help="graphs: also repeat the eager run, to show the run-to-run "
                                                         "drift the graph's difference is measured against")
    a = ap.parse_args()
    MODEL[MODEL.index("--model.flavor") + 1] = a.flavor
    import torch

    visible = torch.cuda.device_count()
    if visible == 0:
        sys.exit("error: no CUDA GPU visible; this benchmark runs on the GPU machine")
    print(f"{visible} x {torch.cuda.get_device_name(0)} | torch {torch.__version__} | LLaMA {a.flavor}, local batch 4, "
          f"seq 2048, synthetic data, {a.steps} steps; figures averaged over steps 11-{a.steps}")
    only = set(filter(None, a.only.split(",")))
    folder = Path(tempfile.mkdtemp(prefix="titanlite_bench_"))
    rows = []
    if a.group == "single":
        for name, extra in SINGLE.items():
            if not only or name in only:
                rows.append(launch(name, 1, extra, a.steps, 10, a.timeout, folder))
                print(f"  done {name} in {rows[-1]['wall_s']:.0f}s: {rows[-1]['error'] or 'ok'}", flush=True)
        print_table(rows)
    elif a.group == "multi":
        n = a.ngpus or visible
        for name, extra in MULTI.items():
            if not only or name in only:
                rows.append(launch(name, n, extra, a.steps, 10, a.timeout, folder))
                print(f"  done {name} in {rows[-1]['wall_s']:.0f}s: {rows[-1]['error'] or 'ok'}", flush=True)
        print_table(rows)
    else:
        if a.ngpus not in (0, 1, 2):
            sys.exit("error: --group graphs compares on 1 or 2 GPUs: --ngpus 1 or 2 (or leave it out for both)")
        pairs = []
        graph_args = ["--training.cuda_graphs", "--training.cuda_graphs_warmup", "5"]
        # The reference is not plain eager: capturable AdamW (device-side lr and step) rounds
        # differently from the fused default from step 2 on, which would hide what replay changes.
        never_captured = ["--training.cuda_graphs", "--training.cuda_graphs_warmup", "1000"]
        for n, mode in [(1, []), (2, ["--parallelism.data_parallel", "ddp"])]:
            if a.ngpus and n != a.ngpus:  # --ngpus 1 or 2 runs only that comparison
                continue
            if n > visible:
                print(f"\n(skipping the {n}-GPU comparison: {visible} GPU visible)")
                continue
            tag = "" if n == 1 else "ddp "
            eager = launch(f"{tag}eager_capturable", n, mode + never_captured, 20, 1, a.timeout, folder)
            graph = launch(f"{tag}cuda_graphs", n, mode + graph_args, 20, 1, a.timeout, folder)
            rows += [eager, graph]
            pairs.append((eager, graph))
            if a.noise:  # the same eager run again: how far two identical runs drift apart on their own
                again = launch(f"{tag}eager_capturable_again", n, mode + never_captured, 20, 1, a.timeout, folder)
                rows.append(again)
                pairs.append((eager, again))
        print_table(rows)
        compare_losses(pairs)


if __name__ == "__main__":
    main()

"""Predicted vs measured with torch.compile on (and two eager cases): peak memory, tokens/s, the largest
batch, a kernel profile.

    python benchmarks/estimation_gpu.py                  # 1 GPU: every one-GPU case, OOM search, profile,
                                                         # and the recommendation's top pick
    python benchmarks/estimation_gpu.py --gpus 2         # 2 GPUs: each mode at local 4 and 16, Qwen3 fsdp, ddp with
                                                         # accumulation and with float8 (--gpus 4: the first two, on 4)
    python benchmarks/estimation_gpu.py --only b8,b4     # chosen cases only (also FLOAT8_TOKENS': float8 at
                                                         # local batch 1 to 16, profiled with --profiled)
    python benchmarks/estimation_gpu.py --gpus 2 --only fsdp2_b4 --profiled fsdp2_b4   # and their kernel profile
    python benchmarks/estimation_gpu.py --ac-sweep       # 1 GPU: activation checkpointing none / selective /
                                                         # full x LLaMA 1.36B and Qwen3 1.8B, two batches each

Each measured case is the real trainer (synthetic data, 20 steps) started through benchmarks/launch.py:
the one-GPU cases one after another in one worker process, each OOM probe and multi-GPU case in a
process of its own. Its peak is torch.cuda.max_memory_allocated from the run log, its tokens/s the
launcher's steady-state mean (log steps after step 8). The predictions run at the same time in a
CPU process pool (estimation.estimate on fake tensors, the GPU picked from the device name), as
does the recommendation for the target batch (estimation.recommend), whose top pick is then run
as one more case. A torch.profiler window over the profiled cases sorts kernel time into the
throughput model's terms, which `python -m estimation.calibrate RESULTS.json` turns into rates.

Every run shares one Inductor cache folder (TORCHINDUCTOR_CACHE_DIR), so identical graphs compile
once per call. Results go to --out (default $OUT or .) as estimation_gpu.json (raw: every case's
measured and predicted figures, the search probes, the profile) and estimation_gpu.md (the table).
New cases start only while --budget-s has time left; what finished is written either way.
"""

from __future__ import annotations

import concurrent.futures as futures
import datetime
import glob
import json
import multiprocessing
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import launch  # noqa: E402  (benchmarks/launch.py: the one launcher)
import stream_profile  # noqa: E402  (its category(): the one classifier of kernel names)

H100_CFG = os.path.join(ROOT, "train_configs/llama_1.36b_h100.toml")
B200_CFG = os.path.join(ROOT, "train_configs/llama_1.36b_b200.toml")
QWEN_CFG = os.path.join(ROOT, "train_configs/qwen3_1.8b_b200.toml")
QWEN_H100_CFG = os.path.join(ROOT, "train_configs/qwen3_1.8b_1xh100.toml")
GRAPHS = ["--training.cuda_graphs", "--training.cuda_graphs_warmup", "3"]
RUN = ["--validation.enable=false", "--checkpoint.enable=false", "--metrics.progress_bar=false",
       "--training.dataset", "synthetic", "--data.num_workers", "0", "--compile.enable"]
# steady state: the six log steps after step 8 (compile and the profile fall before it); two were too few
# where a GPU slows for a step now and then (float8 + ddp on 2 x H100: one of the two 30% slow)
STEPS, LOG_FREQ, SKIP = 20, 2, 8

# name -> (GPUs, config file, overrides). One-GPU cases run in this order (the first is profiled too).
CASES = {
    "b8": (1, H100_CFG, ["--training.local_batch_size", "8"]),
    "b4": (1, H100_CFG, ["--training.local_batch_size", "4"]),
    "b16_accum2": (1, H100_CFG, ["--training.local_batch_size", "16", "--training.global_batch_size", "32"]),
    "b8_ac_selective": (1, H100_CFG, ["--training.local_batch_size", "8", "--activation_checkpoint.mode", "selective"]),
    "b16_ac_full": (1, H100_CFG, ["--training.local_batch_size", "16", "--activation_checkpoint.mode", "full"]),
    "b4_float8": (1, H100_CFG, ["--training.local_batch_size", "4", "--float8.enable"]),
    "b4_bf16_params_moments": (1, H100_CFG, ["--training.local_batch_size", "4", "--training.bf16_params",
                                             "--optimizer.moments_dtype", "bfloat16"]),
    "qwen3_b8": (1, QWEN_CFG, ["--training.local_batch_size", "8"]),
    "eager_b4": (1, H100_CFG, ["--training.local_batch_size", "4", "--compile.enable=false"]),
    "eager_b8": (1, H100_CFG, ["--training.local_batch_size", "8", "--compile.enable=false"]),
    "ddp2_b24": (2, B200_CFG, ["--training.local_batch_size", "24"]),
    "fsdp2_b8": (2, H100_CFG, ["--training.local_batch_size", "8", "--parallelism.data_parallel", "fsdp"]),
    # each mode at two batches, and Qwen3: the compute slowed beside the collectives (calibrated on the
    # local-4 llama cases of ddp and fsdp, 2026-11-26; the others are held out)
    **{f"{mode}{'_' if mode[-1].isdigit() else ''}{n}_b{b}": (n, H100_CFG, ["--training.local_batch_size", str(b),
                                                                          "--parallelism.data_parallel", mode])
       for n in (2, 4) for mode in ("ddp", "fsdp", "zero1") for b in (4, 16)},
    **{f"qwen3_fsdp{n}_b8": (n, QWEN_CFG, ["--training.local_batch_size", "8", "--parallelism.data_parallel", "fsdp"])
       for n in (2, 4)},
    # ddp with gradient accumulation (no_sync micro-steps into the buckets), and float8 under ddp (buckets of
    # float8's bf16 gradients beside the fp32 ones)
    "ddp2_b8_accum2": (2, H100_CFG, ["--training.local_batch_size", "8", "--training.global_batch_size", "32",
                                     "--parallelism.data_parallel", "ddp"]),
    "ddp2_b4_accum4": (2, H100_CFG, ["--training.local_batch_size", "4", "--training.global_batch_size", "32",
                                     "--parallelism.data_parallel", "ddp"]),
    "ddp2_b4_float8": (2, H100_CFG, ["--training.local_batch_size", "4", "--parallelism.data_parallel", "ddp",
                                     "--float8.enable"]),
}

# float8's GEMMs and casts by the tokens of a micro-step (bf16 beside it at the smallest), run by name (--only) beside
# b4_float8: at local batch 1 CUDA graphs take the host's launches away (captured after 3 eager steps, before the
# profile's window)
FLOAT8_TOKENS = {
    **{f"b{b}_float8{'_graphs' if b == 1 else ''}": (1, H100_CFG, [
        "--training.local_batch_size", str(b), "--training.global_batch_size", "-1", "--float8.enable",
        *(GRAPHS if b == 1 else [])]) for b in (1, 2, 16)},
    # the rowwise recipe: scales per row (and per column for the backward's operands), its own casts and forward GEMM
    **{f"b{b}_float8_rowwise": (1, H100_CFG, ["--training.local_batch_size", str(b), "--training.global_batch_size",
                                              "-1", "--float8.enable", "--float8.recipe", "rowwise"]) for b in (4, 16)},
    "b1_graphs": (1, H100_CFG, ["--training.local_batch_size", "1", "--training.global_batch_size", "-1", *GRAPHS]),
    "b1_float8_graphs_bf16_moments": (1, H100_CFG, ["--training.local_batch_size", "1", "--training.global_batch_size",
                                                   "-1", "--float8.enable", *GRAPHS, "--optimizer.moments_dtype",
                                                   "bfloat16"]),
}

# Activation checkpointing across both model families (LLaMA: MHA; Qwen3: GQA and QK-norm), compiled, one
# accumulation-free step shape per row, two batches per mode that fit one 80 GB GPU. Memory is the point:
# few steps (SWEEP_STEPS, the last SWEEP_SKIP.. of them timed).
def _sweep() -> dict:
    rows = {"llama": (H100_CFG, {"none": (8, 16), "selective": (8, 20), "full": (16, 48)}),
            "qwen3": (QWEN_H100_CFG, {"none": (4, 8), "selective": (8, 16), "full": (16, 32)})}
    return {f"ac_{model}_{mode}_b{b}": (1, cfg, ["--training.local_batch_size", str(b), "--training.global_batch_size",
                                                 "-1", "--activation_checkpoint.mode", mode])
            for model, (cfg, modes) in rows.items() for mode, batches in modes.items() for b in batches}


AC_SWEEP = _sweep()
SWEEP_STEPS, SWEEP_SKIP = 6, 3
ALL_CASES = {**CASES, **FLOAT8_TOKENS, **AC_SWEEP}
PROFILED = {1: ["b8", "b4_float8", "b4_bf16_params_moments"], 2: ["ddp2_b24", "fsdp2_b8"]}
PROFILE = ["--profiling.enable", "--profiling.start_step", "5", "--profiling.num_steps", "2"]
RECOMMEND_TARGET = 32  # sequences of 2048 tokens per step on 1 GPU

# stream_profile's kernel categories (the benchmarks' one classifier of kernel names) -> the throughput model's
# terms; a category not named here counts as element-wise (ATen's kernels, FSDP's copies, the rest)
TERM_OF = {"gemm bf16": "gemm", "gemm float8": "gemm_float8", "attention fwd": "attention",
           "attention bwd": "attention", "triton": "fused", "triton f8 cast": "fused",
           "optimizer (MasterAdamW)": "optimizer", "foreach": "optimizer", "nccl": "comm"}


def log(msg: str) -> None:
    print(f"[estimation_gpu] {msg}", file=sys.stderr, flush=True)


def hardware_key() -> str:
    import torch

    from titanlite.hardware import lookup

    hw = lookup(torch.cuda.get_device_name(0))
    if hw is None:
        raise SystemExit(f"no row in titanlite/hardware.py for '{torch.cuda.get_device_name(0)}'")
    return hw.key


def base_args(config: str, overrides: list[str]) -> list[str]:
    return ["--job.config_file", config, *RUN, *overrides]


# ------------------------------------------------------------------------------------ measuring
def measure(name: str, ranks: int, args: list[str], timeout: float, extra: list[str] = (), steps: int = STEPS,
            log_freq: int = LOG_FREQ, skip: int = SKIP) -> dict:
    """One trainer run through the launcher; its figures, or why it failed ("oom" or the error line)."""
    r = launch.titanlite(name, [*args, *extra], ngpus=ranks, steps=steps, log_freq=log_freq,
                         timeout=int(max(30.0, timeout)), base=[])
    if r.error is not None:
        return {"error": "oom" if "out of memory" in r.output.lower() else r.error, "wall_s": round(r.wall_s, 1)}
    return figures_of(r.entries, str(launch.WORK / name), r.wall_s, skip)


def figures_of(entries: list[dict], folder: str, wall_s: float, skip: int = SKIP) -> dict:
    """Peak allocated and steady tokens/s per GPU by the launcher's one rule, and the profile if any."""
    f = launch.figures(entries, skip)
    res = {"peak_gib": f.get("mem"), "tokens_per_sec_per_gpu": f.get("tps_gpu"), "mfu_pct": f.get("mfu"),
           "steady_log_steps": f.get("steps"), "wall_s": round(wall_s, 1),
           # the allocator's cache releases by the last step: a batch near the boundary runs "tight"
           "alloc_retries": entries[-1].get("alloc_retries") if entries else None}
    traces = glob.glob(os.path.join(folder, "profile_traces", "step*-*", "rank0.json"))
    if traces:  # the window's folder is named step<first>-<last>
        first, last = os.path.basename(os.path.dirname(traces[0]))[4:].split("-")
        res["profile_ms_per_step"] = kernel_breakdown(traces[0], int(last) - int(first) + 1)
    return res


def worker(names: list[str], profiled: list[str], results_file: str) -> None:
    """One process runs the one-GPU cases one after another (the trainer's own main, then a reset of
    compile and allocator state): the interpreter, CUDA and the compile caches start once."""
    import gc

    import torch

    from titanlite import train
    from titanlite.errors import OUT_OF_MEMORY_EXIT

    done = {}
    for n in names:
        _, config, ov = ALL_CASES[n]
        extra = PROFILE if n in profiled else []
        folder = str(launch.WORK / n)
        steps, log_freq, skip = (SWEEP_STEPS, 1, SWEEP_SKIP) if n in AC_SWEEP else (STEPS, LOG_FREQ, SKIP)
        t0 = time.time()
        try:
            train.main(base_args(config, ov) + extra + ["--training.steps", str(steps), "--metrics.log_freq",
                                                        str(log_freq), "--job.dump_folder", folder])
            logs = sorted(glob.glob(os.path.join(folder, "run_*.json")), key=os.path.getmtime)
            entries = json.load(open(logs[-1]))["training_iterations"] if logs else []
            done[n] = figures_of(entries, folder, time.time() - t0, skip)
        except BaseException as e:  # noqa: BLE001 (a case that fails is recorded; the next one runs)
            # train.main ends an out-of-memory run with its exit code (titanlite.errors.OUT_OF_MEMORY_EXIT)
            oom = (isinstance(e, SystemExit) and e.code == OUT_OF_MEMORY_EXIT) or isinstance(e, torch.OutOfMemoryError) \
                or "out of memory" in str(e).lower()
            done[n] = {"error": "oom" if oom else f"{type(e).__name__}: {e}"[:300]}
        gc.collect()
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        with open(results_file + ".tmp", "w") as fh:
            json.dump(done, fh)
        os.replace(results_file + ".tmp", results_file)


def measure_in_one_process(names: list[str], profiled: list[str], budget_end: float) -> dict:
    """The worker above, started through the launcher (its own process group, killed at the budget);
    what it finished in time."""
    results = str(launch.WORK / "estimation_gpu_worker.json")
    if os.path.exists(results):
        os.remove(results)
    cmd = launch.command(1, [os.path.abspath(__file__), "--worker", ",".join(names), "--profile", ",".join(profiled),
                             "--results-file", results])
    rc, text, _ = launch.execute("estimation_gpu_worker", cmd, int(max(30.0, budget_end - time.time())))
    if rc is None:
        log("one-GPU cases: budget spent, keeping the finished ones")
    elif rc != 0:
        log(f"one-GPU worker: {launch.error_line(text, rc)}")
    return json.load(open(results)) if os.path.exists(results) else {}


def kernel_breakdown(trace: str, steps: int) -> dict:
    """GPU kernel time per throughput term, per profiled step (ms), and the 15 longest kernels."""
    events = launch.trace_events(trace) or []
    per_term, per_kernel = {}, {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != "kernel":
            continue
        name = str(e.get("name", ""))
        term = TERM_OF.get(stream_profile.category(name), "elementwise")
        per_term[term] = per_term.get(term, 0.0) + e.get("dur", 0.0) / 1000
        per_kernel[name[:80]] = per_kernel.get(name[:80], 0.0) + e.get("dur", 0.0) / 1000
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:15]
    return {"steps": steps, "terms": {k: round(v / steps, 3) for k, v in per_term.items()},
            "top_kernels": {k: round(v / steps, 3) for k, v in top}}


def oom_boundary(guess: int, budget_end: float, limit: int = 96) -> dict:
    """Largest local batch the real trainer runs on one GPU with compile. The prediction and one past
    it settle it when the prediction is right; otherwise bisect (doubling first while all fit)."""
    probes = {}

    def ok(b):
        r = measure(f"oom_b{b}", 1, base_args(H100_CFG, ["--training.local_batch_size", str(b)]),
                    budget_end - time.time(), steps=2, log_freq=1)
        probes[b] = r.get("error") or r["peak_gib"]
        log(f"oom search: local batch {b}: {probes[b]}")
        if "error" in r and r["error"] != "oom":
            raise RuntimeError(f"local batch {b}: {r['error']}")
        return "error" not in r

    lo, hi = 0, limit + 1
    for b in (guess, guess + 1):
        if ok(b):
            lo = max(lo, b)
        else:
            hi = min(hi, b)
            break
    while hi - lo > 1 and time.time() < budget_end:
        b = min(2 * lo, hi - 1) if hi == limit + 1 and lo else (lo + hi) // 2
        if ok(b):
            lo = b
        else:
            hi = b
    return {"largest": lo if hi - lo == 1 else None, "fits_up_to": lo, "probes": probes}


# ----------------------------------------------------------------------------------- predicting
def predict(case: str, ranks: int, config: str, overrides: list[str], hw: str, search: bool) -> dict:
    import logging
    import warnings

    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    from estimation.estimate import estimate
    from titanlite.config import load_config

    cfg = load_config(base_args(config, overrides) + ["--estimate.ngpu", str(ranks), "--estimate.hardware", hw,
                                                      f"--estimate.search={str(search).lower()}"])
    r = estimate(cfg, progress=lambda m: None)
    t = r["throughput"] or {}
    return {"peak_gib": r["memory"]["peak_gib"], "fits": r["memory"]["fits"],
            "tokens_per_sec_per_gpu": t.get("overlap", {}).get("tokens_per_sec_per_gpu"),
            "mfu_pct": t.get("overlap", {}).get("mfu_pct"), "dominant": t.get("dominant"),
            "terms_ms": t.get("terms_ms"), "work": t.get("work"), "assumptions": t.get("assumptions"),
            "largest_local_batch": (r["batch_search"] or {}).get("largest_local_batch"), "elapsed_s": r["elapsed_s"]}


def recommend_pick(hw: str, out_dir: str) -> dict:
    import logging
    import warnings

    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    from estimation.recommend import recommend, write_toml
    from titanlite.config import load_config

    cfg = load_config(["--job.config_file", H100_CFG, "--estimate.hardware", hw, "--estimate.recommend",
                       "--training.global_batch_size", str(RECOMMEND_TARGET)])
    r = recommend(cfg, progress=lambda m: None)
    best = r["best"][0]
    path = write_toml(cfg, best, 1, os.path.join(out_dir, "recommended.toml"))
    return {"toml": path, "label": best.knobs.label(), "local": best.local, "accum": best.accum,
            "cuda_graphs": best.cuda_graphs, "peak_gib": round(best.peak_bytes / 2**30, 3),
            "tokens_per_sec_per_gpu": best.tokens_per_sec_per_gpu, "mfu_pct": best.mfu_pct, "elapsed_s": r["elapsed_s"]}


# -------------------------------------------------------------------------------------- report
def err(p, m):
    return f"{100 * (p - m) / m:+.1f}" if p is not None and m else "-"


def table(results: dict) -> str:
    lines = ["| case | GPUs | predicted peak GiB | measured peak GiB | err % | predicted tok/s/GPU | measured tok/s/GPU "
             "| err % | dominant term |", "|---|---|---|---|---|---|---|---|---|"]
    for name, c in results["cases"].items():
        p, m = c.get("predicted", {}), c.get("measured", {})
        mp = m.get("peak_gib") if "error" not in m else m.get("error", "failed")
        mt = m.get("tokens_per_sec_per_gpu")
        pp, pt = p.get("peak_gib"), p.get("tokens_per_sec_per_gpu")
        lines.append(f"| {name} | {c['ranks']} | {pp if pp is not None else '-'} | {mp} | "
                     f"{err(pp, m.get('peak_gib') if 'error' not in m else None)} | "
                     f"{f'{pt:,.0f}' if pt else '-'} | {f'{mt:,.0f}' if mt else '-'} | {err(pt, mt)} | "
                     f"{p.get('dominant', '-')} |")
    o = results.get("oom")
    if o:
        real = o["largest"] if o.get("largest") is not None else f">= {o.get('fits_up_to')}"
        lines.append(f"\nlargest local batch with compile on 1 GPU: predicted {o.get('predicted')}, measured {real} "
                     f"(probes: {o.get('probes')})")
    return "\n".join(lines + terms_table(results))


# The throughput model's terms (estimation.throughput) -> the profile's kernel terms (TERM_OF's) they predict
TERMS = {"gemm": ("gemm", "gemm_float8"), "attention": ("attention",), "elementwise": ("fused", "elementwise"),
         "optimizer": ("optimizer",), "comm_total": ("comm",)}


def terms_table(results: dict) -> list[str]:
    """For each profiled case: each term's predicted ms a step beside the kernel time the profile sorted
    into it (rank 0; collectives run on their own stream, so their time overlaps the rest)."""
    rows = []
    for name, c in results["cases"].items():
        prof = c.get("measured", {}).get("profile_ms_per_step")
        pred = c.get("predicted", {}).get("terms_ms")
        if not prof or not pred:
            continue
        for term, kernels in TERMS.items():
            got = sum(prof["terms"].get(k, 0.0) for k in kernels)
            rows.append(f"| {name} | {term} | {pred.get(term, 0.0):.2f} | {got:.2f} | {err(pred.get(term), got)} |")
    if not rows:
        return []
    return ["", "| profiled case | term | predicted ms/step | kernels ms/step | err % |", "|---|---|---|---|---|", *rows]


def main() -> None:
    ap = launch.Parser(__doc__)
    ap.add_argument("--gpus", type=int, default=1, help="1: the one-GPU cases; 2 or 4: the cases of that many GPUs")
    ap.add_argument("--only", default="", help="comma-separated case names")
    ap.add_argument("--ac-sweep", action="store_true",
                    help="the activation-checkpointing sweep (AC_SWEEP) on 1 GPU instead of the default cases")
    ap.add_argument("--no-oom-search", action="store_true")
    ap.add_argument("--no-recommend", action="store_true")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--profiled", default="",
                    help="comma-separated cases to profile (default: PROFILED's cases for --gpus)")
    ap.add_argument("--budget-s", type=float, default=550.0,
                    help="seconds for the whole call: no case starts after them, and waits end 30 s later")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--worker", help="(internal) run these one-GPU cases in this process")
    ap.add_argument("--profile", default="", help="(internal) the worker's profiled cases")
    ap.add_argument("--results-file", help="(internal) where the worker writes its figures")
    opts = ap.parse_args()
    if opts.worker:
        return worker(opts.worker.split(","), [n for n in opts.profile.split(",") if n], opts.results_file)
    t_end = time.time() + opts.budget_s
    os.makedirs(opts.out, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "titanlite_inductor_cache"))
    import torch

    hw, ngpu = hardware_key(), torch.cuda.device_count()
    names = ([n for n in opts.only.split(",") if n] or (list(AC_SWEEP) if opts.ac_sweep else
                                                       [n for n, (r, _, _) in CASES.items() if r == opts.gpus]))
    unknown = [n for n in names if n not in ALL_CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(ALL_CASES)}")
    asked = [n for n in opts.profiled.split(",") if n]
    if asked and (opts.no_profile or opts.ac_sweep or set(asked) - set(names)):
        raise SystemExit(f"--profiled {opts.profiled}: " + (
            "--no-profile and --ac-sweep profile nothing" if opts.no_profile or opts.ac_sweep else
            f"{', '.join(n for n in asked if n not in names)} not among the cases run ({', '.join(names)})"))
    if opts.ac_sweep:  # memory across checkpointing modes: nothing else
        opts.no_oom_search = opts.no_recommend = opts.no_profile = True
    if any(ALL_CASES[n][0] > ngpu for n in names):
        raise SystemExit(f"{opts.gpus} GPUs asked for, {ngpu} present")
    results = {"device": torch.cuda.get_device_name(0), "ngpu": ngpu, "hardware": hw, "torch": torch.__version__,
               "date": datetime.date.today().isoformat(),
               "total_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 2),
               "command": " ".join(["python", "benchmarks/estimation_gpu.py", *sys.argv[1:]]), "cases": {}}
    path = os.path.join(opts.out, "estimation_gpu.json")

    def save():
        with open(path, "w") as fh:
            json.dump(results, fh, indent=1)

    # predictions (and the recommendation) on the CPU while the GPU measures
    # two CPU workers: the trainer's compile needs the other cores
    pool = futures.ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn"))
    pending = {n: pool.submit(predict, n, *ALL_CASES[n], hw, n == "b8" and opts.gpus == 1) for n in names}
    rec = None if opts.no_recommend or opts.gpus != 1 or opts.only else pool.submit(recommend_pick, hw, opts.out)
    profiled = [] if opts.no_profile else asked or PROFILED.get(opts.gpus, [])
    if opts.gpus == 1:
        # the OOM search (two probes when the prediction is right) and the recommended pick need their share
        tail = (0 if opts.no_oom_search or opts.only else 110) + (0 if rec is None else 70)
        measured = measure_in_one_process(names, [n for n in names if n in profiled], t_end - tail)
    else:
        measured = {}
        for n in names:
            if time.time() > t_end:
                break
            ranks, config, ov = ALL_CASES[n]
            measured[n] = measure(n, ranks, base_args(config, ov), t_end + 30 - time.time(),
                                  PROFILE if n in profiled else [])
    for n in names:
        if n not in measured:
            log(f"{n}: not measured (budget spent)")
            continue
        ranks, config, ov = ALL_CASES[n]
        results["cases"][n] = {"ranks": ranks, "config": os.path.relpath(config, ROOT), "overrides": ov,
                               "measured": measured[n], "profiled": n in profiled}
        log(f"{n}: measured {measured[n]}")
    save()
    for n, f in pending.items():
        if n in results["cases"]:
            try:
                results["cases"][n]["predicted"] = f.result(timeout=max(1.0, t_end + 30 - time.time()))
            except Exception as e:  # a prediction that failed is reported, not fatal to the rest
                results["cases"][n]["predicted"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    save()
    if opts.gpus == 1 and not opts.no_oom_search and not opts.only and time.time() < t_end:
        guess = results["cases"].get("b8", {}).get("predicted", {}).get("largest_local_batch") or 16
        results["oom"] = {"predicted": guess, **oom_boundary(guess, t_end)}
        save()
    if rec is not None and time.time() < t_end:
        try:
            pick = rec.result(timeout=max(1.0, t_end - time.time()))
            # a pick with CUDA graphs is captured after 4 eager steps, before the timed ones as in every case
            m = measure("recommended", 1, ["--job.config_file", pick["toml"], *RUN, "--training.cuda_graphs_warmup",
                                           "4"], t_end + 30 - time.time())
            results["cases"]["recommended"] = {"ranks": 1, "config": pick["toml"], "overrides": [], "measured": m,
                                               "predicted": {k: pick[k] for k in ("peak_gib", "tokens_per_sec_per_gpu",
                                                                                 "mfu_pct")}, "pick": pick}
        except Exception as e:
            results["recommended_error"] = f"{type(e).__name__}: {e}"[:300]
        save()
    pool.shutdown(cancel_futures=True)
    md = table(results)
    print(md)
    with open(os.path.join(opts.out, "estimation_gpu.md"), "w") as fh:
        fh.write(f"{results['device']} x {ngpu}, torch {results['torch']}, {results['date']}: `{results['command']}`\n\n"
                 + md + "\n")
    log(f"wrote {path}")


if __name__ == "__main__":
    main()

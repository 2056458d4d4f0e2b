"""Every pair of option values trained once on the GPUs: a pairwise covering design over the options
that meet in the training step, run through ./run_train.sh as users run it.

    python benchmarks/gpu_matrix.py --design --ngpus 2                  # the rows (CPU, instant)
    python benchmarks/gpu_matrix.py --predict --ngpus 2 --hardware h200 \
        --out benchmarks/results/gpu_matrix_predictions_2xh200.json    # each row's peak memory (CPU)
    python benchmarks/gpu_matrix.py --ngpus 2 --predictions benchmarks/results/gpu_matrix_predictions_2xh200.json \
        --data .matrix_data/stdlib32k --out $OUT                         # on the GPU machine

The factors (FACTORS) are the data-parallel mode (one GPU, ddp, zero1, fsdp, hsdp), the precision
(bf16, float8), activation checkpointing, compile, accumulation (none, two micro-steps, two that each
reduce-scatter into the shard: fsdp_accumulate=sharded), CUDA graphs, the moments' dtype
and the model (LLaMA 1.36B, Qwen3 1.8B at a short sequence, so a row takes seconds once compiled).
Every pair of values of two factors appears in some row (`design`, checked by the test suite). A pair
that no configuration can run (CUDA graphs under fsdp, say) is covered by a row the launcher must
refuse in one line, exit code 2, for the reason titanlite.config gives; every other row must train.
A data-parallel row runs on two GPUs, hsdp on four where the host has them (two replicas of two
shards; else one of two), so two rows of two GPUs share a four-GPU host.

A row passes when it trains with finite losses whose last is below its first and its peak memory
(torch.cuda.max_memory_allocated, the run log's) is within 5% of `python -m estimation`'s prediction
for the same options (made on the CPU beforehand: --predict), or, for a row the configuration check
refuses, when run_train.sh refuses it with that one line and exit code 2. Rows run side by side on
free GPUs, two on each GPU at once (--slots; a row's peak is its own process's, and speed is not what
a row checks), all sharing one Inductor cache.
Results: --out/gpu_matrix.md (the table) and gpu_matrix.json (every run).
"""

from __future__ import annotations

import concurrent.futures as futures
import hashlib
import itertools
import json
import math
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import launch  # noqa: E402  (benchmarks/launch.py: the one launcher)
from titanlite.parallel.modes import MODES  # noqa: E402

FACTORS: dict[str, list] = {
    "mode": ["one", "ddp", "zero1", "fsdp", "hsdp"],
    "precision": ["bf16", "float8"],
    "ac": ["none", "selective", "full"],
    "compile": [True, False],
    "accum": [1, 2, "2s"],  # 2s: two micro-steps, each reduce-scattering into the shard (fsdp_accumulate=sharded)
    "graphs": [False, True],
    "moments": ["float32", "bfloat16"],
    "fused": [True, False],  # the optimizer's fused update, or torch's / the eager per-parameter one
    "model": ["llama", "qwen3"],
}
# the modes accum "2s" applies to (those that shard the gradients): a value of no other mode's (never a row)
SHARDED = tuple(m for m, traits in MODES.items() if traits.shards_params)
MODELS = {"llama": ["--model.name", "llama", "--model.flavor", "1.36B"],
          "qwen3": ["--model.name", "qwen3", "--model.flavor", "1.8B"]}
LOCAL, SEQ, STEPS = 2, 512, 16  # ddp captures its graph after 11 eager steps: replays follow
MEMORY_TOLERANCE = 0.05
ROW_TIMEOUT = 420


def options(row: dict, ngpus: int) -> tuple[int, list[str]]:
    """The GPUs a row runs on and its training options (besides data, steps and folder)."""
    ranks = 1 if row["mode"] == "one" else 4 if row["mode"] == "hsdp" and ngpus >= 4 else 2
    opts = ["--job.config_file", str(ROOT / "train_configs/debug_model.toml"), *MODELS[row["model"]],
            "--training.local_batch_size", str(LOCAL), "--training.seq_len", str(SEQ),
            "--training.global_batch_size", str(LOCAL * ranks * (1 if row["accum"] == 1 else 2)),
            "--activation_checkpoint.mode", row["ac"], f"--compile.enable={str(row['compile']).lower()}",
            f"--training.cuda_graphs={str(row['graphs']).lower()}", "--optimizer.moments_dtype", row["moments"],
            "--optimizer.fused", str(row["fused"]).lower(),
            "--optimizer.lr", "1e-3", "--lr_scheduler.warmup_steps", "3", "--validation.enable=false",
            "--checkpoint.enable=false", "--metrics.log_freq", "1"]
    if row["ac"] == "selective":
        opts += ["--activation_checkpoint.selective_option", "op"]
    if row["precision"] == "float8":
        opts += ["--float8.enable"]
    if row["mode"] != "one":
        opts += ["--parallelism.data_parallel", row["mode"]]
    if row["accum"] != 1 and row["mode"] in SHARDED:  # where the sums of the first micro-step wait
        opts += ["--parallelism.fsdp_accumulate", "sharded" if row["accum"] == "2s" else "unsharded"]
    if row["mode"] == "hsdp":  # shards inside pairs of GPUs, replicated across the pairs
        opts += ["--parallelism.shard_degree", "2", "--parallelism.replicate_degree", str(ranks // 2)]
    return ranks, opts


def refusal(row: dict, ngpus: int) -> str | None:
    """The one line titanlite's configuration check refuses this row with on an H100-class node, or None."""
    from titanlite.config import ConfigError
    from titanlite.config.check import check_launch
    from titanlite.config.manager import check_combination, load_config, resolve_batch
    from titanlite.parallel.launcher_env import Launch

    ranks, opts = options(row, ngpus)
    try:
        cfg = load_config(opts, Launch(world_size=ranks))
        resolve_batch(cfg, ranks)
        check_combination(cfg, ranks)
        check_launch(cfg, [(9, 0)] * ranks)
    except ConfigError as e:
        return str(e)
    return None


def pairs_of(row: dict) -> set:
    return {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(FACTORS, 2)}


def applies(combo: dict) -> bool:
    """Accumulation sharded into the shard is a setting of the sharded modes alone."""
    return combo["accum"] != "2s" or combo["mode"] in SHARDED


def every_pair() -> set:
    return {((a, x), (b, y)) for a, b in itertools.combinations(FACTORS, 2) for x in FACTORS[a] for y in FACTORS[b]
            if applies({"mode": "fsdp", "accum": 1, a: x, b: y})}


def cost(row: dict) -> tuple:
    """Cheaper rows first among equals: eager before compiled, fewer GPUs, no checkpointing."""
    return (row["compile"], row["mode"] != "one", row["ac"] != "none", row["graphs"], row["accum"] != 1,
            not row["fused"])


def design(ngpus: int) -> list[dict]:
    """A pairwise covering design: greedily, the configuration the checks accept that covers the most
    pairs not yet covered (the cheaper on a tie); then, for each pair no accepted configuration holds,
    one refused row that holds it. Each row: the factors, `expect` ("train" or "refused") and `why`."""
    combos = [c for values in itertools.product(*FACTORS.values()) if applies(c := dict(zip(FACTORS, values)))]
    verdicts = [refusal(c, ngpus) for c in combos]
    accepted = [c for c, v in zip(combos, verdicts) if v is None]
    runnable = set().union(*(pairs_of(c) for c in accepted))
    rows, left = [], set(runnable)
    while left:
        best = max(accepted, key=lambda c: (len(pairs_of(c) & left), tuple(-int(x) for x in cost(c))))
        rows.append({**best, "expect": "train", "why": None})
        left -= pairs_of(best)
    unrunnable = every_pair() - runnable
    for combo, why in zip(combos, verdicts):
        if why is not None and pairs_of(combo) & unrunnable:
            rows.append({**combo, "expect": "refused", "why": why})
            unrunnable -= pairs_of(combo)
    return rows


def label(row: dict) -> str:
    return "_".join([row["mode"], row["precision"], f"ac-{row['ac']}", "compile" if row["compile"] else "eager",
                     f"accum{row['accum']}", "graphs" if row["graphs"] else "nographs", f"m-{row['moments']}",
                     "fused" if row["fused"] else "unfused", row["model"]])


def key(row: dict, ngpus: int, hardware: str) -> str:
    """What a prediction is for: the row's options (paths inside the checkout relative to it, so that any
    checkout's predictions serve), GPU count and GPU."""
    opts = [o.replace(str(ROOT) + os.sep, "") for o in options(row, ngpus)[1]]
    return hashlib.sha256(json.dumps([opts, ngpus, hardware]).encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------------- predict
def _predict_one(args: tuple) -> tuple[str, dict]:
    row, ngpus, hardware = args
    import logging
    import warnings

    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    from estimation.estimate import estimate
    from titanlite.config import load_config

    ranks, opts = options(row, ngpus)
    cfg = load_config(opts + ["--estimate.ngpu", str(ranks), "--estimate.hardware", hardware, "--estimate.search=false"])
    r = estimate(cfg, progress=lambda m: None)
    return key(row, ngpus, hardware), {"label": label(row), "peak_gib": r["memory"]["peak_gib"],
                                       "tokens_per_sec_per_gpu": ((r["throughput"] or {}).get("overlap") or {})
                                       .get("tokens_per_sec_per_gpu")}


def predict(ngpus: int, hardware: str, out: Path, workers: int, only: list[str]) -> None:
    """Each trained row's estimate into `out`; with `only`, those rows' replace theirs in an existing `out`."""
    rows = [r for r in design(ngpus) if r["expect"] == "train" and (not only or any(o in label(r) for o in only))]
    t0, done = time.time(), json.loads(out.read_text())["predictions"] if only and out.exists() else {}
    with futures.ProcessPoolExecutor(workers) as pool:
        for k, p in pool.map(_predict_one, [(r, ngpus, hardware) for r in rows]):
            done[k] = p
            print(f"[{time.time() - t0:5.0f}s] {p['label']}: {p['peak_gib']:.2f} GiB",
                  file=sys.stderr, flush=True)
    out.write_text(json.dumps({"ngpus": ngpus, "hardware": hardware, "predictions": done}, indent=1) + "\n")
    print(f"{out}: {len(done)} predictions in {time.time() - t0:.0f}s")


# ----------------------------------------------------------------------------------------------- run
class Gpus:
    """This host's GPUs handed out to rows that run side by side: `slots` lists each GPU as often as rows
    may share it; a row takes distinct GPUs."""

    def __init__(self, slots: list[int]):
        self.free, self.cv, self.count = list(slots), threading.Condition(), len(set(slots))

    def take(self, k: int) -> list[int]:
        with self.cv:
            self.cv.wait_for(lambda: len(set(self.free)) >= k)
            got = sorted(set(self.free))[:k]
            for g in got:
                self.free.remove(g)
            return got

    def give(self, ids: list[int]) -> None:
        with self.cv:
            self.free += ids
            self.cv.notify_all()


def run_row(row: dict, ngpus: int, gpus: Gpus, data: str, prediction: dict | None,
            timeout: float = ROW_TIMEOUT) -> dict:
    ranks, opts = options(row, ngpus)
    opts += ["--training.dataset", "prepared", "--training.dataset_path", data] if data else []
    name = label(row)
    if row["expect"] == "train" and ranks > gpus.count:
        return {**row, "label": name, "ranks": ranks, "rc": None, "wall_s": 0.0, "passed": False,
                "error": f"not run: needs {ranks} GPUs, the host lends {gpus.count}"}
    ids = gpus.take(ranks) if row["expect"] == "train" else []
    try:
        res = launch.run_train(name, opts, ngpus=ranks, steps=STEPS, log_freq=1, timeout=timeout,
                               env={"CUDA_VISIBLE_DEVICES": ",".join(map(str, ids))} if ids else None)
    finally:
        gpus.give(ids)
    out = {**row, "label": name, "ranks": ranks, "rc": res.rc, "wall_s": round(res.wall_s, 1), "error": res.error}
    if row["expect"] == "refused":
        lines = [line for line in res.output.splitlines() if line.strip() and not line.startswith("[")]
        out["passed"] = res.rc == 2 and len(lines) == 1 and row["why"] in lines[0]
        out["said"] = lines[-1] if lines else ""
        return out
    losses = list(launch.step_losses(res.entries).values())
    fig = res.figures(skip=STEPS // 2)
    measured, predicted = fig.get("mem"), (prediction or {}).get("peak_gib")
    mem_err = (measured - predicted) / predicted if measured is not None and predicted else None
    finite = bool(losses) and all(math.isfinite(x) for x in losses)
    falling = finite and losses[-1] < losses[0]
    out.update(optimizer_ms=fig.get("opt_ms"), first_loss=losses[0] if losses else None, last_loss=losses[-1] if losses else None, steps=len(losses),
               peak_gib=measured, predicted_gib=predicted, memory_error=mem_err, tps_gpu=fig.get("tps_gpu"),
               passed=res.rc == 0 and len(losses) == STEPS and falling and mem_err is not None
               and abs(mem_err) <= MEMORY_TOLERANCE)
    if not out["passed"]:  # what the run said last, for the record's JSON
        out["tail"] = res.output[-3000:]
    return out


_LOCK = threading.Lock()


def note(out: Path, stem: str, result: dict) -> dict:
    """Append a finished row to OUT/STEM.jsonl at once: a call cut short still returns what finished."""
    out.mkdir(parents=True, exist_ok=True)
    with _LOCK, open(out / f"{stem}.jsonl", "a") as fh:
        fh.write(json.dumps({k: v for k, v in result.items() if k != "losses"}, default=str) + "\n")
    print(f"{result.get('label', '?')}: {'pass' if result.get('passed') else 'FAIL'}", flush=True)  # progress
    return result


def table(results: list[dict], commit: str, wall: float, device: str) -> str:
    lines = [f"GPU matrix, {device}, commit {commit}, {wall:.0f} s, {sum(r['passed'] for r in results)}/{len(results)} "
             "rows passed", "",
             "| row | GPUs | expect | result | loss first -> last | peak GiB (pred, err) | tok/s/GPU | optimizer ms | s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r["expect"] == "refused":
            loss, mem, tps, opt = r.get("said", "")[:90], "-", "-", "-"
        else:
            loss = (f"{r['first_loss']:.3f} -> {r['last_loss']:.3f}" if r.get("last_loss") is not None
                    else (r.get("error") or "")[:90])
            mem = (f"{r['peak_gib']:.2f} ({launch.fmt(r['predicted_gib'], '.2f')}, "
                   f"{launch.fmt(None if r['memory_error'] is None else 100 * r['memory_error'], '+.1f')}%)"
                   if r.get("peak_gib") is not None else "-")
            tps, opt = launch.fmt(r.get("tps_gpu"), ",.0f"), launch.fmt(r.get("optimizer_ms"), ".1f")
        lines.append(f"| {r['label']} | {r['ranks']} | {r['expect']} | {'pass' if r['passed'] else 'FAIL'} | {loss} | "
                     f"{mem} | {tps} | {opt} | {r['wall_s']:.0f} |")
    return "\n".join(lines)


def run(ngpus: int, predictions: Path | None, data: str, out: Path, only: list[str], host_gpus: int | None = None,
        timeout: float = ROW_TIMEOUT, slots: int = 2) -> int:
    import subprocess

    rows = design(ngpus)
    if only:
        rows = [r for r in rows if any(o in label(r) for o in only)]
    pred = json.loads(predictions.read_text()) if predictions else {"predictions": {}, "hardware": None}
    hw = pred.get("hardware")
    # "-dirty" where the files differ from that commit (a copy of a working tree, say): the record then
    # names the code by the commit it lands as, not by this one
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    commit += f", code {launch.code_digest()}"  # what ran, whatever the copy's git metadata says
    names = launch.gpu_names()
    device = f"{len(names)} x {names[0]}" if names else "no GPU"
    # a row's peak is its own process's allocator's, so rows may share a GPU: their start-up and compile,
    # most of a row's time, then overlap
    gpus, t0 = Gpus(list(range(host_gpus or ngpus)) * slots), time.time()
    launch.end_runs_on_signals()  # here, in the main thread: the rows start in the pool's
    # the widest rows first, so that one-GPU rows fill the gaps beside them
    order = sorted(rows, key=lambda r: (r["expect"] != "train", r["mode"] == "one", not r["compile"]))
    with futures.ThreadPoolExecutor((host_gpus or ngpus) * slots + 2) as pool:
        jobs = [pool.submit(lambda r: note(out, "gpu_matrix", run_row(r, ngpus, gpus, data, pred["predictions"].get(
            key(r, ngpus, hw)) if hw else None, timeout)), r) for r in order]
        results = [j.result() for j in jobs]
    wall = time.time() - t0
    text = table(results, commit, wall, device)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_matrix.md").write_text(text + "\n")
    (out / "gpu_matrix.json").write_text(json.dumps({"commit": commit, "device": device, "wall_s": wall,
                                                     "rows": results}, indent=1, default=str) + "\n")
    print(text)
    return 0 if all(r["passed"] for r in results) else 1


# ----------------------------------------------------------------------------------- float8 envelope
SWEEP_STEPS, SWEEP_MODEL = 50, ["--model.name", "llama", "--model.flavor", "134M"]
# float8's losses are taken as right when their mean over the last ten of 50 steps is within this
# fraction of the bf16 run's (docs/parallelism.md, float8)
FLOAT8_ENVELOPE = 0.02


def sweep_rows() -> list[dict]:
    """fsdp and hsdp with float8 in every combination of compile, activation checkpointing and
    accumulation (fp32 moments: bf16 moments under FSDP are refused, see design), each beside its
    mode's bf16 run at the same accumulation."""
    rows = []
    for mode, accum in itertools.product(["fsdp", "hsdp"], [1, 2]):
        rows.append(dict(mode=mode, precision="bf16", ac="none", compile=True, accum=accum, graphs=False,
                         moments="float32", fused=True, model="llama"))
        for compiled, ac in itertools.product([True, False], ["none", "selective", "full"]):
            rows.append(dict(mode=mode, precision="float8", ac=ac, compile=compiled, accum=accum, graphs=False,
                             moments="float32", fused=True, model="llama"))
    return rows


def sweep_chosen(only: list[str]) -> list[dict]:
    """The sweep's rows whose labels hold one of `only` (all rows where it is empty), with the bf16 run of
    each chosen float8 row's mode and accumulation, which its losses are compared with."""
    rows = sweep_rows()
    chosen = [r for r in rows if not only or any(o in "sweep_" + label(r) for o in only)]
    bases = {(r["mode"], r["accum"]) for r in chosen}
    return [r for r in rows if r in chosen or (r["precision"] == "bf16" and (r["mode"], r["accum"]) in bases)]


def sweep_one(row: dict, ngpus: int, gpus: Gpus, data: str, timeout: float = ROW_TIMEOUT) -> dict:
    ranks, opts = options(row, ngpus)
    opts += [*SWEEP_MODEL, "--training.local_batch_size", "4", "--training.global_batch_size",
             str(4 * ranks * row["accum"]), "--lr_scheduler.warmup_steps", "10", "--optimizer.lr", "3e-4"]
    opts += ["--training.dataset", "prepared", "--training.dataset_path", data] if data else []
    name = "sweep_" + label(row)
    ids = gpus.take(ranks)
    try:
        res = launch.run_train(name, opts, ngpus=ranks, steps=SWEEP_STEPS, log_freq=1, timeout=timeout,
                               env={"CUDA_VISIBLE_DEVICES": ",".join(map(str, ids))})
    finally:
        gpus.give(ids)
    losses = list(launch.step_losses(res.entries).values())
    return {**row, "label": name, "ranks": ranks, "rc": res.rc, "error": res.error, "wall_s": round(res.wall_s, 1),
            "losses": losses, "tail": sum(losses[-10:]) / 10 if len(losses) == SWEEP_STEPS else None}


def sweep(ngpus: int, data: str, out: Path, slots: int, only: list[str], timeout: float = ROW_TIMEOUT) -> int:
    """The float8 rows against their bf16 runs; each GPU runs up to `slots` rows at once (small model)."""
    gpus, t0 = Gpus(list(range(ngpus)) * slots), time.time()
    launch.end_runs_on_signals()  # here, in the main thread: the rows start in the pool's
    rows = sweep_chosen(only)
    with futures.ThreadPoolExecutor(ngpus * slots) as pool:
        results = list(pool.map(lambda r: note(out, "float8_sweep", sweep_one(r, ngpus, gpus, data, timeout)), rows))
    ref = {(r["mode"], r["accum"]): r["tail"] for r in results if r["precision"] == "bf16"}
    lines = [f"float8 under fsdp/hsdp against bf16, LLaMA 134M, {SWEEP_STEPS} steps on real text, "
             f"{time.time() - t0:.0f} s", "", "| run | result | mean loss, last 10 steps | vs bf16 | s |",
             "|---|---|---|---|---|"]
    for r in results:
        base = ref.get((r["mode"], r["accum"]))
        rel = (r["tail"] - base) / base if r["tail"] is not None and base else None
        r["vs_bf16"] = rel
        r["passed"] = r["rc"] == 0 and r["tail"] is not None and all(math.isfinite(x) for x in r["losses"]) and (
            r["precision"] == "bf16" or (rel is not None and abs(rel) <= FLOAT8_ENVELOPE))
        lines.append(f"| {r['label']} | {'pass' if r['passed'] else 'FAIL ' + (r['error'] or '')[:80]} | "
                     f"{launch.fmt(r['tail'], '.4f')} | {launch.fmt(None if rel is None else 100 * rel, '+.2f')}% | "
                     f"{r['wall_s']:.0f} |")
    text = "\n".join(lines)
    out.mkdir(parents=True, exist_ok=True)
    (out / "float8_sweep.md").write_text(text + "\n")
    (out / "float8_sweep.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(text)
    return 0 if all(r["passed"] for r in results) else 1


def main() -> int:
    p = launch.Parser(__doc__)
    p.add_argument("--ngpus", type=int, default=2, help="GPUs of this host the rows share")
    p.add_argument("--design", action="store_true", help="print the rows and exit")
    p.add_argument("--digest", action="store_true", help="print this checkout's code digest (a record's `code`) and exit")
    p.add_argument("--predict", action="store_true", help="predict each row's peak memory on the CPU")
    p.add_argument("--hardware", default="h200", help="--predict: the GPU key (titanlite/hardware.py)")
    p.add_argument("--workers", type=int, default=2, help="--predict: processes")
    p.add_argument("--predictions", type=Path, help="the --predict output the run compares against")
    p.add_argument("--data", default="", help="prepared shards (titanlite.data.prepare) to train on")
    p.add_argument("--only", default="", help="comma-separated substrings of row labels (--float8-sweep: each "
                                              "float8 row's bf16 run comes with it)")
    p.add_argument("--host-gpus", type=int, help="GPUs this host lends the rows (default --ngpus); a wider row "
                   "is listed as not run")
    p.add_argument("--row-timeout", type=float, default=ROW_TIMEOUT, help="seconds a row (of the matrix or the sweep) may run")
    p.add_argument("--float8-sweep", action="store_true",
                   help="fsdp/hsdp x float8 in every compile/AC/accumulation combination against bf16 (50 steps)")
    p.add_argument("--slots", type=int, default=2, help="rows sharing a GPU at once (each row's memory is its own "
                                                        "process's; its speed is not what a row checks)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    a = p.parse_args()
    if a.ngpus < 2:
        p.error("--ngpus must be at least 2: the multi-GPU modes are half the design")
    if (a.host_gpus is not None and a.host_gpus < 1) or a.row_timeout <= 0 or a.slots < 1:
        p.error("--host-gpus and --slots must be at least 1 and --row-timeout positive")
    if a.digest:
        print(launch.code_digest())
        return 0
    if a.design:
        for r in design(a.ngpus):
            print(f"{label(r):70s} {r['expect']}" + (f"  ({r['why']})" if r["why"] else ""))
        return 0
    if a.float8_sweep:
        return sweep(a.ngpus, a.data, a.out, a.slots, [o for o in a.only.split(",") if o], a.row_timeout)
    if a.predict:
        predict(a.ngpus, a.hardware, a.out if a.out.suffix == ".json" else a.out / "gpu_matrix_predictions.json",
                a.workers, [o for o in a.only.split(",") if o])
        return 0
    return run(a.ngpus, a.predictions, a.data, a.out, [o for o in a.only.split(",") if o], a.host_gpus, a.row_timeout,
               a.slots)


if __name__ == "__main__":
    sys.exit(main())

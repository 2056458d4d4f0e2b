"""The default precision (bf16 copies of fp32 masters, fp32 weight gradients) against autocast, on
real text with gradient accumulation or ddp: three seeds of each, the same seeds on both sides.

  python benchmarks/accum_numerics.py [--ngpus 1] [--accum 8] [--steps 500] [--seeds 1,2,3]
  python benchmarks/accum_numerics.py --ngpus 2 --accum 1 --local 4    # ddp, gradients all-reduced each step
  python benchmarks/accum_numerics.py --ngpus 2 --accum 1 --local 4 --shared-gpu --parallel 6   # ddp's 2 ranks on one GPU
  python benchmarks/accum_numerics.py --combine OUT1 OUT2 ...            # the seeds of several calls in one report

(ddp at --local 4 over 2 ranks takes the 4,096 tokens a step of the default's 1 x 8 accumulation.)

--shared-gpu puts every rank of a ddp run on GPU 0 with the process group over gloo
(debug.inject_shared_device): each rank runs the kernels it would run on a GPU of its own, and the
all-reduce of fp32 gradients does the same arithmetic (for two ranks each element is one fp32 sum of
two addends, in whichever order), so the losses are those of ddp over two GPUs of that kind, up to
the run-to-run variation of nondeterministic kernels. Only the time differs.

The text is torchtitan's c4_test asset prepared as loss_parity.py prepares it (carry .bench), every
20th document held out. The model is LLaMA 134M (vocabulary 32000), local batch --local x seq 512,
compile, lr 6e-4 with 50 warm-up steps; init and data order follow the seed. With the defaults (local
1, accumulation 8: 4,096 tokens a step) 500 steps pass over the training text about once, so the runs
learn the language rather than memorise the text. "Final loss" is the loss on the whole held-out
split after the last step: the same tokens for every run, no batch-to-batch noise. The default passes
where each of its seeds' final losses lies within the spread (lowest to highest) of the autocast
seeds'. The table also gives the mean training loss of the last 20 steps. All runs of one GPU count
share the GPU(s) and run at once, as many as the host's cores feed (`--parallel`; a 134M model leaves
most of an H100 idle), so timings mean nothing.
Writes accum_numerics.md and accum_numerics.json to --out; --combine reports the seeds of several
such folders (same setup) together.

The verdict gives both the spread test and the mean of the per-seed differences with its standard
error. The spread alone decides little: two paths that compute alike, three seeds each, land with a
seed of one outside the other's spread four times in five.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import launch  # noqa: E402  (benchmarks/launch.py: the one launcher)
import loss_parity  # noqa: E402  (the c4_test preparation)

LAST = 20  # training loss: mean over the last this-many steps
VAL_EVERY = 20  # every this-many-th document is held out
PATHS = {"default (bf16 copies, fp32 grads)": [], "autocast": ["--training.bf16_params=false"]}
SEQ = 512


def options(prepared: Path, flavor: str, local: int, accum: int, ngpus: int, seed: int, warmup: int,
            steps: int, shared_gpu: bool = False) -> list[str]:
    return (["--debug.inject_shared_device"] if shared_gpu else []) + [
            "--model.name", "llama", "--model.flavor", flavor, "--model.vocab_size", "32000",
            "--training.dataset", "prepared", "--training.dataset_path", str(prepared),
            "--training.local_batch_size", str(local), "--training.global_batch_size", str(local * accum * ngpus),
            "--training.seq_len", str(SEQ), "--training.seed", str(seed), "--optimizer.lr", "6e-4",
            "--lr_scheduler.warmup_steps", str(warmup), "--compile.enable", "--parallelism.data_parallel",
            "ddp" if ngpus > 1 else "fsdp", "--validation.freq", str(steps), "--validation.steps", "1000000",
            "--checkpoint.enable=false", "--metrics.progress_bar=false"]


def final_loss(r: launch.Result, steps: int) -> float | None:
    """The held-out loss after the last step."""
    return next((v["val_loss"] for v in r.validation if v.get("iter") == steps), None)


def last_train_loss(r: launch.Result) -> float | None:
    losses = launch.step_losses(r.entries)
    last = sorted(losses)[-LAST:]
    return sum(losses[s] for s in last) / len(last) if last else None


def _table(finals: dict[str, dict[int, float | None]], seeds: list[int], errors: dict[str, str | None]) -> list[str]:
    lines = ["| path | " + " | ".join(f"seed {s}" for s in seeds) + " | spread | note |",
             "|---|" + "---|" * (len(seeds) + 2)]
    for name, f in finals.items():
        vals = [v for v in f.values() if v is not None]
        spread = f"{min(vals):.4f} - {max(vals):.4f}" if vals else "-"
        cells = [f"{f[s]:.4f}" if f.get(s) is not None else "-" for s in seeds]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {spread} | {errors.get(name) or ''} |")
    return lines


def paired(diffs: list[float]) -> str:
    """The mean of the per-seed differences with its standard error: the difference the seeds can
    resolve. Two paths that compute alike still fall outside each other's spread often (with three
    seeds each, four times in five), so the spread alone cannot tell them apart."""
    n = len(diffs)
    mean = sum(diffs) / n
    se = (sum((x - mean) ** 2 for x in diffs) / (n - 1) / n) ** 0.5
    verdict = ("not distinguishable from seed-to-seed variation" if abs(mean) <= 2 * se else
               "the default lower" if mean < 0 else "the default higher")
    return (f"per-seed difference, default - autocast: mean {mean:+.4f}, standard error {se:.4f} over {n} seeds "
            f"({verdict}: |mean| {'<=' if abs(mean) <= 2 * se else '>'} 2 standard errors)")


def report(finals: dict[str, dict[int, float | None]], trains: dict[str, dict[int, float | None]],
           errors: dict[str, str | None], head: str) -> str:
    """The held-out table with its verdict, then the training-loss table."""
    seeds = sorted({s for f in finals.values() for s in f})
    lines = [head, "", "Final loss (held-out split, after the last step):", "", *_table(finals, seeds, errors)]
    (d, dv), (a, av) = ((k, [v for v in f.values() if v is not None]) for k, f in finals.items())
    if dv and av and len(dv) == len(seeds) and len(av) == len(seeds):
        inside = all(min(av) <= v <= max(av) for v in dv)
        below = sum(v < min(av) for v in dv)
        mean_d, mean_a = sum(dv) / len(dv), sum(av) / len(av)
        diffs = [finals[d][s] - finals[a][s] for s in seeds]
        lines += ["", f"default inside autocast's spread: {'yes' if inside else 'NO'}"
                      f"{f' ({below} of {len(dv)} below it)' if below else ''}; above autocast's highest: "
                      f"{'NO' if max(dv) <= max(av) else 'YES'}; means {mean_d:.4f} (default) vs {mean_a:.4f} "
                      f"(autocast), {100 * (mean_d / mean_a - 1):+.3f}%; per seed, default - autocast: "
                      + ", ".join(f"{x:+.4f}" for x in diffs)]
        if len(diffs) > 1:
            lines += ["", paired(diffs)]
    else:
        lines += ["", "default inside autocast's spread: not decided (a run failed)"]
    lines += ["", f"Training loss, mean of the last {LAST} steps:", "", *_table(trains, seeds, {})]
    return "\n".join(lines)


def combine(folders: list[Path]) -> str:
    """One report over the seeds of several runs of this script with the same setup (their --out
    folders: accum_numerics.md, whose first line is the setup, and accum_numerics.json)."""
    heads, finals, trains = set(), {p: {} for p in PATHS}, {p: {} for p in PATHS}
    for folder in folders:
        heads.add((folder / "accum_numerics.md").read_text().splitlines()[0])
        data = json.loads((folder / "accum_numerics.json").read_text())
        for into, key in ((finals, "finals"), (trains, "train_last")):
            for path in PATHS:
                for seed, v in data[key][path].items():
                    if int(seed) in into[path]:
                        raise ValueError(f"seed {seed} is in more than one of the folders")
                    into[path][int(seed)] = v
    if len(heads) > 1:
        raise ValueError("the folders ran different setups: " + " / ".join(sorted(heads)))
    return report(finals, trains, {}, heads.pop() + f" (combined from {len(folders)} runs of this script)")


def runs_at_once(wanted: int, ranks: int, cores: int) -> int:
    """How many runs to start together: `wanted`, but at most 3 processes for every 4 CPU cores. Each
    process compiles and feeds its GPU from the host; on 32 cores 12 ddp runs of 2 ranks (24
    processes) took 200 s, and 18 (36) made most runs pass 570 s."""
    return max(1, min(wanted, cores * 3 // 4 // ranks))


def main(argv: list[str] | None = None) -> None:
    ap = launch.Parser(__doc__)
    ap.add_argument("--ngpus", type=int, default=1, help="1: gradient accumulation on one GPU; 2+: ddp over them")
    ap.add_argument("--accum", type=int, default=8, help="micro-steps per optimizer step")
    ap.add_argument("--local", type=int, default=1, help="sequences per micro-step and GPU")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--flavor", default="134M", help="LLaMA flavor (debug: a quick functional check on CPU)")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--shared-gpu", action="store_true",
                    help="with --ngpus 2+: every rank on GPU 0, process group over gloo (same arithmetic, see above)")
    ap.add_argument("--parallel", type=int, default=0,
                    help="runs at once (default: all of them), at most 3 processes for every 4 CPU cores")
    ap.add_argument("--timeout", type=int, default=540)
    ap.add_argument("--out", default=os.environ.get("OUT", "outputs/accum_numerics"))
    ap.add_argument("--combine", nargs="+", metavar="DIR",
                    help="run nothing: report the seeds of earlier --out folders (same setup, other seeds) together")
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if a.combine:
        try:
            text = combine([Path(d) for d in a.combine])
        except (OSError, ValueError, KeyError) as e:
            ap.error(str(e))
        print(text)
        return
    try:
        seeds = [int(s) for s in a.seeds.split(",")]
    except ValueError:
        ap.error(f"--seeds takes integers separated by commas, not {a.seeds!r}")
    if a.steps <= LAST or a.accum < 1 or a.local < 1 or a.ngpus < 1 or a.parallel < 0 or not 0 <= a.warmup < a.steps:
        ap.error(f"need --steps > {LAST}, --accum >= 1, --local >= 1, --ngpus >= 1, --parallel >= 0 "
                 "and 0 <= --warmup < --steps")
    if a.shared_gpu and a.ngpus < 2:
        ap.error("--shared-gpu is for ddp: give --ngpus 2 or more")
    if not (loss_parity.ASSETS / "c4_test" / "data.json").exists():
        sys.exit("accum_numerics: torchtitan's c4_test asset is not here: carry .bench (cp -r ../shared/bench .bench)")
    work = launch.WORK / "accum_numerics"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    prepared, _ = loss_parity.prepare(work, val_every=VAL_EVERY)

    jobs = [(path, seed) for path in PATHS for seed in seeds]

    def one(job):
        path, seed = job
        name = f"numerics_{'default' if not PATHS[path] else 'autocast'}_seed{seed}"
        base = options(prepared, a.flavor, a.local, a.accum, a.ngpus, seed, a.warmup, a.steps, a.shared_gpu)
        return job, launch.titanlite(name, PATHS[path], a.ngpus, a.steps, 10, a.timeout, work=work, base=base)

    wanted, cores = a.parallel or len(jobs), os.cpu_count() or 1
    at_once = runs_at_once(wanted, a.ngpus, cores)
    if at_once < wanted:
        print(f"accum_numerics: {at_once} runs at once ({cores} CPU cores, {a.ngpus} rank(s) a run)", flush=True)
    launch.end_runs_on_signals()  # here, in the main thread: the runs start in the pool's
    with ThreadPoolExecutor(at_once) as pool:
        done = list(pool.map(one, jobs))
    finals = {p: {} for p in PATHS}
    trains = {p: {} for p in PATHS}
    errors: dict[str, str | None] = {}
    for (path, seed), r in done:
        finals[path][seed] = final_loss(r, a.steps) if r.error is None else None
        trains[path][seed] = last_train_loss(r) if r.error is None else None
        if r.error:
            errors[path] = f"seed {seed}: {r.error}"
    mode = ("1 GPU" if a.ngpus == 1 else f"ddp over {a.ngpus} ranks sharing GPU 0 (gloo)" if a.shared_gpu
            else f"ddp over {a.ngpus} GPUs")
    head = (f"LLaMA {a.flavor}, c4_test (every {VAL_EVERY}th document held out), local batch {a.local} x seq {SEQ}, "
            f"accumulation {a.accum}, {mode}, {a.steps} steps")
    text = report(finals, trains, errors, head)
    print("\n" + text)
    launch.save(Path(a.out), "accum_numerics", text, [r for _, r in done],
                {"finals": finals, "train_last": trains, "argv": sys.argv[1:] if argv is None else argv})


if __name__ == "__main__":
    main()

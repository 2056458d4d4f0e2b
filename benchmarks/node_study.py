"""The study on one node of N GPUs (N: all visible, 4 or 8): weak scaling of the 8-GPU presets, two
real faults diagnosed, and the CPU's estimate beside each run.

  python benchmarks/node_study.py --predict-only [--ngpus 8] [--preset-gpu h100,h200]   # CPU machine, before
  python benchmarks/node_study.py [--parts study,faults] [--models llama,qwen3] [--tag T] [--steps 20] [-- OPTIONS]

study: LLaMA 1.36B and Qwen3 1.8B from their 8-GPU presets (train_configs/<model>_8x<gpu>.toml, the
GPU from nvidia-smi's name; --preset-gpu picks another), each started as a user types it,
`NGPU=k ./run_train.sh --job.config_file PRESET ...`, at k = 1, 2, 4 (, 8) up to N, `--steps` steps.
Weak scaling: every k runs the preset's local batch and accumulation per GPU, so the global batch is
local x accumulation x k (the presets fix it for 8 GPUs: `--training.global_batch_size` says the
k-GPU one). titanlite.diagnose over each model's series; expected: healthy.
faults: LLaMA's preset as a 2 -> N pair again, the N-GPU run with one fault that nothing in titanlite
plants:
  load  another process (started here, ended after the run) multiplying bf16 8192^2 matrices in a loop
        on GPU N-1 for the run's whole time; expected: straggler, rank N-1
  p2p   NCCL_P2P_DISABLE=1 in the job's environment (NCCL's peer-to-peer transport off); expected:
        communication
in each data-parallel mode of --fault-modes (default ddp: its gradient hooks let the run log separate
each rank's own compute from its wait for the others; under fsdp the waits for the parameter gathers
stay inside every rank's compute, titanlite/metrics/timing.py, so a slow rank or link shows as every
rank computing slower). The preset's own mode reuses the study's 2-GPU run when it ran in the same call.

Estimates: --predict-only (on the CPU machine, before the GPU call) runs `python -m estimation` with
each run's options, world size and `--estimate.hardware` of the preset's GPU, for k = 1, 2, 4, 8 up
to --ngpus, and for compare_peer's ddp and fsdp at --ngpus (the peer's shapes), into --predictions
(kept in the repository, so it travels with the tree). The GPU call prints each clean run's
predicted peak memory (allocated) and tokens/s per GPU beside the measured ones, with the error;
`--measured compare_peer.json` does the same for compare_peer's runs and nothing else.

Each run goes through benchmarks/launch.py (BENCH_ENV, its own process group, a timeout; a failure is
a row with the line that says why). The call ends within --budget seconds: a run that would not
finish in what is left is a row "not run". Writes node_study[_TAG].md, .json and _logs.tar.gz (each
run's whole output and run log, each diagnose report) to --out, again after every run. Options after
`--` go to every run and estimate. --debug: the debug model on CPU processes (the tests).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_peer  # noqa: E402
import launch  # noqa: E402  (benchmarks/launch.py: the one launcher)
import multinode  # noqa: E402
import scaling_study  # noqa: E402

PRESETS = {"llama": "train_configs/llama_1.36b_8x{gpu}.toml", "qwen3": "train_configs/qwen3_1.8b_8x{gpu}.toml"}
PARTS = ("study", "faults")
FAULTS = ("load", "p2p")
FAULT_MODES = ("ddp", "fsdp")
EXPECTED = {"load": "straggler", "p2p": "communication"}
PREDICTIONS = launch.ROOT / "benchmarks" / "results" / "node_study_predictions.json"
RESERVE_S = 40  # of the budget, kept for the diagnoses and the files

# The outside load: bf16 matmuls in a loop on one GPU (fp32 on one core with --debug) until SIGTERM,
# then how much it did, so the table shows it ran beside the job.
LOAD = """
import signal, sys, time, torch
device, size = sys.argv[1], int(sys.argv[2])
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
torch.set_num_threads(1)
dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
a = torch.randn(size, size, device=device, dtype=dtype)
b = torch.randn_like(a)
n, t0 = 0, time.time()
print("load started", flush=True)
try:
    while True:
        for _ in range(10):
            c = a @ b
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        n += 10
finally:
    s = time.time() - t0
    print(f"load: {n} matmuls of {size}^2 ({dtype}) on {device} in {s:.0f} s, {2 * size**3 * n / s / 1e12:.2f} TFLOP/s",
          flush=True)
"""


@dataclass
class Preset:
    """A model's 8-GPU preset, read for weak scaling: the per-GPU work it runs, kept at every world size."""
    model: str
    args: list[str]  # --job.config_file PRESET (with --debug, the debug model's shapes)
    local: int
    accum: int  # micro-steps per GPU per optimizer step on the preset's GPUs
    mode: str  # its data-parallel mode

    def at(self, k: int, mode: str = "") -> list[str]:
        """Options of the run on k GPUs: the preset's local batch and accumulation per GPU (global batch
        local x accum x k), in data-parallel `mode` where it is not the preset's own."""
        other = ["--parallelism.data_parallel", mode] if mode and mode != self.mode else []
        return [*self.args, *other, "--training.local_batch_size", str(self.local),
                "--training.global_batch_size", str(self.local * self.accum * k)]


def preset(model: str, gpu: str, debug: bool = False, local: int = 0) -> Preset:
    """The preset's per-GPU work; `local` > 0 replaces its local batch (the accumulation kept)."""
    p = _preset(model, gpu, debug)
    return replace(p, local=local) if local else p


def _preset(model: str, gpu: str, debug: bool) -> Preset:
    if debug:
        args = ["--job.config_file", "train_configs/debug_model.toml", "--model.name", model, *multinode.DEBUG_SHAPES]
        return Preset(model, args, 2, 2, compare_peer.dp_mode(args))
    path = PRESETS[model].format(gpu=gpu)
    toml = tomllib.loads((launch.ROOT / path).read_text())
    local, total, ranks = toml["training"]["local_batch_size"], toml["training"]["global_batch_size"], toml["estimate"]["ngpu"]
    return Preset(model, ["--job.config_file", path], local, total // (local * ranks), toml["parallelism"]["data_parallel"])


def preset_gpus() -> list[str]:
    """The GPUs every model has an 8-GPU preset for (h100, h200, b200)."""
    found = [{p.name.split("_8x")[1][:-5] for p in (launch.ROOT / "train_configs").glob(Path(f).name.format(gpu="*"))}
             for f in PRESETS.values()]
    return sorted(set.intersection(*found))


def sizes(n: int) -> list[int]:
    """1, 2, 4, 8, ... up to n, and n."""
    return sorted({2 ** i for i in range(n.bit_length()) if 2 ** i <= n} | {n})


# ----------------------------------------------------------------------------------------- the load
def start_load(device: str, size: int, name: str) -> tuple[subprocess.Popen, Path]:
    """The outside load on `device`, its own process group; back once it computes (or has exited)."""
    log = launch.WORK / f"{name}.load.log"
    launch.WORK.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        p = subprocess.Popen([sys.executable, "-c", LOAD, device, str(size)], stdout=fh, stderr=subprocess.STDOUT,
                             env=launch.bench_env(), start_new_session=True)
    deadline = time.time() + 120
    while p.poll() is None and "load started" not in log.read_text() and time.time() < deadline:
        time.sleep(0.2)
    print(f"[{time.strftime('%H:%M:%S')}] {name}: load on {device}, pid {p.pid}", flush=True)
    return p, log


def stop_load(p: subprocess.Popen, log: Path) -> dict:
    """End the load (its process group, as launch ends a timed-out run); what it did, and whether it ran to the end."""
    ran = p.poll() is None
    launch._kill_group(p)
    lines = log.read_text(errors="replace").strip().splitlines()
    said = next((ln for ln in reversed(lines) if ln.startswith("load:")), (lines or ["no output"])[-1])
    return {"pid": p.pid, "ran_to_the_end": ran, "exit": p.returncode, "gone": launch._gone(p.pid),
            "summary": said if ran else f"the load ended before the run: {said}"}


# ------------------------------------------------------------------------------------------ running
class Study:
    def __init__(self, a):
        self.a, self.rows, self.results, self.diagnoses = a, [], [], []
        self.deadline = time.time() + a.budget
        for tag in a.merge:  # the rows of earlier calls of the same study (other GPUs of this host, in this call)
            self.rows += json.loads((a.out / f"node_study_{tag}.json").read_text())["rows"]
        self.predictions = json.loads(Path(a.predictions).read_text()) if Path(a.predictions).exists() else {}

    def run(self, p: Preset, k: int, fault: str = "", mode: str = "") -> str:
        """One run of preset `p` on k GPUs (in data-parallel `mode` where not the preset's), clean or with
        `fault`, in the time left; its table row. Returns its name."""
        mode = "" if mode == p.mode else mode
        name = f"{p.model}_{k}gpu" + (f"_{mode}" if mode else "") + self.a.batch_tag + (f"_{fault}" if fault else "")
        if any(x["name"] == name for x in self.rows):
            return name
        a, args = self.a, [*p.at(k, mode), *self.a.extra]
        timeout = int(min(a.timeout, self.deadline - RESERVE_S - time.time()))
        load, log = None, None
        if timeout < 60:
            r = launch.Result(name, k, args, error=f"not run: the call's --budget ({a.budget} s) is spent")
        else:
            # on CPU, one thread per process at every size (torchrun's default for several), so the runs compare
            env = {**({"NCCL_P2P_DISABLE": "1"} if fault == "p2p" else {}), **({"OMP_NUM_THREADS": "1"} if a.debug else {})}
            proc = start_load("cpu" if a.debug else f"cuda:{k - 1}", 256 if a.debug else 8192, name) if fault == "load" else None
            try:
                r = launch.run_train(name, args, k, a.steps, a.log_freq, timeout, env=env)
            finally:
                load = stop_load(*proc) if proc else None
            log = launch.run_log(launch.WORK / name)
        self.results.append(r)
        f = r.figures(a.skip) if not r.error else {}
        row = {"name": name, "model": p.model, "k": k, "mode": mode or p.mode, "fault": fault, "error": r.error,
               "wall_s": round(r.wall_s, 1),
               "local": p.local, "accum": p.accum, "global_batch": p.local * p.accum * k, **f,
               "load": load,
               "log": str(log or "")}
        if not fault:
            row.update(self.estimate(p.model + (f" {mode}" if mode else ""), args, k, f))
        self.rows.append(row)
        self.save()
        return name

    def estimate(self, case: str, args: list[str], k: int, f: dict) -> dict:
        """The prediction made before the call for these options on k GPUs, beside the measured figures."""
        pred = self.predictions.get(key(case, self.a.gpu, k))
        if pred is None or pred["options"] != args:
            why = "no prediction" if pred is None else "predicted for other options"
            return {"predicted": None, "prediction_note": f"{why} (--predict-only on the CPU machine)"}
        return {"predicted": pred, "err_mem": pct(pred.get("peak_gib"), f.get("mem")),
                "err_tps_gpu": pct(pred.get("tokens_per_sec_per_gpu"), f.get("tps_gpu"))}

    def diagnose(self, series: str, names: list[str], expected: str) -> None:
        """titanlite.diagnose over the logs of runs `names` (smallest world size first) that left one."""
        runs = [x for n in names for x in self.rows if x["name"] == n and x["log"]]
        d = (scaling_study.diagnose(series, [x["log"] for x in runs]) if len(runs) >= 2 else
             {"name": series, "verdict": None, "error": "not run: fewer than two runs of it have a log"})
        d["gpus"], d["expected"] = [x["k"] for x in runs], expected
        self.diagnoses.append(d)
        self.save()

    def save(self) -> None:
        for x in self.rows:  # each run's tokens/s per GPU as a share of its model's 1-GPU run, wherever that ran
            base = next((y.get("tps_gpu") for y in self.rows if y["name"] == f"{x['model']}_1gpu"), None)
            x["of_one"] = x["tps_gpu"] / base if base and x.get("tps_gpu") else None
        text = report(self.a, self.rows, self.diagnoses, self.results)
        launch.save(self.a.out, self.a.stem, text, self.results,
                    {"argv": self.a.argv, "gpu": self.a.gpu_name, "preset_gpu": self.a.gpu, "ngpus": self.a.ngpus,
                     "rows": self.rows, "diagnoses": self.diagnoses})
        archive(self.a.out / f"{self.a.stem}_logs.tar.gz", self.rows, self.diagnoses)


def study(a) -> int:
    """The runs of world sizes --sizes; the diagnoses in the call that runs the node's size (N), over
    this call's runs and those --merge reads."""
    s = Study(a)
    closes = a.ngpus in a.sizes
    for model in a.models if "study" in a.parts else []:
        p = preset(model, a.gpu, a.debug, a.local_batch)
        names = [s.run(p, k) if k in a.sizes else f"{p.model}_{k}gpu{a.batch_tag}" for k in sizes(a.ngpus)]
        if closes:
            s.diagnose(model, names, "healthy")
    if "faults" in a.parts:
        p = preset("llama", a.gpu, a.debug, a.local_batch)
        for mode in a.fault_modes:
            pair = (s.run(p, 2, mode=mode) if 2 in a.sizes else
                    f"{p.model}_2gpu" + (f"_{mode}" if mode != p.mode else "") + a.batch_tag)
            for fault in a.faults if closes else []:
                expected = EXPECTED[fault] + (f", rank {a.ngpus - 1}" if fault == "load" else "")
                s.diagnose(f"{fault}_{mode}", [pair, s.run(p, a.ngpus, fault, mode)], expected)
    text = report(a, s.rows, s.diagnoses, s.results)
    print("\n" + text, flush=True)
    short = any(x["load"] and not x["load"]["ran_to_the_end"] for x in s.rows)
    return 1 if any(r.error for r in s.results) or any(d.get("error") for d in s.diagnoses) or short else 0


# --------------------------------------------------------------------------------------- estimates
def key(case: str, gpu: str, k: int) -> str:
    return f"{case} | {gpu} | {k}"


def pct(predicted, measured) -> float | None:
    return 100 * (predicted / measured - 1) if predicted is not None and measured else None


def predict(options: list[str], k: int, gpu: str, timeout: int) -> dict:
    """`python -m estimation OPTIONS` for k GPUs of `gpu`: predicted peak memory (allocated) and tokens/s per GPU."""
    full = [*options, "--estimate.ngpu", str(k), "--estimate.hardware", gpu, "--estimate.search=false"]
    r, error, wall = launch.estimate(f"estimate_{gpu}_{k}gpu", full, timeout)
    res = {"options": options, "command": " ".join(["python", "-m", "estimation", *full]),
           "date": time.strftime("%Y-%m-%d"), "elapsed_s": round(wall, 1)}
    if r is None:
        return {**res, "error": error}
    t = (r.get("throughput") or {}).get("overlap") or {}
    return {**res, "peak_gib": r["memory"]["peak_gib"], "fits": r["memory"]["fits"],
            "tokens_per_sec_per_gpu": t.get("tokens_per_sec_per_gpu"), "mfu_pct": t.get("mfu_pct")}


def predict_only(a) -> int:
    """Predict every clean run of the study and compare_peer's ddp and fsdp at --ngpus, for each GPU asked."""
    path = Path(a.predictions)
    done = json.loads(path.read_text()) if path.exists() else {}
    cases = [(model, preset(model, gpu, a.debug).at(k) + a.extra, k, gpu)
             for gpu in a.gpus for model in a.models for k in sizes(a.ngpus)]
    if not a.debug:
        cases += [(f"peer {mode}", [*launch.PEER_SHAPES, *compare_peer.SUITES["scaling"][mode], *a.extra], k, gpu)
                  for gpu in a.gpus for mode in compare_peer.SUITES["scaling"] for k in sizes(a.ngpus) if k > 1]
    failed = 0
    for i, (case, options, k, gpu) in enumerate(cases):
        p = done[key(case, gpu, k)] = predict(options, k, gpu, a.timeout)
        failed += "error" in p
        print(f"[{i + 1}/{len(cases)}] {key(case, gpu, k)}: " + (p.get("error") or
              f"peak {p['peak_gib']:.2f} GiB, {launch.fmt(p['tokens_per_sec_per_gpu'], ',.0f')} tok/s/GPU"), flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(done, indent=1, sort_keys=True) + "\n")
    print(f"predictions: {path}")
    return 1 if failed else 0


def measured(a) -> int:
    """compare_peer's titanlite runs (its JSON) against the predictions of the same options and world size."""
    runs = launch.load(a.measured)
    predictions = json.loads(Path(a.predictions).read_text()) if Path(a.predictions).exists() else {}
    lines = [f"compare_peer's runs ({a.measured}) against the estimate made before the call ({a.predictions}), "
             f"{a.gpu}; steady after step {a.skip}", "",
             "| run | GPUs | peak alloc GiB | predicted | err % | tok/s/GPU | predicted | err % |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        mode = next((m for m in compare_peer.SUITES["scaling"] if r.name == f"{m}_{r.ngpus}gpu"), None)
        p = predictions.get(key(f"peer {mode}", a.gpu, r.ngpus)) if mode else None
        if p is None or r.error:
            continue
        f = r.figures(a.skip)
        lines.append(f"| {r.name} | {r.ngpus} | {launch.fmt(f.get('mem'), '.2f')} | {launch.fmt(p.get('peak_gib'), '.2f')} | "
                     f"{launch.fmt(pct(p.get('peak_gib'), f.get('mem')), '+.1f')} | {launch.fmt(f.get('tps_gpu'), ',.0f')} | "
                     f"{launch.fmt(p.get('tokens_per_sec_per_gpu'), ',.0f')} | "
                     f"{launch.fmt(pct(p.get('tokens_per_sec_per_gpu'), f.get('tps_gpu')), '+.1f')} |")
    print("\n".join(lines))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"{a.stem}_measured.md").write_text("\n".join(lines) + "\n")
    return 0 if len(lines) > 4 else 1


# ------------------------------------------------------------------------------------------- report
def report(a, rows: list[dict], diagnoses: list[dict], results: list[launch.Result]) -> str:
    first = next((r for r in results if r.startup), None)
    torch = f", torch {first.startup['software'].get('torch')}" if first else ""
    head = (f"{a.ngpus} x {a.gpu_name}{torch}, {time.strftime('%Y-%m-%d')}: the 8 x {a.gpu} presets "
            f"(--debug: the debug model on CPU), {a.steps} steps, steady state after step {a.skip}. Weak scaling: "
            f"every run keeps the preset's local batch and accumulation per GPU, global batch = local x accumulation x "
            f"GPUs. Peaks are allocated memory; predicted: python -m estimation before the call (error: predicted / "
            f"measured - 1).")
    lines = [head, "", "| run | GPUs | global batch | tok/s/GPU | of 1 GPU | MFU % | peak GiB | predicted GiB (err %) | "
             "predicted tok/s/GPU (err %) | wall s | note |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in rows:
        pred = x.get("predicted") or {}
        batch = f"{x['local']} x {x['accum']} x {x['k']} = {x['global_batch']}"
        note = x["error"] or (x["load"] or {}).get("summary") or x.get("prediction_note") or pred.get("error") or ""
        if x["error"]:
            lines.append(f"| {x['name']} | {x['k']} | {batch} | - | - | - | - | - | - | {x['wall_s']:.0f} | {note} |")
            continue
        lines.append(
            f"| {x['name']} | {x['k']} | {batch} | {launch.fmt(x.get('tps_gpu'), ',.0f')} | "
            f"{launch.fmt(x.get('of_one'), '.1%')} | "
            f"{launch.fmt(x.get('mfu'), '.1f')} | {launch.fmt(x.get('mem'), '.2f')} | "
            f"{versus(pred.get('peak_gib'), x.get('err_mem'), '.2f')} | "
            f"{versus(pred.get('tokens_per_sec_per_gpu'), x.get('err_tps_gpu'), ',.0f')} | "
            f"{x['wall_s']:.0f} | {note} |")
    lines += ["", "| diagnosis | GPUs | verdict | expected | confidence | rank named | efficiency by GPUs |",
              "|---|---|---|---|---|---|---|"]
    for d in diagnoses:
        eff = " -> ".join(f"{k}: {100 * v:.1f}%" for k, v in d.get("efficiency") or [])
        lines.append(f"| {d['name']} | {', '.join(map(str, d['gpus']))} | {d.get('verdict') or d.get('error')} | {d['expected']} | "
                     f"{d.get('confidence') or '-'} | {launch.fmt(d.get('straggler_rank'), 'd')} | {eff or '-'} |")
    lines += [""] + [f"{d['name']}: {d['finding']}" for d in diagnoses if d.get("finding")]
    return "\n".join(lines)


def versus(predicted, err, spec: str) -> str:
    return "-" if predicted is None else f"{predicted:{spec}} ({launch.fmt(err, '+.1f')})"


def archive(path: Path, rows: list[dict], diagnoses: list[dict]) -> None:
    """One file of every run's whole output, run log and load output, and every diagnose report."""
    with tarfile.open(path, "w:gz") as tar:
        for x in rows:
            for f in (launch.WORK / f"{x['name']}.log", Path(x["log"]) if x["log"] else None,
                      launch.WORK / f"{x['name']}.load.log"):
                if f is not None and f.is_file():
                    tar.add(f, arcname=f"{x['name']}/{f.name}")
        for d in diagnoses:
            if d.get("folder") and Path(d["folder"]).is_dir():
                tar.add(d["folder"], arcname=f"diagnose_{d['name']}")


# --------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = launch.Parser(__doc__)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--models", default=",".join(PRESETS), help=f"comma-separated, of {', '.join(PRESETS)}")
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {', '.join(FAULTS)}")
    ap.add_argument("--fault-modes", default="ddp", help=f"data-parallel modes of the fault pairs, of {', '.join(FAULT_MODES)}")
    ap.add_argument("--ngpus", type=int, default=0, help="N (default: every GPU visible; 8 with --predict-only)")
    ap.add_argument("--preset-gpu", default="", help="the presets' GPU (default: nvidia-smi's; with --predict-only "
                                                     "comma-separated, default h100,h200)")
    ap.add_argument("--sizes", default="", help="comma-separated world sizes this call runs (default: 1, 2, 4, ... N); "
                                                "a call without N leaves the diagnoses to the one with it")
    ap.add_argument("--merge", default="", help="comma-separated tags of earlier calls in --out whose runs this one "
                                                "adds (calls side by side on other GPUs of the host)")
    ap.add_argument("--local-batch", type=int, default=0, help="every run's local batch instead of the preset's (its "
                                                               "accumulation kept; runs named _bN): a fault where "
                                                               "communication is a larger share of the step")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip", type=int, default=10, help="log steps up to this one are warm-up")
    ap.add_argument("--log-freq", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=300, help="seconds before a run is killed")
    ap.add_argument("--budget", type=int, default=540, help="seconds the whole call may take")
    ap.add_argument("--tag", default="", help="suffix of the output files' names (one per call)")
    ap.add_argument("--predictions", default=str(PREDICTIONS), help="the estimates' file")
    ap.add_argument("--predict-only", action="store_true", help="write the estimates (CPU machine) and stop")
    ap.add_argument("--measured", default="", help="compare_peer.json: its runs against the estimates, and stop")
    ap.add_argument("--debug", action="store_true", help="the debug model on CPU processes (a check of the script)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")), help="folder for the table, JSON "
                                                                                      "and logs (default: $OUT or .)")
    a = ap.parse_args(own)
    a.argv, a.extra = argv, extra
    a.stem = "node_study" + (f"_{a.tag}" if a.tag else "")
    a.batch_tag = f"_b{a.local_batch}" if a.local_batch else ""
    for opt, allowed in (("parts", PARTS), ("models", tuple(PRESETS)), ("faults", FAULTS), ("fault_modes", FAULT_MODES)):
        setattr(a, opt, [x for x in getattr(a, opt).split(",") if x])
        if bad := [x for x in getattr(a, opt) if x not in allowed]:
            ap.error(f"--{opt.replace('_', '-')}: unknown {', '.join(bad)}; choose from {', '.join(allowed)}")
    if a.steps <= a.skip or a.steps < 2:
        ap.error(f"--steps ({a.steps}) must be at least 2 and above --skip ({a.skip})")
    known = preset_gpus()
    names = launch.gpu_names()
    a.gpus = [g for g in a.preset_gpu.split(",") if g] or (["h100", "h200"] if a.predict_only else ["h100"] if a.debug else [])
    if not a.gpus and names:
        from titanlite.hardware import lookup

        hw = lookup(names[0])
        if hw is None or hw.key not in known:
            ap.error(f"no 8-GPU preset for this host's '{names[0]}'; --preset-gpu picks one of {', '.join(known)}")
        a.gpus = [hw.key]
    if not a.gpus:
        ap.error(f"no GPU visible (nvidia-smi); --preset-gpu names the presets' GPU ({', '.join(known)}), --debug runs on CPU")
    if bad := [g for g in a.gpus if g not in known]:
        ap.error(f"--preset-gpu: no 8-GPU preset for {', '.join(bad)}; choose from {', '.join(known)}")
    if len(a.gpus) > 1 and not a.predict_only:
        ap.error("--preset-gpu takes one GPU except with --predict-only")
    a.gpu, a.gpu_name = a.gpus[0], "CPU processes" if a.debug else (names[0] if names else "no GPU")
    if a.measured:
        if not Path(a.measured).is_file():
            ap.error(f"--measured: no such file {a.measured}")
        return measured(a)
    a.ngpus = a.ngpus or (8 if a.predict_only else 2 if a.debug else len(names))
    if a.ngpus < 2:
        ap.error(f"the study needs at least 2 GPUs (4 or 8: a node); {a.ngpus} visible")
    try:
        a.sizes = [int(k) for k in a.sizes.split(",") if k] or sizes(a.ngpus)
    except ValueError:
        ap.error(f"--sizes takes comma-separated world sizes; got {a.sizes!r}")
    if bad := [k for k in a.sizes if k not in sizes(a.ngpus)]:
        ap.error(f"--sizes: {', '.join(map(str, bad))} not among the study's {', '.join(map(str, sizes(a.ngpus)))}")
    if not (a.debug or a.predict_only) and max(a.sizes) > len(names):
        ap.error(f"--sizes asks for {max(a.sizes)} GPUs; {len(names)} visible")
    a.merge = [t for t in a.merge.split(",") if t]
    if missing := [t for t in a.merge if not (a.out / f"node_study_{t}.json").is_file()]:
        ap.error(f"--merge: no node_study_{missing[0]}.json in {a.out}")
    return predict_only(a) if a.predict_only else study(a)


if __name__ == "__main__":
    sys.exit(main())

"""The main command on the GPU at hand: what the memory check at start-up does, and what it costs.

Each case is `./run_train.sh` as a user types it (through titanlite.launch: the option check, the
memory check beside the ranks' start-up, the job), with few steps. The table says per case what the
start-up did (ran as written / started again at local batch B x accumulation A / refused, with the
line), when the memory check's line came, the time to the first step's log line, the peak memory
allocated, and the wall time. The pair `*_check` / `*_off` runs a configuration that fits with the
check and without, back to back after a run of the same shapes (compile caches warm for both): the
difference of their times to the first step is what the check costs a run that fits.

On 2 x H100 (one GPU through CUDA_VISIBLE_DEVICES=0 NGPU=1, then both), and on one H200:
  CUDA_VISIBLE_DEVICES=0 python3 benchmarks/memory_fit.py --ngpus 1 --out $OUT
  python3 benchmarks/memory_fit.py --ngpus 2 --out $OUT
  python3 benchmarks/memory_fit.py --ngpus 1 --out $OUT          (H200)
Cases (--cases a,b): llama, qwen (the B200 presets as shipped, memory_fit=adjust), llama_refuse,
qwen_refuse (the same with memory_fit=check), fit_check, fit_off (the pair: on an H200 the LLaMA
preset as written; elsewhere the batch the check chose for it).
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import (WORK, Parser, execute, fmt, fresh_folder, gpu_names, run_log, run_train_command,  # noqa: E402
                    timed_lines)

PRESETS = {"llama": "train_configs/llama_1.36b_b200.toml", "qwen": "train_configs/qwen3_1.8b_b200.toml"}
FIRST_STEP = re.compile(r"^(?:\[rank0\]:)?step\s+1/")
RESTART = re.compile(r"starting again (?:with activation_checkpoint\.mode=(\w+) )?at local batch (\d+) x accumulation "
                     r"(\d+).* keeps the global batch (\d+)")


def run(name: str, args: list[str], ngpus: int, steps: int, timeout: int) -> dict:
    """`NGPU=ngpus ./run_train.sh ARGS`, every output line timed from the start; its run log read back."""
    folder = fresh_folder(WORK / name)
    cmd, env = run_train_command(args, ngpus, steps, 1, folder)
    rc, text, wall = execute(name, cmd, timeout, env=env, timed=True)
    lines = timed_lines(text)
    log = run_log(folder)
    entries = json.loads(log.read_text()).get("training_iterations", []) if log else []
    res = {"name": name, "ngpus": ngpus, "cmd": cmd, "rc": rc, "wall_s": round(wall, 1),
           "first_step_s": next((round(t, 1) for t, line in lines if FIRST_STEP.match(line)), None),
           "peak_gib": max((e.get("memory_peak_gb") or 0 for e in entries), default=None),
           "reserved_gib": max((e.get("memory_reserved_peak_gb") or 0 for e in entries), default=None),
           "steps": len(entries), "tail": [line for _, line in lines[-40:]]}
    res["did"], res["check_s"], res["line"] = did(lines, rc, "--training.memory_fit" in args and "off" in args)
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {res['did']} | first step {fmt(res['first_step_s'], '.1f')} s | "
          f"{wall:.0f} s", flush=True)
    return res


def did(lines: list[tuple[float, str]], rc: int | None, off: bool) -> tuple[str, float | None, str | None]:
    """What the start-up did, when the memory check's line came, and that line."""
    for t, line in lines:
        text = re.sub(r"^\[rank\d+\]:", "", line)
        if m := RESTART.search(text):
            return f"{f'AC {m[1]}, ' if m[1] else ''}local batch {m[2]} x accumulation {m[3]} (started again)", t, text
        if text.startswith("error:") and ("needs a predicted" in text or "does not fit even at" in text):
            return "refused", t, text
        if text.startswith(("memory check:", "warning: memory check:", "memory check skipped")):
            verdict = "ran as written" + (" (tight)" if text.startswith("warning") else "")
            return (verdict if rc == 0 else f"exit {rc}"), t, text
    failure = next((line for _, line in reversed(lines) if line.startswith("error:")), None)
    ran = "ran as written (no check)" if off else "ran as written (done before the check answered)"
    return (ran if rc == 0 else f"exit {rc}"), None, failure


def cases(chosen: dict) -> dict[str, list[str]]:
    """The command-line options of each case; the pair runs what fits: the preset where it ran as
    written, else the local batch the check chose."""
    fit = ["--job.config_file", PRESETS["llama"]]
    if chosen:
        fit += ["--training.local_batch_size", str(chosen["local"]), "--training.global_batch_size",
                str(chosen["global_batch"])] + (["--activation_checkpoint.mode", chosen["ac"]] if chosen["ac"] else [])
    return {"llama": ["--job.config_file", PRESETS["llama"]],
            "qwen": ["--job.config_file", PRESETS["qwen"]],
            "llama_refuse": ["--job.config_file", PRESETS["llama"], "--training.memory_fit", "check"],
            "qwen_refuse": ["--job.config_file", PRESETS["qwen"], "--training.memory_fit", "check"],
            "fit_check": [*fit, "--training.memory_fit", "check"],
            "fit_off": [*fit, "--training.memory_fit", "off"]}


def gpu_name() -> str:
    return (gpu_names() or ["no GPU"])[0]


def main(argv: list[str]) -> int:
    ap = Parser(__doc__)
    ap.add_argument("--ngpus", type=int, default=1)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--cases", default="llama,qwen,llama_refuse,qwen_refuse,fit_check,fit_off")
    ap.add_argument("--timeout", type=int, default=300, help="seconds before a case is killed")
    ap.add_argument("--out", type=Path, default=Path("."))
    a = ap.parse_args(argv)
    unknown = [name for name in a.cases.split(",") if name not in cases({})]
    if unknown or a.ngpus < 1 or a.steps < 1:
        ap.error(f"--cases: unknown case '{unknown[0]}'; choose from {', '.join(cases({}))}" if unknown else
                 "--ngpus and --steps must be positive")
    gpu = gpu_name()
    results, chosen = [], {}
    for name in a.cases.split(","):
        r = run(f"{name}_{a.ngpus}gpu", cases(chosen)[name], a.ngpus, a.steps, a.timeout)
        r["case"], r["gpu"] = name, gpu
        if name == "llama" and (m := RESTART.search(r["line"] or "")):
            chosen.update(ac=m[1], local=int(m[2]), global_batch=int(m[4]))
        results.append(r)
    rows = [f"| {r['case']} | {a.ngpus} x {r['gpu']} | {r['did']} | {fmt(r['check_s'], '.1f')} | "
            f"{fmt(r['first_step_s'], '.1f')} | {fmt(r['peak_gib'], '.2f')} | {r['wall_s']:.0f} |" for r in results]
    table = "\n".join([
        f"memory check at start-up, {a.ngpus} x {gpu}, {a.steps} steps, {time.strftime('%Y-%m-%d')}",
        "| case | GPUs | start-up did | check line at s | first step at s | peak GiB | wall s |",
        "|---|---|---|---|---|---|---|", *rows, "",
        *(f"{r['case']}: {r['line']}" for r in results if r["line"])])
    pair = {r["case"]: r["first_step_s"] for r in results if r["case"] in ("fit_check", "fit_off")}
    if None not in pair.values() and len(pair) == 2:
        table += (f"\nthe check's cost to a run that fits: first step at {pair['fit_check']:.1f} s with it, "
                  f"{pair['fit_off']:.1f} s without ({pair['fit_check'] - pair['fit_off']:+.1f} s)")
    print(table)
    a.out.mkdir(parents=True, exist_ok=True)
    stem = f"memory_fit_{a.ngpus}gpu"
    (a.out / f"{stem}.md").write_text(table + "\n")
    (a.out / f"{stem}.json").write_text(json.dumps({"gpu": gpu, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

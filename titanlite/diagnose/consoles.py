"""Parsers of three trainers' console output, as they print it: nanoGPT's, Megatron-LM's and titanlite's
own. Each writes the run log's keys (titanlite.diagnose.readers says which); what a format's lines do
not say is left out, for the command line's flags (--gpus, --local-batch, --seq-len, --accum) to give.

nanoGPT (karpathy/nanoGPT train.py), one line a logged iteration on the master process:
    iter 100: loss 3.2100, time 120.50ms, mfu 45.10%
  read: the iteration, its loss and its time (all micro-steps of the optimizer step). Start-up lines:
  "tokens per iteration will be: 491,520" (all processes' tokens a step), "Overriding: batch_size = 12"
  and "Overriding: block_size = 1024" (the configurator's overrides), "number of parameters: 123.69M";
  the accumulation per process follows from the tokens per iteration once the world size is given.
  Not read: the mfu, a running average over an assumed A100 peak that no one entry's time gives.
Megatron-LM (megatron/training/training.py, training_log), one line a log interval on the last rank:
    [2024-05-01 10:00:00] iteration      100/    1000 | consumed samples:        51200 | elapsed time per
    iteration (ms): 512.3 | learning rate: 3.000E-04 | global batch size:   512 | lm loss: 3.210000E+00 | ...
  read: the iteration, its time, the global batch, lm loss and grad norm; from the arguments block it
  prints at start-up ("  micro_batch_size ........ 4"): micro batch, sequence length, data-parallel size
  (the world size diagnose models; a run that also splits the model by tensor or pipeline parallelism is
  noted and its world size left to --gpus), and the global batch, which gives the accumulation. Not
  read: its TFLOP/s per GPU (its own FLOPs formula, with recomputation).
titanlite (titanlite.metrics.console), one line a log step, and the trainer's description at start-up:
    step     20/100 | loss  7.1234 | lr 3.00e-04 | gnorm  1.234 |    152.7 ms/step |     53,642 tok/s | ...
    model llama/1.36B: 1,294,159,104 params, 8.80 GFLOP/token | attention sdpa_cudnn | 4 x NVIDIA H100 80GB
    HBM3 (ddp) | global batch 16 = 4 x 4 x 1 accum | data: ...
  read: everything both lines say (tok/s is all GPUs') but the GFLOP/token, rounded to two decimals (the
  model's registry gives its FLOPs); the sequence length is in neither (--seq-len).
"""

from __future__ import annotations

import re
from pathlib import Path

from titanlite.hardware import lookup
from titanlite.metrics.run_log import LoggedRun, RunLogError


def number(s: str) -> float:
    return float(s.replace(",", ""))


def parts() -> dict[str, dict]:
    return {"config": {}, "hardware": {}, "model": {}}


def logged(path: Path, p: dict[str, dict], entries: list[dict], source: str, what: str, notes=()) -> LoggedRun:
    if not entries:
        raise RunLogError(f"{path}: no {what} lines in this {source} output")
    by_iter = {e["iter"]: e for e in entries}  # a step printed twice (a restart) keeps its last line
    return LoggedRun(path, p["config"], [by_iter[k] for k in sorted(by_iter)], p["hardware"], p["model"],
                     source=source, notes=list(notes))


# ------------------------------------------------------------------------------ nanoGPT
NANOGPT_ITER = re.compile(r"^iter (\d+): loss ([-+\d.eE]+|nan|inf), time ([\d.]+)ms", re.M)
NANOGPT_SETTINGS = [("tokens_per_iteration", re.compile(r"tokens per iteration will be: ([\d,]+)"), int),
                    ("batch_size", re.compile(r"^Overriding: batch_size = (\d+)", re.M), int),
                    ("seq_len", re.compile(r"^Overriding: block_size = (\d+)", re.M), int)]
NANOGPT_PARAMS = re.compile(r"number of parameters: ([\d.]+)M")


def is_nanogpt(text: str) -> bool:
    return bool(NANOGPT_ITER.search(text))


def parse_nanogpt(path: Path, text: str) -> LoggedRun:
    p = parts()
    for key, pattern, kind in NANOGPT_SETTINGS:
        if m := pattern.search(text):
            p["config"][key] = kind(number(m.group(1)))
    if m := NANOGPT_PARAMS.search(text):  # in millions, to two decimals: the collectives' bytes to 0.01%
        p["model"]["params"] = round(float(m.group(1)) * 1e6)
    entries = [{"iter": int(m.group(1)), "loss": float(m.group(2)), "time_ms": float(m.group(3))}
               for m in NANOGPT_ITER.finditer(text)]
    p["hardware"]["device"] = "cuda"
    return logged(path, p, entries, "nanogpt", "'iter N: loss ..., time ...ms'")


# ------------------------------------------------------------------------------ Megatron-LM
MEGATRON_LINE = re.compile(r"\biteration\s+(\d+)/\s*\d+ \|(.*)$", re.M)
MEGATRON_FIGURES = [("time_ms", re.compile(r"elapsed time per iteration \(ms\): ([\d.]+)")),
                    ("loss", re.compile(r"\blm loss: ([-+\d.eE]+|nan|inf)")),
                    ("grad_norm", re.compile(r"\bgrad norm: ([-+\d.eE]+|nan|inf)")),
                    ("global_batch_size", re.compile(r"global batch size:\s+(\d+)"))]
MEGATRON_ARG = re.compile(r"^\s+(\w+) \.+ (\S+)\s*$", re.M)
MEGATRON_ARGS = {"micro_batch_size": "batch_size", "seq_length": "seq_len", "global_batch_size": "global_batch_size",
                 "data_parallel_size": "world_size"}
MEGATRON_MODEL_PARALLEL = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")


def is_megatron(text: str) -> bool:
    return bool(MEGATRON_LINE.search(text)) and "elapsed time per iteration (ms):" in text


def parse_megatron(path: Path, text: str) -> LoggedRun:
    p, notes = parts(), []
    args = {m.group(1): m.group(2) for m in MEGATRON_ARG.finditer(text)}
    split = {k: int(v) for k in MEGATRON_MODEL_PARALLEL if (v := args.get(k, "1")).isdigit() and int(v) > 1}
    for arg, key in MEGATRON_ARGS.items():
        if args.get(arg, "").isdigit() and not (key == "world_size" and split):
            p["config"][key] = int(args[arg])
    if split:
        notes.append("the run also splits the model (" + ", ".join(f"{k}={v}" for k, v in split.items())
                     + "): diagnose models data parallelism, so the world size is not taken from it")
    if args.get("bf16") == "True":
        p["config"]["training.mixed_precision_param"] = "bfloat16"
    entries = []
    for m in MEGATRON_LINE.finditer(text):
        e = {"iter": int(m.group(1))}
        for key, pattern in MEGATRON_FIGURES:
            if v := pattern.search(m.group(2)):
                e[key] = float(v.group(1))
        if "global_batch_size" in e:  # a run's constant, printed on each line
            p["config"].setdefault("global_batch_size", int(e.pop("global_batch_size")))
        entries.append(e)
    p["hardware"]["device"] = "cuda"
    return logged(path, p, entries, "megatron", "'iteration N/ M | ... elapsed time per iteration (ms)'", notes)


# ------------------------------------------------------------------------------ titanlite's console
TITANLITE_STEP = re.compile(r"^step\s+(\d+)/\d+ \| loss\s+(\S+) \| lr (\S+) \| gnorm\s+(\S+) \|\s+([\d.]+) ms/step \|"
                            r"\s+([\d,]+) tok/s(?: \| mfu\s+([\d.]+)%)? \| mem ([\d.]+) GiB", re.M)
TITANLITE_DESCRIBE = re.compile(r"^model (\w+)/(\S+): ([\d,]+) params, ([\d.]+) GFLOP/token \| attention (\S+) \| "
                                r"(\d+) x (.+?) \((\w+)\) \| global batch (\d+) = (\d+) x (\d+) x (\d+) accum", re.M)


def is_titanlite_console(text: str) -> bool:
    return bool(TITANLITE_STEP.search(text))


def parse_titanlite_console(path: Path, text: str) -> LoggedRun:
    p = parts()
    if m := TITANLITE_DESCRIBE.search(text):
        name, flavor, params, _, attention, world, device, mode, gb, local, dp, accum = m.groups()
        # GFLOP/token is printed to two decimals, too coarse for small models: the registry gives the FLOPs
        p["model"].update(name=name, flavor=flavor, params=int(number(params)))
        p["config"].update({"model.name": name, "model.flavor": flavor, "attention_backend": attention,
                            "world_size": int(dp), "global_batch_size": int(gb), "batch_size": int(local),
                            "gradient_accumulation_steps": int(accum)})
        if int(world) > 1:
            p["config"]["data_parallel"] = mode
        # a CPU run names the processor (platform.processor()), a GPU run the device torch reports
        gpu = lookup(device) is not None or "nvidia" in device.lower()
        p["hardware"].update(name=device, device="cuda" if gpu else "cpu")
    entries = []
    for m in TITANLITE_STEP.finditer(text):
        it, loss, lr, gnorm, ms, tps, mfu, mem = m.groups()
        e = {"iter": int(it), "loss": float(loss), "lr": float(lr), "grad_norm": float(gnorm), "time_ms": float(ms),
             "tokens_per_sec": number(tps), "memory_peak_gb": float(mem)}
        if mfu is not None:
            e["mfu"] = float(mfu)
        entries.append(e)
    p["hardware"].setdefault("device", "cuda")
    return logged(path, p, entries, "titanlite_console", "'step N/M | loss ...' ")

"""Read the logs users have into `LoggedRun`s, whatever wrote them: one registry of formats, each a
detector and a parser, tried in order. No conversion step: the format is recognised from the text.

Formats (FORMATS):
  titanlite    titanlite's run log (run_<stamp>.json);
  json_log     the JSON run log of the earlier nanoGPT-style trainer (startup_info.config +
               training_iterations, the layout titanlite's run log keeps for its users' scripts);
  console      that trainer's console output saved to a file (settings block, then "Iter N" lines
               each followed by MFU / tokens/s / memory lines; tqdm and separator lines ignored);
  torchtitan   torchtitan's console output ("step: N  loss: ...  memory: ...GiB(...%)  tps: ...");
  nanogpt, megatron, titanlite_console
               nanoGPT's, Megatron-LM's and titanlite's own console output (titanlite.diagnose.consoles
               gives each line as its trainer prints it, and what is read from it).

Every parser writes the keys titanlite's run log uses, in titanlite's units: config world_size /
batch_size / gradient_accumulation_steps / global_batch_size / seq_len (plus tokens_per_iteration
where a log prints it), hardware name / peak_tflops_per_gpu (the peak the logger divided by),
model params / flops_per_token (what the logger used), and per entry iter, loss, time_ms,
tokens_per_sec (all GPUs) or tokens_per_sec_per_gpu, tflops (all GPUs) or tflops_per_gpu, mfu (%),
memory_*_gb, and warmup (an entry its logger marks as warm-up). Whether a logger's figures mean what
its format documents is not taken on trust here: titanlite.diagnose.reconstruct checks it.

`Settings` (the command line's --gpus, --local-batch, --seq-len, --accum, --hardware, --model)
supply what a log lacks and replace what it says; each value given is recorded in the run's
`overrides` so the report can mark it and the reconstruction takes it as fact.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from titanlite.diagnose import consoles
from titanlite.hardware import by_key
from titanlite.metrics.run_log import LoggedRun, RunLogError, from_dict
from titanlite.models import MODEL_REGISTRY, get_model_args
from titanlite.models.args import ModelArgs

# unreadable or incompatible input: the message is one line naming the file(s) and the cause
DiagnoseError = RunLogError


@dataclass
class Settings:
    """What the command line supplies for one log; None = what the log says."""
    gpus: int | None = None         # world size (data-parallel ranks)
    local_batch: int | None = None  # sequences per GPU per micro-step
    seq_len: int | None = None
    accum: int | None = None        # micro-steps per GPU per optimizer step
    hardware: str | None = None     # a titanlite.hardware key ("h100") or a device name
    model: str | None = None        # NAME/FLAVOR in titanlite's model registry ("llama/1.36B")


# Settings field -> (config key the run log uses, the flag that sets it)
SETTING_KEYS = {"gpus": ("world_size", "--gpus"), "local_batch": ("batch_size", "--local-batch"),
                "seq_len": ("seq_len", "--seq-len"), "accum": ("gradient_accumulation_steps", "--accum")}


@dataclass(frozen=True)
class Format:
    name: str
    description: str
    # what the format documents its logged rate to be: "total" (all GPUs) or "per_gpu"
    rate_scope: str
    detect: Callable[[str], bool]
    parse: Callable[[Path, str], LoggedRun]


# ------------------------------------------------------------------------------ JSON run logs
# The earlier trainer's JSON log names some figures differently; the first key present is used.
TIME_MS_KEYS = ("time_ms", "dt_ms", "iter_time_ms", "step_time_ms", "iteration_time_ms")
TIME_S_KEYS = ("dt", "time_s", "iter_time", "step_time", "iteration_time")
SEQ_KEYS = ("seq_len", "block_size", "sequence_length", "max_seq_len")
GPU_NAME_KEYS = ("name", "device_name", "gpu_name", "gpu")
PEAK_KEYS = ("peak_tflops_per_gpu", "peak_tflops", "hardware_peak_tflops")


@functools.lru_cache(maxsize=2)  # the detectors and the parser look at the same text
def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _is_run_log(text: str) -> bool:
    d = _json(text) if text.lstrip().startswith("{") else None
    return isinstance(d, dict) and isinstance(d.get("startup_info"), dict) and "training_iterations" in d


def _is_titanlite(text: str) -> bool:
    if not _is_run_log(text):
        return False
    s = _json(text)["startup_info"]
    return "titanlite" in (s.get("software") or {}) or "flops_convention" in (s.get("model") or {})


def _first(d: dict, keys) -> object:
    return next((d[k] for k in keys if d.get(k) is not None), None)


def parse_json(path: Path, text: str, source: str = "titanlite") -> LoggedRun:
    data = copy.deepcopy(_json(text))  # the cached parse stays as read
    if data is None:
        raise RunLogError(f"{path}: not valid JSON")
    run = from_dict(path, data, source)
    cfg, hw, model = run.config, run.hardware, run.model
    if cfg.get("seq_len") is None and (seq := _first(cfg, SEQ_KEYS)) is not None:
        cfg["seq_len"] = seq
    name = _first(hw, GPU_NAME_KEYS) or _first(cfg, GPU_NAME_KEYS[1:])
    if isinstance(name, str):
        hw["name"] = name
    if hw.get("peak_tflops_per_gpu") is None and (peak := _first({**cfg, **hw}, PEAK_KEYS)) is not None:
        hw["peak_tflops_per_gpu"] = peak
    if model.get("params") is None and (n := _first({**cfg, **model}, ("n_params", "num_params"))) is not None:
        model["params"] = n
    for e in run.iterations:
        if e.get("time_ms") is None:
            if (ms := _first(e, TIME_MS_KEYS)) is not None:
                e["time_ms"] = ms
            elif isinstance(s := _first(e, TIME_S_KEYS), (int, float)):
                e["time_ms"] = 1000.0 * s
    return run


# ------------------------------------------------------------------------------ the earlier trainer's console
CONSOLE_SETTINGS = {  # printed label (lower case) -> (where it goes, key, type)
    "batch size (micro)": ("config", "batch_size", int),
    "gradient accum steps": ("config", "gradient_accumulation_steps", int),
    "effective batch size": ("config", "global_batch_size", int),
    "tokens per iteration": ("config", "tokens_per_iteration", int),
    "sequence length": ("config", "seq_len", int),
    "block size": ("config", "seq_len", int),
    "gpus": ("config", "world_size", int),
    "compile": ("config", "compile", bool),
    "precision": ("config", "training.mixed_precision_param", str),
    "parallelism": ("config", "data_parallel", str),
    "device": ("hardware", "name", str),
    "hardware peak": ("hardware", "peak_tflops_per_gpu", float),
    "flops per token": ("model", "flops_per_token", float),
}
SETTING_LINE = re.compile(r"^\W*([A-Za-z][A-Za-z ()/_-]*?)\s*:\s+(.+?)\s*$")
ITER_LINE = re.compile(r"\bIter\s+(\d+)\b")
ENTRY_FIGURES = [  # (key, pattern, scale): figures on an Iter line or the lines after it
    ("loss", re.compile(r"(?i)\bloss:?\s+([-+]?(?:\d[\d.eE+-]*|nan|inf))"), 1.0),
    ("lr", re.compile(r"\bLR:\s*([\d.eE+-]+)"), 1.0),
    ("mfu", re.compile(r"\bMFU:\s*([\d.]+)\s*%"), 1.0),
    ("tflops", re.compile(r"\bAchieved:\s*([\d.,]+)\s*TF"), 1.0),
    ("peak_tflops", re.compile(r"\bPeak:\s*([\d.,]+)\s*TF"), 1.0),
    ("tokens_per_sec", re.compile(r"\bTokens/s:\s*([\d.,]+)"), 1.0),
    ("flops_per_token", re.compile(r"\bFLOPs/token:\s*([\d.]+)\s*GF"), 1e9),
    ("params", re.compile(r"\bN=([\d.]+)B\b"), 1e9),
    ("memory_gb", re.compile(r"([\d.]+)\s*GB alloc"), 1.0),
    ("memory_peak_gb", re.compile(r"([\d.]+)\s*GB peak"), 1.0),
    ("memory_reserved_gb", re.compile(r"([\d.]+)\s*GB reserved"), 1.0),
]
ITER_TIME = re.compile(r"(?i)\btime:?\s+([\d.,]+)\s*(ms|s)\b")


def _is_console(text: str) -> bool:
    return ("TRAINING CONFIGURATION" in text or "Gradient accum steps" in text) and bool(ITER_LINE.search(text))


def _num(s: str) -> float:
    return float(s.replace(",", ""))


def _setting(kind, raw: str):
    raw = raw.split("(")[0].strip() if kind is not str else raw.strip()
    if kind is bool:
        return raw.lower() in ("true", "yes", "on", "1")
    if kind is str:
        return raw
    m = re.match(r"[\d.,]+", raw)
    if not m:
        raise ValueError(raw)
    return kind(_num(m.group(0)))


def parse_console(path: Path, text: str) -> LoggedRun:
    parts: dict[str, dict] = {"config": {}, "hardware": {}, "model": {}}
    entries: list[dict] = []
    for line in text.splitlines():  # splitlines also splits tqdm's carriage returns
        if m := ITER_LINE.search(line):
            entries.append({"iter": int(m.group(1)), "warmup": "warming up" in line.lower()})
            if t := ITER_TIME.search(line):
                entries[-1]["time_ms"] = _num(t.group(1)) * (1000.0 if t.group(2).lower() == "s" else 1.0)
        elif not entries and (m := SETTING_LINE.match(line)) and m.group(1).lower() in CONSOLE_SETTINGS:
            where, key, kind = CONSOLE_SETTINGS[m.group(1).lower()]
            try:
                parts[where][key] = _setting(kind, m.group(2))
            except ValueError:
                continue
            if key == "flops_per_token":
                parts[where][key] *= 1e9
        if not entries:
            continue
        for key, pattern, scale in ENTRY_FIGURES:
            if (v := pattern.search(line)) and key not in entries[-1]:
                entries[-1][key] = float(v.group(1).replace(",", "")) * scale
    if not entries:
        raise RunLogError(f"{path}: no 'Iter N' lines in this console output")
    cfg, hw, model = parts["config"], parts["hardware"], parts["model"]
    for e in entries:  # constants printed on every iteration belong to the run
        for key, where in (("peak_tflops", hw), ("flops_per_token", model), ("params", model)):
            if key in e:
                target = "peak_tflops_per_gpu" if key == "peak_tflops" else key
                where.setdefault(target, e.pop(key))
    if isinstance(cfg.get("data_parallel"), str):
        cfg["data_parallel"] = cfg["data_parallel"].lower()
    hw.setdefault("device", "cuda")
    return LoggedRun(path, cfg, entries, hw, model, source="console")


# ------------------------------------------------------------------------------ torchtitan's console
# torchtitan 0.2.2 and 0.3.0 print the same lines (their metrics and trainer code), through Python
# logging ("[titan] DATE - root - INFO - ..."), coloured with ANSI codes; torchrun's --tee with --role
# rank puts "[rank0]:" before each line on the console. Read here:
#   Building device mesh with parallelism: pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=1, ep=1[, etp=1]
#   CUDA capacity: NVIDIA H100 80GB HBM3 with 79.11GiB memory
#   Model llama3 1.36B size: 1,294,159,104 total parameters
#   Peak FLOPS used for computing MFU: 9.890e+14
#   Compiling each TransformerBlock with torch.compile
#   Trainer is initialized with local batch size 4, global batch size 8, gradient accumulation steps 1,
#       sequence length 2048, total steps 30 (warmup 10)
#   step:  5  loss:  9.12345  grad_norm:  2.3456  memory: 28.80GiB(30.31%)  tps: 53,409  tflops: 356.06  mfu: 45.12%
# "memory" is the caching allocator's max reserved since the previous step line; tps, tflops and mfu
# are one GPU's (mfu "N/A" under 0.3.0's quantized training).
ANSI = re.compile(r"\x1b\[[0-9;]*m")
TT_STEP = re.compile(r"(?<!validate )\bstep:\s*(\d+)\s+loss:\s*([-+\d.eE]+|nan|inf)")  # not its validation lines
TT_FIGURES = [("grad_norm", re.compile(r"\bgrad_norm:\s*([-+\d.eE]+|nan|inf)"), 1.0),
              ("memory_reserved_peak_gb", re.compile(r"\bmemory:\s*([\d.]+)\s*GiB"), 1.0),
              ("tokens_per_sec_per_gpu", re.compile(r"\btps:\s*([\d,.]+)"), 1.0),
              ("tflops_per_gpu", re.compile(r"\btflops:\s*([\d,.]+)"), 1.0),
              ("mfu", re.compile(r"\bmfu:\s*([\d.]+)%"), 1.0),
              ("time_ms", re.compile(r"\bstep_time:\s*([\d.]+)s"), 1000.0)]
TT_SETTINGS = [("hardware", "name", re.compile(r"(?:CUDA|GPU) capacity:\s*(.+?)\s+with\s"), str, 1.0),
               ("hardware", "peak_tflops_per_gpu", re.compile(r"Peak FLOPS used for computing MFU:\s*([\d.eE+]+)"),
                float, 1e-12),
               ("config", "batch_size", re.compile(r"local batch size (\d+)"), int, 1),
               ("config", "global_batch_size", re.compile(r"global batch size (\d+)"), int, 1),
               ("config", "gradient_accumulation_steps", re.compile(r"gradient accumulation steps (\d+)"), int, 1),
               ("config", "seq_len", re.compile(r"sequence length (\d+)"), int, 1),
               ("model", "params", re.compile(r"size:\s*([\d,]+) total parameters"), int, 1)]
TT_MESH = re.compile(r"Building device mesh with parallelism:\s*(.+)")
TT_COMPILE = "Compiling each TransformerBlock with torch.compile"
# data-parallel degrees -> titanlite's name for the mode: replicate (all-reduce), shard, both
TT_MODES = {(True, False): "ddp", (False, True): "fsdp", (True, True): "hsdp"}


def _is_torchtitan(text: str) -> bool:
    return bool(TT_STEP.search(ANSI.sub("", text))) and "tps:" in text


def torchtitan_steps(text: str) -> list[dict]:
    """torchtitan's training step lines as run-log entries (iter, loss, and each figure the line has),
    one per step in step order; a step printed twice (several ranks, a restart) keeps its last line."""
    out: dict[int, dict] = {}
    for line in ANSI.sub("", text).splitlines():
        if m := TT_STEP.search(line):
            e = {"iter": int(m.group(1)), "loss": float(m.group(2))}
            for key, pattern, scale in TT_FIGURES:
                if v := pattern.search(line):
                    e[key] = _num(v.group(1)) * scale
            out[e["iter"]] = e
    return [out[k] for k in sorted(out)]


def torchtitan_world(text: str, cfg: dict, notes: list[str]) -> None:
    """World size and data-parallel mode from the device-mesh line; without it (one GPU builds no
    mesh), the world size from global batch = local batch x accumulation x data-parallel ranks."""
    if m := TT_MESH.search(text):
        dims = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(1))}
        model_parallel = {k: v for k, v in dims.items() if k in ("pp", "cp", "tp") and v > 1}
        if model_parallel:
            notes.append("the device mesh also splits the model (" + ", ".join(f"{k}={v}" for k, v in
                                                                              model_parallel.items())
                         + "): diagnose models data parallelism, so the world size is not taken from it")
            return
        rep, shard = dims.get("dp_replicate", 1), dims.get("dp_shard", 1)
        cfg["world_size"] = rep * shard
        if rep * shard > 1:
            cfg["data_parallel"] = TT_MODES[rep > 1, shard > 1]
        return
    gb, local, accum = (cfg.get(k) for k in ("global_batch_size", "batch_size", "gradient_accumulation_steps"))
    if gb and local and accum and gb % (local * accum) == 0:
        cfg["world_size"] = gb // (local * accum)


def parse_torchtitan(path: Path, text: str) -> LoggedRun:
    text = ANSI.sub("", text)
    parts: dict[str, dict] = {"config": {}, "hardware": {}, "model": {}}
    for where, key, pattern, kind, scale in TT_SETTINGS:
        if m := pattern.search(text):
            parts[where][key] = m.group(1).strip() if kind is str else kind(_num(m.group(1)) * scale)
    if TT_COMPILE in text:
        parts["config"]["compile"] = True
    notes: list[str] = []
    torchtitan_world(text, parts["config"], notes)
    entries = torchtitan_steps(text)
    if not entries:
        raise RunLogError(f"{path}: no 'step: N  loss: ...' lines in this torchtitan output")
    parts["hardware"].setdefault("device", "cuda")
    return LoggedRun(path, parts["config"], entries, parts["hardware"], parts["model"], source="torchtitan",
                     notes=notes)


FORMATS: list[Format] = [  # most specific first
    Format("titanlite", "titanlite run log (JSON)", "total", _is_titanlite, parse_json),
    Format("json_log", "JSON run log (startup_info.config + training_iterations)", "total", _is_run_log,
           lambda path, text: parse_json(path, text, "json_log")),
    Format("console", "console output of the nanoGPT-style trainer (settings block, 'Iter N' lines)", "total",
           _is_console, parse_console),
    Format("torchtitan", "torchtitan console output ('step: N  loss: ...  tps: ...')", "per_gpu",
           _is_torchtitan, parse_torchtitan),
    Format("nanogpt", "nanoGPT console output ('iter N: loss ..., time ...ms')", "total", consoles.is_nanogpt,
           consoles.parse_nanogpt),
    Format("megatron", "Megatron-LM console output ('iteration N/ M | ... elapsed time per iteration (ms)')", "total",
           consoles.is_megatron, consoles.parse_megatron),
    Format("titanlite_console", "titanlite console output ('step N/M | loss ... ms/step ... tok/s')", "total",
           consoles.is_titanlite_console, consoles.parse_titanlite_console),
]
BY_NAME = {f.name: f for f in FORMATS}


def registry_args(model: dict, config: dict) -> ModelArgs | None:
    """The model a log (or --model) names, from titanlite's registry with the run's vocabulary; None
    when it names none that is registered."""
    name, flavor = model.get("name"), model.get("flavor")
    if name in MODEL_REGISTRY and flavor in MODEL_REGISTRY[name].flavors:
        vocab = config.get("model.vocab_size")
        return get_model_args(name, flavor, vocab if isinstance(vocab, int) and vocab > 0 else 0)
    return None


def labels(logs: list[LoggedRun]) -> list[str]:
    """'2 GPUs', '8 GPUs', and '#1', '#2' for runs of the same size; ranks for CPU runs."""
    unit = "GPU" if all(log.hardware.get("device", "cuda") == "cuda" for log in logs) else "rank"
    worlds = [log.config["world_size"] for log in logs]
    out, seen = [], {}
    for w in worlds:
        seen[w] = seen.get(w, 0) + 1
        out.append(f"{w} {unit}{'s' if w > 1 else ''}" + (f" #{seen[w]}" if worlds.count(w) > 1 else ""))
    return out


def refuse_duplicates(paths: list[str]) -> None:
    """The same log twice is no comparison: refuse the same file, and a byte-identical copy."""
    seen: dict[str, str] = {}
    for p in paths:
        try:
            key = hashlib.sha256(Path(p).read_bytes()).hexdigest()
        except OSError:
            continue  # the reader names the problem
        if key in seen:
            same = os.path.realpath(seen[key]) == os.path.realpath(p)
            raise RunLogError(f"{seen[key]} and {p} are {'the same file' if same else 'identical logs'}: "
                                "a scaling diagnosis compares different runs (give one log alone for a "
                                "single-run report)")
        seen[key] = p


def read(path: str | Path, settings: Settings | None = None) -> LoggedRun:
    """Detect the format, parse, apply the command-line settings, check that the run's shape is known."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise RunLogError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise RunLogError(f"{path}: is a folder; give the log files themselves") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RunLogError(f"{path}: cannot read ({e.__class__.__name__}: {e})") from None
    fmt = next((f for f in FORMATS if f.detect(text)), None)
    if fmt is None:
        if text.lstrip().startswith("{") and _json(text) is None:
            try:
                json.loads(text)
            except json.JSONDecodeError as e:
                raise RunLogError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
        raise RunLogError(f"{path}: not a titanlite run log nor another log diagnose reads ("
                          + "; ".join(f.description for f in FORMATS[1:]) + ")")
    run = fmt.parse(path, text)
    apply_settings(run, settings or Settings())
    check_shape(run)
    return run


def apply_settings(run: LoggedRun, s: Settings) -> None:
    """Every value a flag gives is recorded in `overrides` (what the log said, or None), even where the
    log says the same: a value from the command line is a fact the reconstruction does not question."""
    for name, (key, _) in SETTING_KEYS.items():
        value = getattr(s, name)
        if value is not None:
            run.overrides[key] = (run.config.get(key), value)
            run.config[key] = value
    if s.hardware:
        hw = by_key(s.hardware)
        name = hw.device_name if hw else s.hardware
        run.overrides["hardware"] = (run.hardware.get("name"), name)
        run.hardware.update(name=name, device="cuda")
    if s.model:  # the model given replaces the log's: its name and size (the all-reduce's bytes)
        name, _, flavor = s.model.partition("/")
        old = f"{run.model.get('name')}/{run.model.get('flavor')}" if run.model.get("name") else None
        run.overrides["model"] = (old, s.model)
        run.model.update(name=name, flavor=flavor)
        run.config.update({"model.name": name, "model.flavor": flavor})
        run.model["params"] = registry_args(run.model, run.config).num_params()


def check_shape(run: LoggedRun) -> None:
    """World size, local batch and sequence length are needed to know what a step was; accumulation
    defaults to 1 when a log does not say (noted). A sequence length that only the printed tokens per
    iteration give is derived from it, and that figure then stops being a check."""
    cfg = run.config
    if cfg.get("seq_len") is None and cfg.get("tokens_per_iteration") and cfg.get("batch_size") \
            and cfg.get("world_size") and cfg.get("gradient_accumulation_steps"):
        seq = cfg["tokens_per_iteration"] / (cfg["batch_size"] * cfg["gradient_accumulation_steps"] * cfg["world_size"])
        if seq == int(seq) and seq >= 1:
            cfg["seq_len"] = int(seq)
            del cfg["tokens_per_iteration"]
            run.notes.append(f"sequence length {int(seq)} derived from the printed tokens per iteration "
                             "(pass --seq-len to give it)")
    # a log that prints the step's whole batch but not its accumulation (nanoGPT's tokens per iteration,
    # Megatron-LM's global batch) gives it once the world size and micro-batch are known
    local, world, seq = (cfg.get(k) for k in ("batch_size", "world_size", "seq_len"))
    for key, per_micro, what in (("global_batch_size", 1, "global batch"),
                                 ("tokens_per_iteration", seq, "tokens per iteration")):
        total = cfg.get(key)
        if cfg.get("gradient_accumulation_steps") is None and total and local and world and per_micro \
                and total % (local * world * per_micro) == 0:
            cfg["gradient_accumulation_steps"] = total // (local * world * per_micro)
            run.notes.append(f"accumulation {cfg['gradient_accumulation_steps']} derived from the printed {what} "
                             "(pass --accum to give it)")
    for name, (key, flag) in SETTING_KEYS.items():
        v = cfg.get(key)
        if v is None and name == "accum":
            cfg[key] = 1
            run.notes.append("accumulation is not in the log: 1 micro-step per step assumed (pass --accum)")
            continue
        if v is None:
            what = {"gpus": "world size", "local_batch": "local batch size", "seq_len": "sequence length"}[name]
            raise RunLogError(f"{run.path}: the log does not say its {what}: pass {flag}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 1 or int(v) != v:
            raise RunLogError(f"{run.path}: {key} must be a positive integer, got {v!r}")
        cfg[key] = int(v)
    good = [e for e in run.iterations if isinstance(e.get("iter"), int)
            and any(isinstance(e.get(k), (int, float)) for k in ("time_ms", "tokens_per_sec", "tokens_per_sec_per_gpu"))]
    if not good:
        raise RunLogError(f"{run.path}: no training_iterations with 'iter' and a time or tokens/s "
                          "(did the run log a step?)")
    bad_time = [e for e in good if isinstance(e.get("time_ms"), (int, float)) and e["time_ms"] <= 0]
    if bad_time:
        raise RunLogError(f"{run.path}: iter {bad_time[0]['iter']} has a time per iteration of {bad_time[0]['time_ms']}")
    run.iterations = good

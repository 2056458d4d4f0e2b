"""The run log: the writer, a typed loader, and the one steady-state rule every reader of a log uses.

`<dump_folder>/run_<timestamp>.json`, valid JSON between updates. The layout is what the analysis
snippets of the seed guides (the guides written for the nanoGPT-style trainer titanlite replaces)
read: {"startup_info": {"config": {...}, ...}, ..., "training_iterations": [{...}, ...]}. It is
written on one line, so `tail -1 run_*.json | python -c "import json,sys; json.load(sys.stdin)"`
(their live-MFU monitor) parses it.

How it is written: a log step's entry is appended in place, one small write over the closing
`]}` (the iterations are the last key for that), because rewriting the whole file at every log step
grows with the run: at 5,000 entries a rewrite takes a few hundred milliseconds of host time, which
a long run pays at every log step. The rarer updates (startup, validation, the summary) rewrite a
temporary file and rename it over the log (atomic on POSIX).

Readers: `load` / `load_all` give `LoggedRun`s (the tools load through them; diagnose's readers of
other formats fill the same type), `steady` splits a run's entries into warm-up and steady state
(every reader of a log, the Trainer's summary included, uses it), `throughput` gives a run's rates
by the one throughput rule (THROUGHPUT_RULE), `summarize` the end-of-run figures, and `ran` says what
a run ran, from its resolved configuration (the tools' and reports' label of a run).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class RunLog:
    def __init__(self, folder: str | os.PathLike, startup_info: dict, stamp: str | None = None):
        self.folder = Path(folder)
        self.stamp = stamp or _unique_stamp(self.folder)
        self.path = self.folder / f"run_{self.stamp}.json"
        self.data = {"startup_info": startup_info, "validation": [], "summary": {}, "training_iterations": []}
        self.flush()

    def append(self, entry: dict) -> None:
        its = self.data["training_iterations"]
        its.append(entry)
        with open(self.path, "r+b") as fh:
            fh.seek(-len(_END), os.SEEK_END)
            fh.write(b"," * (len(its) > 1) + _dumps(entry).encode() + _END)

    def add_validation(self, entry: dict) -> None:
        self.data["validation"].append(entry)
        self.flush()

    def set_summary(self, summary: dict) -> None:
        self.data["summary"] = summary
        self.flush()

    def flush(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        with open(tmp, "wb") as fh:
            fh.write(_dumps(self.data).encode() + b"\n")
        os.replace(tmp, self.path)


_END = b"]}\n"  # how the file ends: the iterations' list, the object, the line


def host_facts(threads_per_process: int, data_workers: int) -> dict:
    """The host side of a run that changes its speed, for the startup record: the machine's CPUs, the
    CPUs this process may run on (its affinity, as taskset or a scheduler's binding sets it) and the
    cgroup's CPU quota (a container's limit, in CPUs; None where there is none), the ranks started on
    this host (torchrun's LOCAL_WORLD_SIZE; 1 for a lone process), the process's intra-op threads (torchrun sets
    OMP_NUM_THREADS=1 when it starts several processes, where a plain one-process launch uses every core)
    and the data workers each process starts."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0
    per_host = os.environ.get("LOCAL_WORLD_SIZE")  # None where a launcher of several ranks does not say
    ranks = int(per_host) if per_host else 1 if os.environ.get("WORLD_SIZE", "1") == "1" else None
    return {"cpus": os.cpu_count() or 0, "cpus_affinity": affinity, "cpu_quota": cpu_quota(), "ranks_per_host": ranks,
            "threads_per_process": threads_per_process, "data_workers": data_workers}


# where a process's cgroup CPU limit is written: cgroup v2 (quota and period on one line, "max" for none),
# then v1's CFS files (a quota of -1 for none); /proc/self/cgroup names the process's own group
CGROUP = Path("/sys/fs/cgroup")


def cpu_quota(root: Path = CGROUP) -> float | None:
    """The CPUs the process's cgroup lets it use (quota / period), None where no limit is set or readable."""
    own = {}
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for c in controllers.split(",") if controllers else ["v2"]:
                own[c] = path.lstrip("/")
    except (OSError, ValueError):
        pass
    for folder in dict.fromkeys([root / own.get("v2", ""), root]):
        try:
            quota, period = (folder / "cpu.max").read_text().split()[:2]
        except (OSError, ValueError):
            continue
        return None if quota == "max" else int(quota) / int(period)
    for folder in dict.fromkeys([root / "cpu" / own.get("cpu", ""), root / "cpu", root / "cpu,cpuacct"]):
        try:
            quota = int((folder / "cpu.cfs_quota_us").read_text())
            period = int((folder / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return quota / period if quota > 0 and period > 0 else None
    return None


def _dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _unique_stamp(folder: Path) -> str:
    """run_<YYYYmmdd_HHMMSS>, suffixed _1, _2, ... when several runs start in the same second."""
    base = time.strftime("%Y%m%d_%H%M%S")
    stamp, n = base, 0
    while (folder / f"run_{stamp}.json").exists():
        n += 1
        stamp = f"{base}_{n}"
    return stamp


# ----------------------------------------------------------------------------------- steady state
WARMUP_FRACTION = 0.10
STEADY_RULE = (f"entries with iter <= max(1, {WARMUP_FRACTION:.0%} of the last logged iter) are warm-up "
               "(start-up, compilation, allocator growth; plus cuda_graphs_warmup + 1 steps when CUDA graphs "
               "are on), as are entries their logger marks as warm-up; they are excluded and the rest are the "
               "steady state")


@dataclass
class Steady:
    """A run's log entries split by the steady-state rule."""
    entries: list[dict]   # the steady entries; the last entry alone when every entry is warm-up
    warmup: int           # entries counted as warm-up
    cutoff: int           # iter <= cutoff is warm-up
    only_warmup: bool     # no entry is past the warm-up: `entries` holds start-up time

    @property
    def note(self) -> str:
        if self.only_warmup and self.entries:
            return (f"every entry is within the warm-up (iter <= {self.cutoff}); the last entry "
                    f"(iter {self.entries[-1]['iter']}) is used")
        return ""


def warmup_cutoff(last_iter: int, config: dict | None = None) -> int:
    """The rule's warm-up of a run logged up to `last_iter`: log steps with iter <= this."""
    config = config or {}
    cutoff = max(1, int(WARMUP_FRACTION * last_iter))
    if config.get("use_cuda_graphs") or config.get("training.cuda_graphs"):
        cutoff += int(config.get("training.cuda_graphs_warmup", 10)) + 1
    return cutoff


def steady(entries: list[dict], config: dict | None = None, warmup_steps: int | None = None) -> Steady:
    """The one steady-state rule (STEADY_RULE). `warmup_steps` replaces the rule's cutoff with a
    fixed one (the tools' --warmup: the seed guides skip a fixed count)."""
    config = config or {}
    logged = [e for e in entries if isinstance(e.get("iter"), int)]
    if not logged:
        return Steady([], 0, 0, True)
    cutoff = warmup_cutoff(max(e["iter"] for e in logged), config) if warmup_steps is None else warmup_steps
    rest = [e for e in logged if e["iter"] > cutoff and not e.get("warmup")]
    if not rest:
        return Steady(logged[-1:], len(logged), cutoff, True)
    return Steady(rest, len(logged) - len(rest), cutoff, False)


def step_losses(entries: list[dict]) -> dict[int, float]:
    """step -> loss of every optimizer step in a run log's entries: each entry's `step_losses` are
    the steps since the previous entry, ending at its `iter` (a log without them: its `loss`)."""
    out = {}
    for e in entries:
        losses = e.get("step_losses") or [e["loss"]]
        out.update({e["iter"] - len(losses) + 1 + i: v for i, v in enumerate(losses)})
    return out


def mean(values) -> float | None:
    vals = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else None


THROUGHPUT_RULE = ("a run's tokens/s (all GPUs and per GPU), MFU and step time are the means of its steady "
                   "entries' logged figures (every entry covers the same number of steps); every tool that "
                   "reports a run's throughput uses this rule")


def throughput(steady_entries: list[dict]) -> dict[str, float | None]:
    """A run's rates by THROUGHPUT_RULE, from entries already split by the steady-state rule:
    tokens_per_sec, tokens_per_sec_per_gpu, mfu_pct, step_ms (None where no entry logs the figure)."""
    return {"tokens_per_sec": mean(e.get("tokens_per_sec") for e in steady_entries),
            "tokens_per_sec_per_gpu": mean(e.get("tokens_per_sec_per_gpu") for e in steady_entries),
            "mfu_pct": mean(e.get("mfu") for e in steady_entries),
            "step_ms": mean(e.get("time_ms") for e in steady_entries)}


def summarize(iterations: list[dict], config: dict | None = None, warmup_steps: int | None = None) -> dict:
    """End-of-run figures: the last loss; the run's throughput (THROUGHPUT_RULE: tokens/s all GPUs and
    per GPU, MFU (%), step time); the largest peak memory of the whole run. Figures a log does not
    have are left out rather than given as None."""
    if not iterations:
        return {}
    st = steady(iterations, config, warmup_steps).entries
    out = {"final_loss": iterations[-1].get("loss"), **throughput(st),
           "peak_memory_gb": max((e["memory_peak_gb"] for e in iterations if e.get("memory_peak_gb") is not None),
                                 default=None),
           "peak_reserved_gb": max((v for e in iterations if (v := e.get("memory_reserved_peak_gb",
                                                                         e.get("memory_reserved_gb"))) is not None),
                                   default=None)}
    digits = {"final_loss": 4, "tokens_per_sec": None, "tokens_per_sec_per_gpu": None, "mfu_pct": 2, "step_ms": 2}
    return {k: round(v, digits[k]) if k in digits else v for k, v in out.items() if v is not None}


# ----------------------------------------------------------------------------------- typed loader
class RunLogError(Exception):
    """Unreadable input: the message is one line naming the file and the cause."""


@dataclass
class LoggedRun:
    """One run's log, read into its parts. Readers of other formats (titanlite.diagnose.readers)
    fill the same fields with the same keys, so everything downstream reads one shape."""
    path: Path
    config: dict[str, Any]        # startup_info.config: the seed-snippet keys + every resolved option
    iterations: list[dict]        # training_iterations: one entry per log step
    hardware: dict[str, Any] = field(default_factory=dict)   # name, count, peak_tflops_per_gpu, ...
    model: dict[str, Any] = field(default_factory=dict)      # name, flavor, params, flops_per_token, ...
    summary: dict[str, Any] = field(default_factory=dict)
    source: str = "titanlite"     # the format it was read from
    # settings a command-line flag supplied or replaced: {key: (what the log said or None, the flag's value)}
    overrides: dict[str, tuple] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what a reader had to assume or derive

    @property
    def world_size(self) -> int | None:
        return self.config.get("world_size")

    @property
    def label(self) -> str:
        """What the run ran (`ran`): the tools' and reports' name for it."""
        return ran(self.config, self.model, self.hardware)

    def steady(self, warmup_steps: int | None = None) -> Steady:
        return steady(self.iterations, self.config, warmup_steps)

    def summarize(self, warmup_steps: int | None = None) -> dict:
        return summarize(self.iterations, self.config, warmup_steps)


def ran(config: dict, model: dict | None = None, hardware: dict | None = None) -> str:
    """What a run ran, from its resolved configuration, never from its free-text description (a preset's
    description stays as it was when options change the run): model, dataset and its path,
    data-parallel mode and world size, and compile / CUDA graphs where on; e.g. 'llama/debug,
    prepared data/mycorpus, fsdp, 2 GPUs, compile'. What a log does not record is left out."""
    model = model or {}
    name, flavor = config.get("model.name", model.get("name")), config.get("model.flavor", model.get("flavor"))
    parts = [f"{name}/{flavor}" if name and flavor else name or ""]
    if dataset := config.get("training.dataset"):
        parts.append(f"{dataset} {config['training.dataset_path']}" if config.get("training.dataset_path") else dataset)
    world = config.get("world_size")
    if isinstance(world, int) and world > 1 and config.get("data_parallel"):
        parts.append(str(config["data_parallel"]))
    if isinstance(world, int):
        unit = "GPU" if (hardware or {}).get("device", "cuda") == "cuda" else "rank"
        parts.append(f"{world} {unit}{'s' if world != 1 else ''}")
    parts += [what for key, what in (("compile", "compile"), ("use_cuda_graphs", "CUDA graphs")) if config.get(key)]
    return ", ".join(p for p in parts if p) or "run"


def from_dict(path: Path, data: Any, source: str = "titanlite") -> LoggedRun:
    """A parsed JSON run log as a LoggedRun; RunLogError naming what is missing."""
    if not isinstance(data, dict) or "training_iterations" not in data \
            or not isinstance(data.get("startup_info"), dict) or not isinstance(data["startup_info"].get("config"), dict):
        raise RunLogError(f"{path}: not a run log (needs startup_info.config and training_iterations)")
    its = data["training_iterations"]
    if not isinstance(its, list) or not its:
        raise RunLogError(f"{path}: the run log has no training_iterations entries yet")
    s = data["startup_info"]
    return LoggedRun(Path(path), s["config"], [e for e in its if isinstance(e, dict)],
                     s.get("hardware") or {}, s.get("model") or {}, data.get("summary") or {}, source)


def read_json(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise RunLogError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RunLogError(f"{path}: cannot read ({e.__class__.__name__}: {e})") from None
    except json.JSONDecodeError as e:
        raise RunLogError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None


def load(path: str | os.PathLike) -> LoggedRun:
    return from_dict(Path(path), read_json(Path(path)))


def expand(inputs: list[str]) -> list[Path]:
    """Files as given; folders become their run_*.json files, oldest first."""
    out = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = sorted(p.glob("run_*.json"), key=os.path.getmtime)
            if not found:
                raise RunLogError(f"{p}: no run_*.json run logs in this folder")
            out.extend(found)
        elif p.exists():
            out.append(p)
        else:
            raise RunLogError(f"{p}: no such file or folder")
    return out


def load_all(inputs: list[str]) -> list[LoggedRun]:
    return [load(p) for p in expand(inputs)]

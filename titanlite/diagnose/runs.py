"""Read titanlite run logs into `Run` summaries: steady-state step time, throughput and per-rank phases.

Warm-up rule (stated in every report): a log entry is warm-up when its `iter` is at most
max(1, 10% of the last logged iter) (plus `training.cuda_graphs_warmup` + 1 when CUDA graphs
are on): it holds start-up, compilation, allocator growth and graph capture. The remaining
entries are summarised by their median. If no entry is left, the last entry is used and the
report says so.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

PHASES = ("data", "compute", "comm", "optimizer", "idle")
WARMUP_FRACTION = 0.10
WARMUP_RULE = (f"entries with iter <= max(1, {WARMUP_FRACTION:.0%} of the last logged iter) are warm-up "
               "(start-up, compilation, allocator growth; plus cuda_graphs_warmup + 1 steps when CUDA graphs "
               "are on) and are excluded; each figure is the median over the remaining entries")


class DiagnoseError(Exception):
    """Unreadable or incompatible input: the message is one line naming the file and the cause."""


@dataclass
class Run:
    path: str
    label: str
    config: dict
    hardware: dict
    model: dict
    world: int
    local_batch: int
    accum: int
    global_batch: int
    seq_len: int
    entries: list[dict]  # steady-state entries
    excluded: int  # warm-up entries dropped
    warmup_note: str = ""
    # per rank: {rank: {phase: [ms per step, one per steady entry]}}; empty without a breakdown
    rank_phases: dict[int, dict[str, list]] = field(default_factory=dict)
    breakdown_method: str | None = None

    # ----------------------------------------------------------------- derived figures
    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def tokens_per_gpu_step(self) -> int:
        return self.local_batch * self.accum * self.seq_len

    @property
    def step_ms(self) -> float:
        return median(e["time_ms"] for e in self.entries)

    @property
    def tokens_per_sec(self) -> float:
        """From the primary measurements (config tokens per step, clock): not the logged figure."""
        return self.tokens_per_step / (self.step_ms / 1000)

    @property
    def tokens_per_sec_logged(self) -> float | None:
        return median(e.get("tokens_per_sec") for e in self.entries)

    @property
    def per_gpu(self) -> float:
        return self.tokens_per_sec / self.world

    @property
    def mfu_logged(self) -> float | None:
        return median(e.get("mfu") for e in self.entries)

    @property
    def memory_gb(self) -> float | None:
        return median(e.get("memory_peak_gb", e.get("memory_gb")) for e in self.entries)

    @property
    def device(self) -> str:
        return str(self.hardware.get("device", "cuda"))

    @property
    def has_breakdown(self) -> bool:
        return bool(self.rank_phases)

    def phase(self, phase: str, rank: int) -> float | None:
        """Median ms per optimizer step of one phase on one rank (None when not measured)."""
        return median(self.rank_phases.get(rank, {}).get(phase, []))

    def phase_series(self, phase: str) -> list[float]:
        """Per steady entry, the fastest rank's ms per step of a phase (for the jitter estimate)."""
        cols = [v for r in self.rank_phases if len(v := self.rank_phases[r].get(phase, [])) == len(self.entries)]
        return [min(c[i] for c in cols) for i in range(len(self.entries))] if cols else []

    @property
    def step_jitter_ms(self) -> float:
        return iqr(e["time_ms"] for e in self.entries)

    def phase_over_ranks(self, phase: str, how=min) -> float | None:
        """A phase's ms per step reduced over ranks: `min` = what even the fastest rank pays, which
        keeps one slow rank (and the others' waits for it) out of run-wide figures."""
        vals = [v for r in self.rank_phases if (v := self.phase(phase, r)) is not None]
        return how(vals) if vals else None


def iqr(values) -> float:
    """Inter-quartile range: the entry-to-entry jitter a difference must beat to count as evidence."""
    vals = sorted(float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v))
    if len(vals) < 2:
        return 0.0
    q = statistics.quantiles(vals, n=4, method="inclusive")
    return q[2] - q[0]


def median(values) -> float | None:
    vals = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    return statistics.median(vals) if vals else None


def _require(d: dict, key: str, where: str, path: str):
    if not isinstance(d, dict) or key not in d or d[key] is None:
        raise DiagnoseError(f"{path}: not a titanlite run log ({where} has no '{key}')")
    return d[key]


def _int(v, key: str, path: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 1 or int(v) != v:
        raise DiagnoseError(f"{path}: startup_info.config.{key} must be a positive integer, got {v!r}")
    return int(v)


def load_run(path: str | Path) -> Run:
    path = str(path)
    try:
        with open(path) as fh:
            data = json.load(fh)
    except FileNotFoundError:
        raise DiagnoseError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DiagnoseError(f"{path}: cannot read ({e.__class__.__name__}: {e})") from None
    except json.JSONDecodeError as e:
        raise DiagnoseError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
    startup = _require(data, "startup_info", "the file", path)
    config = _require(startup, "config", "startup_info", path)
    iters = _require(data, "training_iterations", "the file", path)
    world = _int(_require(config, "world_size", "startup_info.config", path), "world_size", path)
    local = _int(_require(config, "batch_size", "startup_info.config", path), "batch_size", path)
    accum = _int(config.get("gradient_accumulation_steps", 1), "gradient_accumulation_steps", path)
    seq = _int(_require(config, "seq_len", "startup_info.config", path), "seq_len", path)
    global_batch = _int(config.get("global_batch_size", local * world * accum), "global_batch_size", path)
    good = [e for e in iters if isinstance(e, dict) and isinstance(e.get("iter"), int)
            and isinstance(e.get("time_ms"), (int, float)) and e["time_ms"] > 0]
    if not good:
        raise DiagnoseError(f"{path}: no training_iterations with 'iter' and a positive 'time_ms' (did the run log a step?)")
    steady, excluded, note = split_warmup(good, config)
    run = Run(path=path, label="", config=config, hardware=startup.get("hardware") or {},
              model=startup.get("model") or {}, world=world, local_batch=local, accum=accum,
              global_batch=global_batch, seq_len=seq, entries=steady, excluded=excluded, warmup_note=note)
    run.rank_phases, run.breakdown_method = read_breakdown(steady)
    return run


def split_warmup(entries: list[dict], config: dict) -> tuple[list[dict], int, str]:
    last = max(e["iter"] for e in entries)
    cutoff = max(1, int(WARMUP_FRACTION * last))
    if config.get("use_cuda_graphs") or config.get("training.cuda_graphs"):
        cutoff += int(config.get("training.cuda_graphs_warmup", 10)) + 1
    steady = [e for e in entries if e["iter"] > cutoff]
    if not steady:
        return entries[-1:], len(entries) - 1, (f"every entry is within the warm-up (iter <= {cutoff}); "
                                                f"the last entry (iter {entries[-1]['iter']}) is used")
    return steady, len(entries) - len(steady), ""


def read_breakdown(entries: list[dict]) -> tuple[dict[int, dict[str, list]], str | None]:
    """Per-rank phase times from each entry's `breakdown`, in either schema:
    new: {"ranks": [{"rank", "step_ms", "data_ms", ...}], "method": ...};
    old: a flat {"data_ms", "compute_ms", "optimizer_ms"} for rank 0 only (idle = step - phases)."""
    out: dict[int, dict[str, list]] = {}
    method = None
    for e in entries:
        bd = e.get("breakdown")
        if not isinstance(bd, dict):
            continue
        if isinstance(bd.get("ranks"), list):
            rows, method = bd["ranks"], bd.get("method", method)
        elif "compute_ms" in bd:
            row = {"rank": 0, **bd}
            known = sum(v for p in PHASES if isinstance(v := bd.get(f"{p}_ms"), (int, float)))
            row.setdefault("idle_ms", max(0.0, e["time_ms"] - known))
            rows, method = [row], bd.get("method", "wall_clock")
        else:
            continue
        for row in rows:
            if not isinstance(row, dict) or not isinstance(row.get("rank"), int):
                continue
            per = out.setdefault(row["rank"], {p: [] for p in PHASES})
            for p in PHASES:
                v = row.get(f"{p}_ms")
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    per[p].append(float(v))
    return out, method


def load_runs(paths: list[str]) -> list[Run]:
    """Load and label the runs, ordered by world size (the smallest is the scaling baseline)."""
    runs = sorted((load_run(p) for p in paths), key=lambda r: r.world)
    unit = "GPU" if all(r.device == "cuda" for r in runs) else "rank"
    counts: dict[int, int] = {}
    for r in runs:
        counts[r.world] = counts.get(r.world, 0) + 1
    seen: dict[int, int] = {}
    for r in runs:
        seen[r.world] = seen.get(r.world, 0) + 1
        r.label = f"{r.world} {unit}{'s' if r.world > 1 else ''}"
        if counts[r.world] > 1:
            r.label += f" #{seen[r.world]}"
    return runs

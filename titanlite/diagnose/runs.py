"""Diagnose's view of a run: steady-state step time, work per step and per-rank phases.

Logs are read by titanlite.diagnose.readers (any supported format) and split into warm-up and
steady state by the run log's one rule (titanlite.metrics.run_log.steady). The step time and phase
times the analysis rests on are medians over the steady entries (a stray slow entry does not move
them); the logged rates and MFU, the run's throughput as every tool reports it, are their means
(run_log.THROUGHPUT_RULE). The work per step is what the reconstruction chose
(titanlite.diagnose.reconstruct): the printed accumulation unless the log's other figures show the
GPUs ran something else.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from titanlite.diagnose.figures import iqr, median  # noqa: F401  (benchmarks read iqr here)
from titanlite.metrics.run_log import STEADY_RULE, THROUGHPUT_RULE, LoggedRun, ran, steady, throughput

PHASES = ("data", "compute", "comm", "optimizer", "idle")
# the GPU's own readings a titanlite log carries per rank and log step (titanlite.metrics.nvml): the share of
# the interval with a kernel running, board power, SM clock
GPU_READINGS = ("gpu_util_pct", "power_w", "sm_clock_mhz")
WARMUP_RULE = (STEADY_RULE + ". Step time and phase times are medians over the steady entries (a stray slow entry "
               "does not move them); the logged tokens/s and MFU are their means, the run's throughput as every "
               "tool reports it (" + THROUGHPUT_RULE + ")")



@dataclass
class Run:
    path: str
    label: str
    config: dict
    hardware: dict
    model: dict
    world: int
    local_batch: int
    accum: int  # micro-steps per GPU per optimizer step, as reconstructed
    global_batch: int  # as printed
    seq_len: int
    entries: list[dict]  # steady-state entries
    excluded: int  # warm-up entries dropped
    warmup_note: str = ""
    only_warmup: bool = False  # every entry is warm-up: `entries` is the last one, start-up included
    accum_printed: int = 0
    source: str = "titanlite"
    step_ms_derived: float | None = None  # a log without a time per iteration: from its rate, as reconstructed
    # per rank: {rank: {phase: [ms per step, one per steady entry]}}; empty without a breakdown
    rank_phases: dict[int, dict[str, list]] = field(default_factory=dict)
    breakdown_method: str | None = None

    # ----------------------------------------------------------------- derived figures
    @property
    def tokens_per_step(self) -> int:
        return self.local_batch * self.accum * self.world * self.seq_len

    @property
    def printed_tokens_per_step(self) -> int:
        """What the log's own settings say a step is (its logged rates are checked against this)."""
        return self.global_batch * self.seq_len

    @property
    def tokens_per_gpu_step(self) -> int:
        return self.local_batch * self.accum * self.seq_len

    @property
    def micro_batch_tokens(self) -> int:
        return self.local_batch * self.seq_len

    @property
    def has_step_time(self) -> bool:
        return any(isinstance(e.get("time_ms"), (int, float)) for e in self.entries)

    @property
    def step_ms(self) -> float:
        logged = median(e.get("time_ms") for e in self.entries)
        return logged if logged is not None else self.step_ms_derived

    @property
    def tokens_per_sec(self) -> float:
        """From the primary measurements (config tokens per step, clock): not the logged figure."""
        return self.tokens_per_step / (self.step_ms / 1000)

    @property
    def tokens_per_sec_logged(self) -> float | None:
        """The logged rate, all GPUs, by the run log's throughput rule (the steady entries' mean)."""
        rates = throughput(self.entries)
        total, per_gpu = rates["tokens_per_sec"], rates["tokens_per_sec_per_gpu"]
        return total if total is not None else None if per_gpu is None else per_gpu * self.world

    @property
    def per_gpu(self) -> float:
        return self.tokens_per_sec / self.world

    @property
    def mfu_logged(self) -> float | None:
        """The logged MFU (%) by the run log's throughput rule."""
        return throughput(self.entries)["mfu_pct"]

    @property
    def ran(self) -> str:
        """What the run ran, from its configuration (titanlite.metrics.run_log.ran)."""
        return ran(self.config, self.model, self.hardware)

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
        return iqr(e.get("time_ms") for e in self.entries)

    def gpu_reading(self, key: str) -> float | None:
        """Median over the steady entries and every rank of one of the GPU's own readings titanlite logs
        (GPU_READINGS): each rank's from the per-rank breakdown where there is one, else the entry's (its
        logging rank). None where the log has none (other trainers' logs, CPU runs)."""
        vals = []
        for e in self.entries:
            ranks = (e.get("breakdown") or {}).get("ranks") if isinstance(e.get("breakdown"), dict) else None
            got = [r[key] for r in ranks or [] if isinstance(r, dict) and isinstance(r.get(key), (int, float))]
            vals += got or ([e[key]] if isinstance(e.get(key), (int, float)) else [])
        return median(vals)

    def phase_over_ranks(self, phase: str, how=min) -> float | None:
        """A phase's ms per step reduced over ranks: `min` = what even the fastest rank pays, which
        keeps one slow rank (and the others' waits for it) out of run-wide figures."""
        vals = [v for r in self.rank_phases if (v := self.phase(phase, r)) is not None]
        return how(vals) if vals else None


def build_run(log: LoggedRun, label: str = "", micro_steps: int | None = None,
              step_ms_derived: float | None = None) -> Run:
    """A diagnose Run from a read log; `micro_steps` is the reconstructed accumulation (default: as printed)."""
    cfg = log.config
    st = steady(log.iterations, cfg)
    accum = cfg["gradient_accumulation_steps"]
    global_batch = cfg.get("global_batch_size") or cfg["batch_size"] * accum * cfg["world_size"]
    run = Run(path=str(log.path), label=label, config=cfg, hardware=log.hardware, model=log.model,
              world=cfg["world_size"], local_batch=cfg["batch_size"], accum=micro_steps or accum,
              global_batch=int(global_batch), seq_len=cfg["seq_len"], entries=st.entries,
              excluded=st.warmup - (1 if st.only_warmup else 0), warmup_note=st.note, only_warmup=st.only_warmup,
              accum_printed=accum, source=log.source, step_ms_derived=step_ms_derived)
    run.rank_phases, run.breakdown_method = read_breakdown(st.entries)
    return run


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

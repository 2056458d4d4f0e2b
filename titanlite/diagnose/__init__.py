"""Scaling diagnosis from run logs: `python -m titanlite.diagnose LOG_A LOG_B [...] --out DIR`.

One way through: readers.py reads any supported log format, reconstruct.py finds what each run really
did when its logger misreported it (and which other readings fit as well), runs.py gives each run's
steady-state figures, analysis.py runs the checks (like_for_like.py, consistency.py), the cost model
(expected.py, over titanlite.parallel.comm_model) and one detector per fault kind (detectors.py) and
weighs the confidence (confidence.py), under each reading that fits the logs equally; advice.py holds
what to check next for each finding as data keyed by kind and cause, report.py writes report.md /
report.json and the figures (plots.py). Each step imports only the steps before it.
"""

from __future__ import annotations

from pathlib import Path

from titanlite.diagnose.analysis import analyze
from titanlite.diagnose.readers import BY_NAME, DiagnoseError, Settings, labels, read, refuse_duplicates
from titanlite.diagnose.reconstruct import Reconstruction, reconstruct
from titanlite.diagnose.records import Analysis, Finding, Thresholds
from titanlite.diagnose.report import write_report
from titanlite.diagnose.runs import Run, build_run

__all__ = ["Analysis", "Finding", "Thresholds", "analyze", "DiagnoseError", "Run", "Settings", "load_run",
           "load_runs", "read_and_reconstruct", "diagnose"]


def read_and_reconstruct(paths, settings=None, thresholds: Thresholds | None = None
                         ) -> tuple[list[Run], Reconstruction]:
    """Read the logs (argument order), reconstruct what each ran, and return the diagnose Runs ordered
    by world size (the smallest is the baseline) with the reconstruction. `settings`: one Settings for
    every log, or one per log."""
    th = thresholds or Thresholds()
    paths = [str(p) for p in paths]
    refuse_duplicates(paths)
    per_log = settings if isinstance(settings, list) else [settings or Settings()] * len(paths)
    logs = [read(p, s) for p, s in zip(paths, per_log)]
    names = labels(logs)
    rec = reconstruct(logs, names, [BY_NAME[log.source].rate_scope for log in logs], th.consistency_tol,
                      th.suspect_share)
    runs = [build_run(log, name, rr.micro_steps_per_step, rr.step_ms if rr.step_time != "logged" else None)
            for log, name, rr in zip(logs, names, rec.runs)]
    return sorted(runs, key=lambda r: r.world), rec


def load_run(path) -> Run:
    """One log of any supported format, read as printed (no reconstruction)."""
    return build_run(read(path))


def load_runs(paths) -> list[Run]:
    """Read, reconstruct and label the runs, ordered by world size (the smallest is the scaling baseline)."""
    return read_and_reconstruct(paths)[0]


def diagnose(paths, out, link_gbps: float | None = None, thresholds: Thresholds | None = None,
             settings=None) -> Analysis:
    """Read the logs, analyse them and write the report under `out`; returns the analysis."""
    runs, rec = read_and_reconstruct(paths, settings, thresholds)
    analysis = analyze(runs, thresholds, link_gbps, rec)
    write_report(analysis, Path(out))
    return analysis

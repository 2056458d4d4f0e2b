"""Scaling diagnosis from run logs: `python -m titanlite.diagnose LOG_A LOG_B [...] --out DIR`.

readers.py reads any supported log format, reconstruct.py finds what each run really did when its
logger misreported it (and which other readings fit as well), runs.py gives the steady-state
figures, analysis.py checks like-for-like and each log's consistency, computes scaling efficiency
and runs one detector per fault kind (under each reading that fits the logs equally), advice.py
holds what to check next for each finding as data keyed by kind and cause, report.py writes
report.md / report.json and the figures (plots.py).
"""

from __future__ import annotations

from titanlite.diagnose.analysis import Analysis, Finding, Thresholds, analyze
from titanlite.diagnose.readers import Settings
from titanlite.diagnose.runs import DiagnoseError, Run, load_run, load_runs

__all__ = ["Analysis", "Finding", "Thresholds", "analyze", "DiagnoseError", "Run", "Settings", "load_run",
           "load_runs", "read_and_reconstruct", "diagnose"]


def read_and_reconstruct(paths, settings=None, thresholds: Thresholds | None = None):
    """Read the logs (argument order), reconstruct what each ran, and return the diagnose Runs ordered
    by world size (the smallest is the baseline) with the reconstruction. `settings`: one Settings for
    every log, or one per log."""
    from titanlite.diagnose.readers import BY_NAME, read
    from titanlite.diagnose.reconstruct import reconstruct
    from titanlite.diagnose.runs import build_run, labels, refuse_duplicates

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


def diagnose(paths, out, link_gbps: float | None = None, thresholds: Thresholds | None = None,
             settings=None) -> Analysis:
    """Read the logs, analyse them and write the report under `out`; returns the analysis."""
    from pathlib import Path

    from titanlite.diagnose.report import write_report

    runs, rec = read_and_reconstruct(paths, settings, thresholds)
    analysis = analyze(runs, thresholds, link_gbps, rec)
    write_report(analysis, Path(out))
    return analysis

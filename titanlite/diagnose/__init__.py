"""Scaling diagnosis from titanlite run logs: `python -m titanlite.diagnose RUN_A.json RUN_B.json --out DIR`.

runs.py reads the logs (warm-up rule, per-rank phases), analysis.py checks like-for-like and each
log's consistency, computes scaling efficiency and runs one detector per fault kind, report.py
writes report.md / report.json and the figures (plots.py).
"""

from titanlite.diagnose.analysis import Analysis, Finding, Thresholds, analyze
from titanlite.diagnose.runs import DiagnoseError, Run, load_run, load_runs

__all__ = ["Analysis", "Finding", "Thresholds", "analyze", "DiagnoseError", "Run", "load_run", "load_runs", "diagnose"]


def diagnose(paths, out, link_gbps: float | None = None, thresholds: Thresholds | None = None) -> Analysis:
    """Load the logs, analyse them and write the report under `out`; returns the analysis."""
    from pathlib import Path

    from titanlite.diagnose.report import write_report

    analysis = analyze(load_runs([str(p) for p in paths]), thresholds, link_gbps)
    write_report(analysis, Path(out))
    return analysis

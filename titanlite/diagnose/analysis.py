"""A diagnosis from a set of runs: each check and detector run in turn, their findings merged and
ranked, the confidence weighed, and the same done under every other reading of the logs that fits
as well. The jobs themselves live beside it: like_for_like.py and consistency.py (the checks),
expected.py (the cost model), detectors.py (one per fault kind), confidence.py, records.py (the
typed results).

Findings rest only on trusted figures: the work per step is the reconstruction's (reconstruct.py),
and a run whose only entries are warm-up, or that no physically possible reading explains, takes
part in no stall, communication or straggler finding.
"""

from __future__ import annotations

from dataclasses import replace

from titanlite.diagnose.confidence import confidence, trusted
from titanlite.diagnose.consistency import consistency
from titanlite.diagnose.detectors import (healthy, host_starved, insufficient_finding, misreport_finding,
                                          phase_growth, scaling_loss, share_of_step, step_growth, straggler)
from titanlite.diagnose.expected import efficiency, link_gbps
from titanlite.diagnose.like_for_like import like_for_like, scaling_mode
from titanlite.diagnose.reconstruct import Reconstruction
from titanlite.diagnose.records import FIRST, SEVERITY_ORDER, Analysis, Finding, OtherReading, Thresholds
from titanlite.diagnose.runs import Run


# findings that say a larger run lost time against the baseline's prediction
LOSS_KINDS = {"scaling_loss", "compute_stall", "communication", "data_stall", "host_overhead", "straggler"}


def analyze(runs: list[Run], th: Thresholds | None = None, link_override: float | None = None,
            rec: Reconstruction | None = None) -> Analysis:
    """`runs` ordered by world size (the first is the baseline); `rec` the reconstruction of their logs."""
    th = th or Thresholds()
    rows, findings = like_for_like(runs)
    corrected = {rr.label for rr in rec.runs if rr.reading} if rec else set()
    cons = {}
    for r in runs:
        cons[r.label], f = consistency(r, th.consistency_tol)
        findings += [f] if f and r.label not in corrected else []  # the reconstruction says what went wrong
    mode = scaling_mode(runs)
    scaling = efficiency(runs, mode)
    effs = {row["run"]: row["efficiency"] for row in scaling["runs"]}
    base = runs[0]
    gbps = {r.label: link_gbps(r, link_override) for r in runs}
    for r in runs:
        if not trusted(r, rec):
            continue
        # runs that differ in more than the world size are no scaling: no growth is measured across them
        comparable = mode not in ("not_comparable", "single_run") and not any(f.kind == "config_mismatch"
                                                                              for f in findings)
        if comparable and r is not base and trusted(base, rec):
            findings += host_starved(base, r, gbps[r.label])
            grown = (phase_growth if r.has_breakdown and base.has_breakdown else step_growth)(
                base, r, th, gbps[r.label], effs[r.label])
            findings += grown or scaling_loss(base, r, th, gbps[r.label], effs[r.label])
        findings += straggler(r, th)
        findings += share_of_step(r, "data", th.data_share)
        findings += share_of_step(r, "idle", th.idle_share)
    lost = any(f.kind in LOSS_KINDS for f in findings)
    findings += [f for f in (insufficient_finding(runs), misreport_finding(runs, rec, scaling, th, lost) if rec else None)
                 if f]
    findings = merge(findings)
    if not findings:
        findings = [healthy(runs, scaling, effs, gbps, mode)]
    level, why = confidence(runs, rec, th, findings)
    others = [other_reading(runs, alt, th, link_override) for alt in rec.alternatives] if rec else []
    return Analysis(runs, findings, rows, cons, scaling, gbps, reconstruction=rec, confidence=level, reasons=why,
                    others=others)


def other_reading(runs: list[Run], alt: Reconstruction, th: Thresholds, link_override: float | None) -> OtherReading:
    """The analysis of the runs under another reading of their logs: the work per step it says each ran."""
    by_label = {rr.label: rr for rr in alt.runs}
    alt_runs = [replace(r, accum=by_label[r.label].micro_steps_per_step,
                        step_ms_derived=None if r.has_step_time else by_label[r.label].step_ms) for r in runs]
    a = analyze(alt_runs, th, link_override, alt)
    return OtherReading(a.verdict, a.findings[0].title, alt)



def merge(findings: list[Finding]) -> list[Finding]:
    """One finding per (kind, run), the strongest kept; ranked: config mismatch first (nothing else
    is like for like), then too few steps (nothing else is measured), then by what is at stake
    (share of the step, or relative error)."""
    best: dict[tuple[str, str], Finding] = {}
    for f in findings:
        key = (f.kind, f.run)
        if key not in best or f.score > best[key].score:
            best[key] = f
    return sorted(best.values(), key=lambda f: (FIRST.get(f.kind, len(FIRST)), -f.score, SEVERITY_ORDER[f.severity]))

"""Write DIR/report.md (verdict first), DIR/report.json and the PNGs."""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import asdict
from pathlib import Path

from titanlite.diagnose.records import Analysis
from titanlite.diagnose.plots import phases_png, ranks_png
from titanlite.diagnose.runs import PHASES, WARMUP_RULE
from titanlite.errors import missing_package


def num(v, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int) or float(v).is_integer() and abs(v) >= 1000:
        return f"{int(v):,}"
    return f"{v:,.{digits}f}" if abs(v) >= 1 or v == 0 else f"{v:.3g}"


def table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out + [""]


def evidence_lines(ev: dict) -> list[str]:
    lines = []
    for k, v in ev.items():
        if isinstance(v, dict):
            v = ", ".join(f"{a} {num(b, 3) if isinstance(b, float) else b}" for a, b in v.items())
        elif isinstance(v, list):
            v = " vs ".join(str(x) for x in v)
        elif isinstance(v, float):
            v = num(v, 3)
        lines.append(f"  - {k}: {v}")
    return lines


def reconstruction_md(a: Analysis) -> list[str]:
    """The table of what each log really ran, in argument order."""
    rec = a.reconstruction
    if rec is None:
        return []
    md = ["## What the logs say, reconstructed", "",
          "Each log's figures checked against one another and against the GPU's dense bf16 peak; the reading "
          "is the set of misreports that makes the most of them agree and is physically possible.", ""]
    rows = []
    for rr in rec.runs:
        flagged = [f"{k} from the command line" for k in rr.overrides]
        rows.append([rr.label, f"`{Path(rr.path).name}`", rr.source, str(rr.gpus) + (" (flag)" if "world_size" in rr.overrides
                                                                                    else ""),
                     ", ".join(f"`{m}`" for m in rr.reading) or "as logged",
                     f"{rr.micro_steps_per_step}" + (f" (printed {rr.micro_steps_printed})"
                                                    if rr.micro_steps_per_step != rr.micro_steps_printed else ""),
                     num(rr.tokens_per_sec_per_gpu, 0), num(rr.mfu_dense_pct, 1), rr.plausibility,
                     rr.why + (" " + "; ".join(flagged) + "." if flagged else "")])
    md += table(["run", "log", "format", "GPUs", "reading", "micro-steps per step", "tokens/s per GPU",
                 "MFU, dense peak (%)", "physically", "why"], rows)
    eff = a.scaling
    if eff["mode"] not in ("single_run", "not_comparable"):
        md += [f"Scaling efficiency under this reading ({eff['mode'].replace('_', ' ')}): "
               + ", ".join(f"{row['run']} {row['efficiency']:.1%}" for row in eff["runs"]) + ".", ""]
    elif eff["mode"] == "single_run":
        md += ["One log: a single-run report, no scaling claim.", ""]
    notes: dict[str, list[str]] = {}
    for rr in rec.runs:
        for n in rr.notes:
            notes.setdefault(n, []).append(rr.label)
    if notes:
        md += ["Read with assumptions: " + "; ".join(f"{', '.join(who)}: {n}" for n, who in notes.items()) + ".", ""]
    return md


def markdown(a: Analysis) -> str:
    top = a.findings[0]
    effs = {row["run"]: row for row in a.scaling["runs"]}
    md = [f"# {a.headline()}", ""]
    if a.settle:
        md += [f"**To settle it:** {a.settle}.", ""]
    if len(a.verdicts) > 1:
        md += ["Readings that fit the logs equally, each with its verdict (the reconstruction below gives them): "
               + " ".join(f"({i}) `{v}`: {t}" for i, (v, t) in
                          enumerate([(a.verdict, top.title)] + [(o.verdict, o.summary) for o in a.others], 1)), ""]
    md += [top.title, "", f"**Next check:** {top.next_check}", "",
           f"**Confidence: {a.confidence}.**" + "".join(" " + r[0].upper() + r[1:] + "." for r in a.confidence_reasons),
           ""]
    if a.reconstruction and a.reconstruction.ranking:
        md += ["**Why this reading:** " + " ".join(r.text[0].upper() + r.text[1:] + "." for r in a.reconstruction.ranking),
               ""]
    if len(a.findings) > 1:
        md += ["Also found: " + "; ".join(f"`{f.kind}` (severity {f.severity}{', ' + f.run if f.run else ''})"
                                          for f in a.findings[1:]) + ".", ""]
    md += reconstruction_md(a)
    md += ["## Runs", ""]
    rows = []
    for r in a.runs:
        e = effs[r.label]
        rows.append([r.label, r.ran, f"`{Path(r.path).name}`", f"{r.local_batch} x {r.accum} x {r.seq_len}",
                     num(r.tokens_per_step), num(r.step_ms), num(r.tokens_per_sec, 0), num(r.tokens_per_sec_logged, 0),
                     num(r.per_gpu, 0), "n/a" if e["efficiency"] is None else f"{e['efficiency']:.0%}",
                     num(r.mfu_logged, 2), num(r.memory_gb, 2)])
    md += table(["run", "ran", "log", "local batch x accum x seq", "tokens/step", "step time (ms, median)",
                 "tokens/s (tokens/step / median step time)", "tokens/s (logged, steady mean)",
                 "tokens/s per GPU (from step time)", "scaling efficiency", "MFU logged (%, steady mean)",
                 "peak memory (GB)"], rows)
    md += ["Two rules, each named in its column: the analysis rests on the median step time (a stray slow entry "
           "does not move it); the logged figures are the steady entries' mean, the run's throughput as "
           "`titanlite.tools.compare` and the Trainer's summary report it.", ""]
    md += ["## Findings, ranked", ""]
    for i, f in enumerate(a.findings, 1):
        md += [f"### {i}. `{f.kind}`, severity {f.severity}", "", f.title, "", "- Evidence:"]
        md += evidence_lines(f.evidence)
        md += [f"- Next check: {f.next_check}", ""]
    md += ["## Time per optimizer step by phase (ms; fastest / median / slowest rank)", ""]
    rows = []
    for r in a.runs:
        if not r.has_breakdown:
            rows.append([r.label, "no breakdown"] + ["n/a"] * len(PHASES) + [num(r.step_ms)])
            continue
        cells = []
        for p in PHASES:
            vals = sorted(v for k in r.rank_phases if (v := r.phase(p, k)) is not None)
            cells.append(" / ".join(num(v) for v in (vals[0], vals[len(vals) // 2], vals[-1])) if vals else "n/a")
        rows.append([r.label, r.breakdown_method or "?"] + cells + [num(r.step_ms)])
    md += table(["run", "method", "data wait", "compute", "exposed comm", "optimizer", "idle / host", "step"], rows)
    md += ["Compute and data wait are per optimizer step; divide by the accumulation steps for per micro-step. "
           "Run-wide findings use the fastest rank, so one slow rank does not pass for a run-wide stall.", ""]
    s = a.scaling
    md += ["## Scaling efficiency", "", f"Mode: **{s['mode'].replace('_', ' ')}** (baseline {s['baseline']}). "
           f"{s['definition']}. Basis: {s['basis']}.", ""]
    md += table(["run", "GPUs", "tokens/step", "step time (ms, median)", "tokens/s (from step time)",
                 "tokens/s per GPU (from step time)", "efficiency", "efficiency from logged tokens/s (steady mean)"],
                [[row["run"], row["world_size"], num(row["tokens_per_step"]), num(row["step_ms"]),
                  num(row["tokens_per_sec"], 0), num(row["tokens_per_sec_per_gpu"], 0),
                  "n/a" if row["efficiency"] is None else f"{row['efficiency']:.1%}",
                  f"{row['efficiency_from_logged_tokens_per_sec']:.1%}"
                  if "efficiency_from_logged_tokens_per_sec" in row else "n/a"] for row in s["runs"]])
    md += ["## Like-for-like check", ""]
    md += table(["setting"] + [r.label for r in a.runs] + ["verdict"],
                [[row.setting] + [("n/a" if v is None else f"`{v}`") for v in row.values]
                 + ["same" if row.same else ("expected to differ" if row.ok else "**differs**")]
                 for row in a.like_for_like])
    md += ["## Self-consistency of each log", "",
           "Each logged rate recomputed from its inputs over the steady-state entries; the worst entry is shown.", ""]
    rows = [[label, c.check, c.worst_iter, num(c.logged, 3), num(c.recomputed, 3),
             f"{c.error_pct:.2f}", "ok" if c.ok else "**inconsistent**"]
            for label, checks in a.consistency.items() for c in checks]
    md += table(["run", "check", "worst iter", "logged", "recomputed", "error (%)", "result"], rows)
    md += ["## Steady-state rule", "", WARMUP_RULE + ".", ""]
    md += [f"- {r.label}: {r.excluded} warm-up entr{'y' if r.excluded == 1 else 'ies'} excluded, "
           f"{len(r.entries)} used" + (f" ({r.warmup_note})" if r.warmup_note else "") for r in a.runs]
    md += ["", "## Figures", ""] + (a.notes or ["![time per step by phase](phases.png)", "",
                                               "![per-rank spread](ranks.png)"]) + [""]
    return "\n".join(md)


def to_json(a: Analysis) -> dict:
    return {
        "verdict": a.verdict,
        "summary": a.findings[0].title,
        "confidence": a.confidence,
        "confidence_reasons": a.confidence_reasons,
        "confidence_causes": [{"run": r.run, "cause": r.cause, "flags": list(r.flags)} for r in a.reasons],
        "settle_with": a.settle_with,
        "settle_logs": a.settle_logs,
        "verdicts": a.verdicts,
        "other_readings": [o.to_json() for o in a.others],
        "findings": [f.to_json() for f in a.findings],
        "reconstruction": None if a.reconstruction is None else {
            "runs": [rr.to_json() for rr in a.reconstruction.runs],
            "scaling_efficiency": largest_efficiency(a),
            "scaling_mode": a.scaling["mode"],
            "logger_fixes": a.reconstruction.fixes,
            "ranking": [r.to_json() for r in a.reconstruction.ranking]},
        "scaling_efficiency": a.scaling,
        "like_for_like": [asdict(row) for row in a.like_for_like],
        "self_consistency": {label: [asdict(c) for c in checks] for label, checks in a.consistency.items()},
        "warmup_rule": WARMUP_RULE,
        "notes": a.notes,
        "link_gbps_assumed": a.gbps,
        "runs": [{"run": r.label, "ran": r.ran, "path": r.path, "world_size": r.world, "local_batch": r.local_batch,
                  "accumulation": r.accum, "global_batch": r.global_batch, "seq_len": r.seq_len,
                  "micro_steps_per_step": r.accum, "step_ms": r.step_ms, "tokens_per_sec": r.tokens_per_sec,
                  "tokens_per_sec_logged": r.tokens_per_sec_logged, "mfu_logged": r.mfu_logged,
                  "memory_peak_gb": r.memory_gb, "warmup_entries_excluded": r.excluded,
                  "steady_entries": len(r.entries), "breakdown_method": r.breakdown_method,
                  "phases_ms_fastest_rank": {p: r.phase_over_ranks(p) for p in PHASES} if r.has_breakdown else None}
                 for r in a.runs],
    }


def largest_efficiency(a: Analysis) -> float | None:
    """The scaling efficiency of the largest run against the baseline (None for one run or no comparison)."""
    rows = [row for row in a.scaling["runs"] if row["efficiency"] is not None]
    return max(rows, key=lambda row: row["world_size"])["efficiency"] if len(rows) > 1 else None


def finite(obj):
    """Strict JSON: a non-finite number (a rate recomputed against zero) becomes null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def write_report(a: Analysis, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    effs = {row["run"]: row["efficiency"] for row in a.scaling["runs"]}
    paths = [out / "report.md", out / "report.json", out / "phases.png", out / "ranks.png"]
    if importlib.util.find_spec("matplotlib") is None:  # the report still stands; say why the figures are missing
        a.notes.append(missing_package("matplotlib", "drawing the figures") + "; the report is written without them")
        paths = paths[:2]
    paths[0].write_text(markdown(a))
    paths[1].write_text(json.dumps(finite(to_json(a)), indent=1, allow_nan=False, default=str))
    if len(paths) == 4:
        phases_png(a.runs, effs, paths[2])
        ranks_png(a.runs, paths[3])
    return paths

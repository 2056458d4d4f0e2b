"""Does each log agree with itself? Its logged rates recomputed from its primary figures (batch
settings, step time, FLOPs per token, peak), and its phases against the step they split."""

from __future__ import annotations

from titanlite.diagnose.advice import advise
from titanlite.diagnose.records import Check, Finding, fmt, rel_err
from titanlite.diagnose.runs import Run
from titanlite.models.args import mfu_pct


# ------------------------------------------------------------------------------ self-consistency
def consistency(run: Run, tol: float) -> tuple[list[Check], Finding | None]:
    """Recompute each logged rate from the primary figures (batch settings, step time, FLOPs/token,
    peak) and report the worst relative error of each check over the steady entries."""
    fpt = run.model.get("flops_per_token")
    peak = run.hardware.get("peak_tflops_per_gpu")
    checks: dict[str, list] = {}

    def add(name, logged, expected, it):
        if isinstance(logged, (int, float)) and isinstance(expected, (int, float)):
            checks.setdefault(name, []).append((rel_err(logged, expected), logged, expected, it))

    prev = None
    for e in run.entries:
        tps = e.get("tokens_per_sec")
        if isinstance(e.get("time_ms"), (int, float)):
            add("tokens/s = tokens per step / step time", tps, run.printed_tokens_per_step / (e["time_ms"] / 1000),
                e["iter"])
        if isinstance(tps, (int, float)):
            add("tokens/s per GPU x GPUs = tokens/s", (e.get("tokens_per_sec_per_gpu") or 0) * run.world
                if e.get("tokens_per_sec_per_gpu") is not None else None, tps, e["iter"])
            if fpt:
                add("TFLOP/s = tokens/s x FLOPs per token", e.get("tflops"), tps * fpt / 1e12, e["iter"])
        if peak and isinstance(e.get("tflops"), (int, float)):
            add("MFU = TFLOP/s / (GPUs x peak)", e.get("mfu"), mfu_pct(e["tflops"] * 1e12, 1, run.world, peak), e["iter"])
        if prev is not None and isinstance(e.get("tokens_seen"), int) and isinstance(prev.get("tokens_seen"), int):
            steps = e["iter"] - prev["iter"]
            add("tokens seen per step = global batch x seq_len",
                (e["tokens_seen"] - prev["tokens_seen"]) / steps, run.printed_tokens_per_step, e["iter"])
        prev = e
    for r in run.rank_phases:  # phases cannot add up to more than the step they split
        phases = run.rank_phases[r]
        n = min((len(v) for v in phases.values() if v), default=0)
        for i in range(min(n, len(run.entries))):
            total = sum(phases[p][i] for p in ("data", "compute", "optimizer") if len(phases[p]) > i)
            step = run.entries[i].get("time_ms")
            if step and total > step * (1 + tol):
                add(f"phases of rank {r} fit in the step", total, step, run.entries[i]["iter"])
    rows = []
    for name, vals in checks.items():
        err, logged, expected, it = max(vals, key=lambda v: v[0])
        rows.append(Check(name, it, logged, expected, round(100 * err, 2), err <= tol))
    bad = [r for r in rows if not r.ok]
    if not bad:
        return rows, None
    worst = max(bad, key=lambda r: r.error_pct)
    score = min(worst.error_pct / 100, 1.0)
    title = (f"{run.label}: logged figures disagree with their own inputs; worst: '{worst.check}' is "
             f"{fmt(worst.logged)} logged vs {fmt(worst.recomputed)} recomputed at iter {worst.worst_iter} "
             f"({worst.error_pct:.1f}% off).")
    evidence = {r.check: {"logged": r.logged, "recomputed": r.recomputed, "error_pct": r.error_pct} for r in bad}
    return rows, Finding("measurement_inconsistency", "high" if score >= tol * 3 else "medium", title, evidence,
                         advise("measurement_inconsistency", "figures_disagree"), score=score, run=run.label,
                         cause="figures_disagree")

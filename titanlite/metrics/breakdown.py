"""The per-rank timing breakdown of one log interval, gathered to rank 0.

Each rank reports milliseconds per optimizer step averaged over the interval:
    step = data + compute + comm + optimizer + idle
where idle is the remainder (host overhead, GPU waiting for the host, work outside the phases).
Collectives make every rank's wall step about equal, so the slowest rank is the one whose own busy
time (data + compute + optimizer, without the exposed comm wait) is largest: the others wait for it.
"""

from __future__ import annotations

import statistics

import torch.distributed as dist

FIGURES = ("step", "data", "compute", "comm", "optimizer", "idle", "busy")


def rank_breakdown(rank: int, step_ms: float, phase_ms: dict, steps: int) -> dict:
    """One rank's entry from StepTimer.collect totals over `steps` optimizer steps."""
    per = {k: (v / steps if v is not None else None) for k, v in phase_ms.items()}
    busy = per["data"] + per["compute"] + per["optimizer"]
    return {"rank": rank, "step_ms": step_ms, "data_ms": per["data"], "compute_ms": per["compute"],
            "comm_ms": per["comm"], "optimizer_ms": per["optimizer"],
            "idle_ms": step_ms - busy - (per["comm"] or 0.0), "busy_ms": busy}


def summarize(ranks: list[dict], method: str) -> dict:
    """Min / median / max over ranks of every figure, and the slowest rank (largest busy_ms)."""
    stats = {}
    for f in FIGURES:
        vals = [r[f"{f}_ms"] for r in ranks]
        known = None if any(v is None for v in vals) else vals
        stats[f"{f}_ms"] = {"min": min(known) if known else None, "median": statistics.median(known) if known else None,
                            "max": max(known) if known else None}
    slowest = max(ranks, key=lambda r: r["busy_ms"])["rank"]
    return {"ranks": sorted(ranks, key=lambda r: r["rank"]), "stats": stats, "slowest_rank": slowest,
            "slowest_rank_basis": "busy_ms = data + compute + optimizer", "method": method}


def gather_breakdown(local: dict, method: str, group=None) -> dict | None:
    """All ranks of `group` call this on log steps (one all_gather_object over it: the job's ranks, on
    the host; None for one rank); its first rank gets the summary, the others None."""
    if group is not None:
        ranks: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(ranks, local, group=group)
        if dist.get_rank(group) != 0:
            return None
    else:
        ranks = [local]
    return summarize(ranks, method)

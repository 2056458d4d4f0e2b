"""One detector per fault kind, each returning `Finding`s with the numbers behind them.

Across runs (the smallest is the baseline; predictions from titanlite.diagnose.expected): a phase that
exceeds its prediction by `growth` x, by `share` of the larger run's step, and by more than the
entry-to-entry jitter of both runs (sum of their inter-quartile ranges: a difference smaller than the
noise is no evidence) becomes a finding of that phase's kind; without a per-phase breakdown, the step's
growth is weighed against what the collectives can add; a step beyond the prediction's margin that no
phase explains is a `scaling_loss`, split as far as the logs allow. Run-wide phases use the fastest
rank (`min` over ranks), so one slow rank, and the others' waits for it, show up as a `straggler` and
nowhere else. Within one run: data wait and host idle as a share of the step, stragglers. From the
reconstruction: what the logs misreport, and runs with only warm-up entries. `healthy` where nothing
is found, with where the efficiency that is lost goes.
"""

from __future__ import annotations

import statistics

from titanlite.diagnose.advice import ADVICE, advise, device_cause
from titanlite.diagnose.expected import (collectives, comm_extra_ms, comm_ms, gradient_bytes, gradients_cross_bf16,
                                         phase_excess, predicted_step_ms, work_ratio)
from titanlite.diagnose.like_for_like import cfg_value, cpus_per_rank
from titanlite.diagnose.reconstruct import MISREPORTS, Reconstruction
from titanlite.diagnose.records import Finding, Loss, Thresholds, severity
from titanlite.diagnose.runs import GPU_READINGS, Run
from titanlite.parallel.modes import MODES


def devices(run: Run) -> str:
    return "GPUs" if run.device == "cuda" else f"{run.device.upper()} processes"


# which finding a grown phase is
PHASE_KIND = {"data": "data_stall", "compute": "compute_stall", "optimizer": "compute_stall",
              "comm": "communication", "idle": "host_overhead"}


def phase_growth(base: Run, run: Run, th: Thresholds, gbps: float, eff: float | None) -> list[Finding]:
    step = run.step_ms
    rows, noise = phase_excess(base, run, gbps)
    grown = [r for r in rows if r[3] >= th.share * step and r[1] >= th.growth * r[2] and r[3] > noise[r[0]]]
    lost = step - predicted_step_ms(base, run, gbps)
    if not grown and eff is not None and eff < th.efficiency_ok and rows and lost > run.step_jitter_ms + base.step_jitter_ms:
        grown = [max(rows, key=lambda r: r[3])]  # no single phase stands out, but time is lost: name the largest
    findings = []
    for p, got, want, excess in grown:
        kind = PHASE_KIND[p]
        micro = "per micro-step " if p in ("data", "compute") else ""
        title = (f"{run.label} vs {base.label}: {p} takes {got:,.1f} ms per step where the baseline predicts "
                 f"{want:,.1f} ms ({got / want if want else float('inf'):.2f}x); the excess {excess:,.1f} ms is "
                 f"{100 * excess / step:.0f}% of the {step:,.1f} ms step.")
        ev = {"phase": p, f"{p}_ms_per_step": round(got, 3), f"predicted_{p}_ms_per_step": round(want, 3),
              f"baseline_{p}_ms_per_step": round(base.phase_over_ranks(p) or 0.0, 3),
              "excess_ms_per_step": round(excess, 3), "jitter_ms": round(noise[p], 3), "step_ms": round(step, 3),
              "ranks_basis": "fastest rank (min over ranks)"}
        if micro:
            ev[f"{p}_ms_per_micro_step"] = round(got / run.accum, 3)
            ev[f"baseline_{p}_ms_per_micro_step"] = round((base.phase_over_ranks(p) or 0.0) / base.accum, 3)
        if p == "comm" and gradient_bytes(run) is not None:
            ev["expected_comm_ms"] = round(comm_ms(run, gbps), 3)
            ev["link_gbps_assumed"] = gbps
            ev["gradient_bytes"] = gradient_bytes(run)
        if eff is not None:
            ev["scaling_efficiency"] = eff
        cause = device_cause(run.device) if (kind, device_cause(run.device)) in ADVICE else ""
        if kind == "compute_stall":
            cause, readings, why = stall_cause(base, run, th)
            ev.update(readings)
            title += why + fewer_cpus(base, run, ev, "on CPU they are its compute" if run.device == "cpu" else
                                      "its host may be starved of them")
        findings.append(Finding(kind, severity(excess / step), title, ev, advise(kind, cause), score=excess / step,
                                run=run.label, cause=cause))
    return findings


def stall_cause(base: Run, run: Run, th: Thresholds) -> tuple[str, dict, str]:
    """Why a GPU run's compute grew, from the GPUs' own readings (Run.gpu_reading) against the baseline's:
    (cause, evidence, a sentence for the title). `gpu_waiting`: utilisation fell (no kernel ran for part of
    the interval: the GPUs waited for the host, or for collectives that run without kernels), or the GPUs
    stayed busy on far less power (a collective's kernel spinning while it waits for a peer counts as busy);
    `gpu_throttled`: busy as before at a lower SM clock; otherwise device_cause's (kernels slowed, or
    nothing to tell)."""
    cause = device_cause(run.device)
    got = {k: (run.gpu_reading(k), base.gpu_reading(k)) for k in GPU_READINGS}
    ev = {name: round(v, 1) for k, pair in got.items() if None not in pair
          for name, v in ((k, pair[0]), (f"baseline_{k}", pair[1]))}
    (util, util0), (watts, watts0), (clock, clock0) = (got[k] for k in GPU_READINGS)
    if cause != device_cause("cuda") or util is None or util0 is None:
        return cause, ev, ""
    power = f", {watts:,.0f} W against {watts0:,.0f}" if watts is not None and watts0 is not None else ""
    clocks = f" at {clock:,.0f} MHz against {clock0:,.0f}" if clock is not None and clock0 is not None else ""
    if util <= util0 - th.busy_drop:
        return "gpu_waiting", ev, (
            f" The GPUs ran kernels {util:.0f}% of the time against {util0:.0f}% in the baseline{clocks}{power}: "
            f"they waited inside the step (for the host, or for collectives that run without kernels) rather than "
            f"computing slower.")
    if watts is not None and watts0 and watts <= (1 - th.power_drop) * watts0:
        return "gpu_waiting", ev, (
            f" The GPUs were as busy as in the baseline ({util:.0f}% against {util0:.0f}%) on {watts:,.0f} W against "
            f"{watts0:,.0f}{clocks}: part of that was kernels waiting (a collective spins while it waits for a slower "
            f"rank or link) rather than computing.")
    if clock is not None and clock0 and clock <= (1 - th.clock_drop) * clock0:
        return "gpu_throttled", ev, (
            f" The GPUs were as busy as in the baseline ({util:.0f}% against {util0:.0f}%){clocks}{power}: "
            f"they ran at lower clocks.")
    return cause, ev, ""


def step_growth(base: Run, run: Run, th: Thresholds, gbps: float, eff: float | None) -> list[Finding]:
    """Without a per-phase breakdown: is the step's growth communication-sized? If it is many times
    what the collectives can cost, the GPUs themselves are computing slower."""
    comm_extra = comm_extra_ms(base, run, gbps)
    want = predicted_step_ms(base, run, gbps)
    excess = run.step_ms - want
    noise = run.step_jitter_ms + base.step_jitter_ms
    if excess < th.share * run.step_ms or run.step_ms < th.growth * want or excess <= noise:
        if eff is None or eff >= th.efficiency_ok:
            return []
    ev = {"step_ms": round(run.step_ms, 3), "baseline_step_ms": round(base.step_ms, 3),
          "predicted_step_ms": round(want, 3), "excess_ms_per_step": round(excess, 3), "jitter_ms": round(noise, 3),
          "step_ms_per_micro_step": round(run.step_ms / run.accum, 3),
          "baseline_step_ms_per_micro_step": round(base.step_ms / base.accum, 3),
          "link_gbps_assumed": gbps, "basis": "step time only (no per-phase breakdown in the logs)"}
    if comm_extra is not None:
        ev["expected_comm_ms"] = round(comm_ms(run, gbps), 3)
    if eff is not None:
        ev["scaling_efficiency"] = eff
    if run.memory_gb and base.memory_gb:
        ev["memory_gb"], ev["baseline_memory_gb"] = run.memory_gb, base.memory_gb
    same_mem = run.memory_gb and base.memory_gb and abs(run.memory_gb / base.memory_gb - 1) < 0.05
    head = (f"{run.label} vs {base.label}: the step takes {run.step_ms:,.1f} ms where the baseline's per-GPU work "
            f"predicts {want:,.1f} ms; ")
    tail = " (memory per GPU is the same, so the per-GPU work is too)." if same_mem else "."
    if comm_extra is None:  # no size, no all-reduce estimate: say so instead of a ratio over nothing
        title = (head + f"the {excess:,.1f} ms excess cannot be split between communication and compute: the "
                 f"model's size is not known, so the all-reduce's cost is not either (pass --model); read as the "
                 f"{devices(run)} computing slower" + tail)
        kind = "compute_stall"
    elif excess > th.comm_margin * comm_extra:
        bound = (f"{excess / comm_extra:,.0f}x what the larger world's collectives can add "
                 f"(+{comm_extra:,.1f} ms at {gbps:g} GB/s)" if comm_extra > 0 else
                 "more than the collectives can add, which are no costlier than the baseline's")
        title = head + f"the {excess:,.1f} ms excess is {bound}, so the {devices(run)} compute slower" + tail
        kind = "compute_stall"
    else:
        title = (f"{run.label} vs {base.label}: the step grows by {excess:,.1f} ms beyond the per-GPU work, about what "
                 f"the collectives can cost ({comm_extra:,.1f} ms at {gbps:g} GB/s); log a breakdown to confirm.")
        kind = "communication"
    cause = ""
    if kind == "compute_stall":
        cause, readings, why = stall_cause(base, run, th)
        ev.update(readings)
        title += why + fewer_cpus(base, run, ev, "on CPU they are its compute" if run.device == "cpu" else
                                  "its host may be starved of them")
    return [Finding(kind, severity(excess / run.step_ms), title, ev, advise(kind, cause),
                    score=max(excess, 0.0) / run.step_ms, run=run.label, cause=cause)]


def scaling_loss(base: Run, run: Run, th: Thresholds, gbps: float, eff: float | None) -> list[Finding]:
    """A step beyond what the model, world size and link predict (the baseline's per-GPU work plus the
    collectives with overlap, titanlite.diagnose.expected) by more than the prediction's margin and the
    jitter, that no phase's detector named: the loss, the most the collectives could take were none of
    their time hidden, and so what is left for something else; what the logs cannot split, and the run
    that would split it."""
    work_ms = base.step_ms * work_ratio(base, run)
    want = predicted_step_ms(base, run, gbps)
    loss, step = run.step_ms - want, run.step_ms
    noise = run.step_jitter_ms + base.step_jitter_ms
    if loss <= max(noise, th.prediction_margin * step):
        return []
    cost, base_cost = collectives(run, gbps, work_ms), collectives(base, gbps, base.step_ms)
    ev = {"step_ms": round(step, 3), "baseline_step_ms": round(base.step_ms, 3), "per_gpu_work_ms": round(work_ms, 3),
          "predicted_step_ms": round(want, 3), "loss_ms_per_step": round(loss, 3), "share_of_step": round(loss / step, 4),
          "prediction_margin": th.prediction_margin, "jitter_ms": round(noise, 3), "link_gbps_assumed": gbps}
    if eff is not None:
        ev["scaling_efficiency"] = eff
    title = (f"{run.label} vs {base.label}: {loss:,.1f} ms per step ({loss / step:.0%} of the {step:,.1f} ms step) is lost "
             f"beyond what the model, world size and link predict ({want:,.1f} ms: the baseline's per-GPU work "
             f"{work_ms:,.1f} ms")
    if cost is None:
        title += ("; the model's size is not known, so the collectives' cost is not either (pass --model).")
    else:
        most = cost.total_ms - base_cost.overlapped_ms  # over what the baseline's collectives already cost it
        left = step - work_ms - most
        ev.update(collectives_overlapped_ms=round(cost.overlapped_ms - base_cost.overlapped_ms, 3),
                  collectives_none_hidden_ms=round(most, 3), left_for_something_else_ms=round(max(left, 0.0), 3))
        title += (f" + {cost.overlapped_ms - base_cost.overlapped_ms:,.1f} ms of collectives with overlap). Were none "
                  f"of their time hidden the collectives would take at most {most:,.1f} ms, so ")
        title += (f"at least {left:,.1f} ms ({left / step:.0%}) is something else: overlap contention, host, data or "
                  f"stragglers." if left > noise else
                  "the collectives alone could account for it, were less of their time hidden than predicted.")
    title += fewer_cpus(base, run, ev, "part of the loss may be its host, starved of them")
    lost = largest_loss(base, run, gbps)
    remedies: list[str] = []
    if lost:
        title += " " + lost.text
        ev["largest_loss"] = lost.evidence()
        cause, remedies = lost.cause or "split", lost.remedies
    elif run.has_breakdown and base.has_breakdown:
        title += " No phase grew beyond its prediction by more than the step-to-step jitter: the loss is spread over them."
        cause = "split"
    else:
        title += (" These logs time only the whole step, so they cannot split it between the collectives, the compute "
                  "beside them, the host, data and stragglers: runs of both sizes with titanlite's run log, which "
                  "times each rank's data, compute, comm and idle, would.")
        cause = "step_only"
    return [Finding("scaling_loss", severity(loss / step), title, ev, advise("scaling_loss", cause, remedies),
                    score=loss / step, run=run.label, cause=cause, remedies=remedies)]


def fewer_cpus(base: Run, run: Run, ev: dict, meaning: str) -> str:
    """A sentence, and the evidence, where `run` had fewer CPUs per rank than the baseline ('' otherwise)."""
    mine, theirs = cpus_per_rank(run), cpus_per_rank(base)
    if mine is None or theirs is None or mine >= theirs:
        return ""
    ev.update(cpus_per_rank=mine, baseline_cpus_per_rank=theirs)
    return f" It ran with {mine:g} CPUs per rank against the baseline's {theirs:g}: {meaning}."


HOST_FLOOR = 0.02  # host time grown by at least this share of the step, beyond the jitter, is named


def host_starved(base: Run, run: Run, gbps: float) -> list[Finding]:
    """A run with fewer CPUs per rank than the baseline (titanlite.diagnose.like_for_like.cpus_per_rank)
    whose host time (idle outside the measured phases) or data wait grows beyond its prediction and
    the jitter: the host is starved of CPUs."""
    mine, theirs = cpus_per_rank(run), cpus_per_rank(base)
    if mine is None or theirs is None or mine >= theirs or not (run.has_breakdown and base.has_breakdown):
        return []
    step = run.step_ms
    rows, noise = phase_excess(base, run, gbps)
    grown = [r for r in rows if r[0] in ("idle", "data") and r[3] > noise[r[0]] and r[3] >= HOST_FLOOR * step]
    if not grown:
        return []
    excess = sum(r[3] for r in grown)
    host = sum(r[1] for r in grown)
    title = (f"{run.label} vs {base.label}: host-starved: {mine:g} CPUs per rank against {theirs:g}, and "
             + " and ".join(f"{p} takes {got:,.1f} ms per step where the baseline predicts {want:,.1f} ms "
                            f"(+{ex:,.1f} ms)" for p, got, want, ex in grown)
             + f": {100 * excess / step:.0f}% of the {step:,.1f} ms step.")
    ev = {"cpus_per_rank": mine, "baseline_cpus_per_rank": theirs, "step_ms": round(step, 3),
          "excess_ms_per_step": round(excess, 3), "ranks_basis": "fastest rank (min over ranks)",
          **{f"{p}_ms_per_step": round(got, 3) for p, got, _, _ in grown},
          **{f"predicted_{p}_ms_per_step": round(want, 3) for p, _, want, _ in grown}}
    # ranked by all the host time it names, so that the share-of-step finding of the same kind does not hide it
    return [Finding("host_overhead", severity(excess / step), title, ev, advise("host_overhead", "host_starved"),
                    score=max(excess, host) / step, run=run.label, cause="host_starved")]


# ------------------------------------------------------------------------------ single-run detectors
def straggler(run: Run, th: Thresholds) -> list[Finding]:
    """One rank consistently slower at its own work (data + compute + optimizer, without waits).
    Ranks are compared entry by entry: they share each interval, so load that comes and goes
    (other jobs on the machine) hits them alike and cancels out of the per-entry ratio."""
    ranks = sorted(run.rank_phases)
    if len(ranks) < 2:
        return []
    busy = {r: [sum(v) for v in zip(*(run.rank_phases[r][p] for p in ("data", "compute", "optimizer")))] for r in ranks}
    n = min(len(v) for v in busy.values())
    if n == 0:
        return []
    slowest = [max(ranks, key=lambda r: busy[r][i]) for i in range(n)]
    cand = max(set(slowest), key=slowest.count)
    share_slowest = slowest.count(cand) / n
    others = [statistics.median(busy[r][i] for r in ranks if r != cand) for i in range(n)]
    ratio = statistics.median(busy[cand][i] / others[i] if others[i] > 0 else float("inf") for i in range(n))
    gap = statistics.median(busy[cand][i] - others[i] for i in range(n))
    if share_slowest < th.straggler_consistency or ratio < th.straggler or gap < th.share * run.step_ms:
        return []
    mine, theirs = statistics.median(busy[cand][:n]), statistics.median(others)
    diffs = {p: (run.phase(p, cand) or 0.0) - statistics.median(run.phase(p, r) or 0.0 for r in ranks if r != cand)
             for p in ("data", "compute", "optimizer")}
    phase = max(diffs, key=diffs.get)
    waits = [run.phase("comm", r) for r in ranks if r != cand]
    ev = {"rank": cand, "busy_ms_per_step": round(mine, 3), "other_ranks_median_busy_ms": round(theirs, 3),
          "ratio_median_per_entry": round(ratio, 3), "gap_ms_median_per_entry": round(gap, 3),
          "slowest_in_share_of_entries": round(share_slowest, 3), "phase": phase,
          f"{phase}_ms_excess_per_step": round(diffs[phase], 3), "step_ms": round(run.step_ms, 3),
          "busy": "data + compute + optimizer, without waits"}
    if waits and all(w is not None for w in waits):
        ev["other_ranks_comm_wait_ms"] = round(statistics.median(waits), 3)
    title = (f"{run.label}: rank {cand} is the slowest in {share_slowest:.0%} of the logged intervals; its own work "
             f"takes {ratio:.2f}x as long as the other ranks' (+{gap:,.1f} ms per step, median over intervals), "
             f"mostly {phase} (+{diffs[phase]:,.1f} ms); the others wait for it.")
    cause = device_cause(run.device)
    return [Finding("straggler", severity(gap / run.step_ms), title, ev, advise("straggler", cause, rank=cand),
                    score=gap / run.step_ms, run=run.label, cause=cause)]


def share_of_step(run: Run, phase: str, limit: float) -> list[Finding]:
    v = run.phase_over_ranks(phase)
    if v is None or v < limit * run.step_ms:
        return []
    kind = PHASE_KIND[phase]
    what = {"data": "waits for data", "idle": "is idle outside the measured phases (host overhead)"}[phase]
    title = (f"{run.label}: even the fastest rank {what} {v:,.1f} ms of every {run.step_ms:,.1f} ms step "
             f"({100 * v / run.step_ms:.0f}%; {v / run.accum:,.1f} ms per micro-step).")
    ev = {f"{phase}_ms_per_step": round(v, 3), "step_ms": round(run.step_ms, 3),
          "share_of_step": round(v / run.step_ms, 4), f"{phase}_ms_per_micro_step": round(v / run.accum, 3)}
    cause = device_cause(run.device) if (kind, device_cause(run.device)) in ADVICE else ""
    return [Finding(kind, severity(v / run.step_ms), title, ev, advise(kind, cause), score=v / run.step_ms,
                    run=run.label, cause=cause)]


# ------------------------------------------------------------------------------ what the reconstruction found
def misreport_finding(runs: list[Run], rec: Reconstruction, scaling: dict, th: Thresholds,
                      lost: bool = False) -> Finding | None:
    """The logs misreport what ran: say what they really did, whether that explains the scaling the
    user saw (`lost`: another finding says a larger run lost time), and what to fix in the logger."""
    if not rec.corrected:
        return None
    by_label = {rr.label: rr for rr in rec.runs}
    effs = {row["run"]: row["efficiency"] for row in scaling["runs"]}
    multi = scaling["mode"] not in ("single_run", "not_comparable", "same_world_size")
    base = runs[0]

    def printed_per_gpu(r: Run) -> float:
        return r.local_batch * r.accum_printed * r.seq_len / (r.step_ms / 1000)

    printed_eff = min(printed_per_gpu(r) / printed_per_gpu(base) for r in runs)
    eff = min((v for v in effs.values() if v is not None), default=None)
    no_loss = multi and eff is not None and eff >= th.efficiency_ok and not lost
    rates = " and ".join(f"{by_label[r.label].tokens_per_sec_per_gpu:,.0f}" for r in runs)
    if no_loss and any(r.accum != r.accum_printed for r in runs):
        work = "; ".join(f"{r.label}: {r.accum} micro-step{'s' if r.accum > 1 else ''} per GPU"
                         + (f", not the {r.accum_printed} printed" if r.accum != r.accum_printed else "") for r in runs)
        title = (f"No scaling loss: the runs did different work per step ({work}), and each GPU processed "
                 f"{rates} tokens/s ({eff:.0%} {scaling['mode']}-scaling efficiency).")
    elif no_loss:
        wrong = sorted({m for r in runs for m in by_label[r.label].reading})
        title = (f"No scaling loss ({eff:.0%} {scaling['mode']}-scaling efficiency from step times and batch "
                 f"settings; each GPU processed {rates} tokens/s), but the logs misreport: "
                 f"{'; '.join(MISREPORTS[m][0] for m in wrong)}.")
    else:
        says = []
        for r in runs:
            rr = by_label[r.label]
            if rr.reading:
                mfu = f", {rr.mfu_dense_pct:.1f}% MFU on the dense bf16 peak" if rr.mfu_dense_pct is not None else ""
                says.append(f"{r.label}: {'; '.join(MISREPORTS[m][0] for m in rr.reading)}; corrected, "
                            f"{rr.micro_steps_per_step} micro-steps per GPU per step and "
                            f"{rr.tokens_per_sec_per_gpu:,.0f} tokens/s per GPU{mfu}")
        title = "The logs misreport what ran. " + ". ".join(says) + "."
        if multi and eff is not None:
            title += f" Corrected scaling efficiency: {eff:.0%}."
    ev = {rr.label: {"reading": rr.reading, "micro_steps_per_step": rr.micro_steps_per_step,
                     "micro_steps_printed": rr.micro_steps_printed,
                     "tokens_per_sec_per_gpu": round(rr.tokens_per_sec_per_gpu, 1),
                     "mfu_dense_pct": None if rr.mfu_dense_pct is None else round(rr.mfu_dense_pct, 2),
                     "printed_dense_peak_share": rr.printed_dense_peak_share} for rr in rec.runs if rr.reading}
    if multi:
        ev["scaling_efficiency_printed"] = round(printed_eff, 4)
        ev["scaling_efficiency_corrected"] = eff
    throughput = any(m.startswith(("tokens_per_sec", "accumulation")) for rr in rec.runs for m in rr.reading)
    return Finding("measurement_inconsistency", "high" if throughput else "medium", title, ev,
                   advise("measurement_inconsistency", "misreport", fixes="; ".join(rec.fixes)),
                   score=1.0 if no_loss else 0.05, cause="misreport",
                   misreports=sorted({m for rr in rec.runs for m in rr.reading}))


def insufficient_finding(runs: list[Run]) -> Finding | None:
    short = [r for r in runs if r.only_warmup]
    if not short:
        return None
    which = ", ".join(f"{r.label} (last iter {r.entries[-1]['iter']})" for r in short)
    title = (f"Only warm-up entries were logged for {which}: their step time holds start-up and compilation, so "
             f"no stall, communication or scaling figure can be trusted.")
    return Finding("insufficient_data", "info", title, {r.label: {"last_iter": r.entries[-1]["iter"],
                                                                   "entries": r.excluded + len(r.entries)}
                                                         for r in short}, advise("insufficient_data"), score=1.0)



def healthy(runs: list[Run], scaling: dict, effs: dict, gbps: dict, mode: str) -> Finding:
    base = runs[0]
    if mode == "single_run":
        title = (f"One run ({base.label}): no fault found in its own figures; no scaling claim (a scaling "
                 "diagnosis needs a second run at another world size).")
        return Finding("healthy", "info", title, {"tokens_per_sec_per_gpu": round(base.per_gpu, 1)}, advise("healthy"))
    worst = min((row["efficiency"] for row in scaling["runs"] if row["efficiency"] is not None), default=None)
    title = ("No fault found: every log is self-consistent, the runs are like for like"
             + (f", and the lowest scaling efficiency is {worst:.0%}" if worst is not None else "") + "."
             + (" Each larger run's step is within the margin of what the model, world size and link predict."
                if mode not in ("not_comparable", "same_world_size") else ""))
    ev, cause, remedies = {"scaling_efficiency": effs}, "", []
    if mode != "not_comparable" and len(runs) > 1:
        lost = largest_loss(base, runs[-1], gbps[runs[-1].label])
        if lost:
            title += " " + lost.text
            ev["largest_loss"] = lost.evidence()
            cause, remedies = lost.cause, lost.remedies
    return Finding("healthy", "info", title, ev, advise("healthy", cause, remedies), cause=cause, remedies=remedies)


SLOW_LINK = 2.5  # a healthy run's communication this many times its prediction (at the calibrated link) is named


def largest_loss(base: Run, run: Run, gbps: float, floor: float = 0.02) -> Loss | None:
    """Where a healthy run's lost efficiency goes: the phase of the largest run that exceeds its
    prediction from the baseline by the most (at least `floor` of the step), in words. Compute that
    grows while little communication is exposed, at a larger world size with collectives overlapping
    backward, is the overlap's cost: NCCL kernels share the SMs and memory bandwidth with backward."""
    if not (run.has_breakdown and base.has_breakdown) or run is base or run.step_ms <= 0:
        return None
    rows, noise = phase_excess(base, run, gbps)
    if not rows:
        return None
    phase, got, want, excess = max(rows, key=lambda r: r[3])
    # communication several times what the baseline and the link predict is named even while it costs
    # the step little: hidden behind this batch's backward, it shows at a smaller batch or more ranks
    slow_link = phase == "comm" and want > 0 and got >= SLOW_LINK * want and excess >= floor / 2 * run.step_ms
    if (excess < floor * run.step_ms and not slow_link) or excess <= noise[phase]:
        return None  # too small to name, or within the step-to-step jitter
    out = Loss(run.label, phase, round(got, 3), round(want, 3), round(excess, 3), round(excess / run.step_ms, 4), "")
    text = (f"The largest loss, in {run.label}: {phase} takes {got:,.1f} ms per step where the baseline predicts "
            f"{want:,.1f} ms (+{excess:,.1f} ms, {100 * excess / run.step_ms:.0f}% of the step).")
    comm = run.phase_over_ranks("comm")
    mode = cfg_value(run, "data_parallel")
    traits = MODES.get(mode) if mode else None
    overlapped = phase == "compute" and run.world > base.world and traits is not None and traits.overlaps_comm
    if overlapped and comm is None:
        text += (f" ({mode}'s exposed communication cannot be told apart from compute in these logs: part of "
                 f"this may be waiting for collectives.)")
    elif slow_link:
        out.cause = "slow_link"
        text += (f" Communication takes {got / want:.1f}x what the baseline and the link predict: hidden behind this "
                 f"batch's backward, a slower link than the one assumed costs more at a smaller batch or on more GPUs.")
    elif overlapped and comm < excess:
        out.cause, out.exposed_comm_ms_per_step = "overlap_contention", round(comm, 3)
        text += (f" Only {comm:,.1f} ms of communication is exposed, so the likely cause is the {mode} collectives "
                 f"that overlap the backward pass: their kernels share the SMs and memory bandwidth with it.")
        out.remedies = overlap_remedies(mode, traits.shards_params, run)
    out.text = text
    return out


def overlap_remedies(mode: str, shards_params: bool, run: Run) -> list[str]:
    """What shrinks the cost of collectives overlapping backward, in the order they measured best
    (docs/diagnosis.md, "Measured remedies"), given what the run already does."""
    if shards_params:
        gathers = cfg_value(run, "parallelism.fsdp_copy_engine_all_gather")
        # the gradient bytes: halved by a bf16 reduction, unless the bf16 gradients already crossed as they are
        grads = "fsdp_grads_crossed_bf16" if gradients_cross_bf16(run) else "fsdp_reduce_bf16"
        if gathers in ("on", True):
            return [grads, "fsdp_gathers_ran_on_copy_engines"]
        if gathers == "auto":
            return [grads, "fsdp_gathers_auto"]
        return ["fsdp_copy_engine_gathers", grads]  # off, or a log that does not say
    # an all-reduce split onto the copy engines measured slower, so the next step up is fsdp
    first = ["ddp_reduce_bf16"] if mode == "ddp" and cfg_value(run, "parallelism.ddp_reduce_dtype") != "bfloat16" else []
    return first + ["fsdp_instead"]

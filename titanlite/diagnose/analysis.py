"""Findings from a set of runs: like-for-like check, per-log consistency, scaling efficiency, and
one detector per fault kind. Every detector returns `Finding`s carrying the numbers behind them.

Attribution works per phase. The smallest run is the baseline; for each larger run, every phase is
compared with what the baseline predicts for the larger run's per-GPU work:
  data, compute, idle  scale with per-GPU tokens per step (micro-batches x local batch x seq_len);
  optimizer            stays the same (a lower bound for sharded optimizers, which do less);
  comm                 baseline + the extra time a ring all-reduce of the gradients needs at the
                       larger world size, at the link bandwidth (a lower bound: real links do worse).
A phase that exceeds its prediction by `growth` x, by `share` of the larger run's step, and by more
than the entry-to-entry jitter of both runs (sum of their inter-quartile ranges: a difference smaller
than the noise is no evidence) becomes a finding of that phase's kind. Run-wide phases use the fastest rank (`min` over ranks), so one slow
rank, and the others' waits for it, show up as a `straggler` and nowhere else.

Every result is a typed record: `Finding` (kind, cause, severity, title, evidence, remedies,
misreports; its next check written from titanlite.diagnose.advice's table, keyed by kind and cause),
`Setting` (a like-for-like row), `Check` (a recomputed figure), `Loss` (where a healthy run's efficiency goes) and
`Reason` (why the confidence is lower, with the flags that would settle it). Each figure has one
function (gradient_bytes, allreduce_ms, allreduce_extra_ms, predicted_step_ms); figures measured on
benchmarks live in docs/diagnosis.md, which the advice points to.

Findings rest only on trusted figures: the work per step is the reconstruction's (reconstruct.py),
and a run whose only entries are warm-up, or that no physically possible reading explains, takes
part in no stall, communication or straggler finding.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field, fields, replace

from titanlite.diagnose.advice import ADVICE, advise, device_cause
from titanlite.diagnose.reconstruct import HARDWARE_FLAG, MISREPORTS, MODEL_FLAG, Reconstruction, registry_args
from titanlite.diagnose.runs import GPU_READINGS, PHASES, Run, iqr
from titanlite.hardware import lookup
from titanlite.models.args import mfu_pct
from titanlite.parallel.modes import MODES
from titanlite.parallel.policy import bf16_gradients_refusal
from titanlite.parallel.settings import DataParallelSettings, PrecisionSettings

SEVERITY_ORDER = {"high": 0, "medium": 1, "low": 2, "info": 3}
# kinds ranked before any other: nothing else compares like for like, or nothing else is measured yet
FIRST = {"config_mismatch": 0, "insufficient_data": 1}
CONFIDENCE = ("high", "medium", "low")


@dataclass
class Thresholds:
    growth: float = 1.3  # a phase is 'grown' at this ratio to its prediction ...
    share: float = 0.10  # ... when the excess is also at least this share of the step
    data_share: float = 0.15  # data wait this share of the step is a data stall on its own
    idle_share: float = 0.20  # idle (host) time this share of the step is host overhead on its own
    straggler: float = 1.25  # slowest rank's busy time / median of the other ranks
    straggler_consistency: float = 0.75  # ... and it is the slowest in this share of the entries
    consistency_tol: float = 0.03  # relative error tolerated between a logged figure and its recomputation
    comm_margin: float = 3.0  # without a breakdown: step growth beyond this x the all-reduce estimate is not comm
    efficiency_ok: float = 0.80  # below this, a run is not healthy even when no single phase stands out
    min_steady: int = 3  # fewer steady log entries than this lowers the confidence
    suspect_share: float = 0.05  # a reading needing less than this share of the dense peak is suspect
    busy_drop: float = 10.0  # GPU utilisation this many points under the baseline's: the GPUs waited, not computed
    clock_drop: float = 0.10  # SM clock this share under the baseline's at the same utilisation: throttled
    power_drop: float = 0.25  # power this share under the baseline's at the same utilisation: kernels that wait


@dataclass
class Finding:
    kind: str
    severity: str  # high | medium | low | info
    title: str  # one sentence with the key numbers
    evidence: dict  # named numbers, units in the names
    next_check: str  # advice.advise(kind, cause, remedies, ...): written from the advice table
    score: float = 0.0  # share of a step (or relative error) at stake: the ranking key
    run: str = ""
    cause: str = ""  # the advice table's key beside the kind (titanlite.diagnose.advice)
    remedies: list[str] = field(default_factory=list)  # advice.REMEDIES keys, in the order they measured best
    # reconstruct.MISREPORTS keys: what the logs misreport (cause "misreport"), all runs' together; what
    # fixes each is in the next check, not in `remedies`, which change how the run trains
    misreports: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        d = asdict(self)
        d["score"] = round(d["score"], 4)
        return d


@dataclass
class Setting:
    """One row of the like-for-like check: a setting's value in each run."""
    setting: str
    key: str
    values: list
    same: bool
    ok: bool  # the difference (if any) leaves the runs comparable


@dataclass
class Check:
    """One of a log's figures recomputed from its inputs, at the entry where they disagree most."""
    check: str
    worst_iter: int
    logged: float
    recomputed: float
    error_pct: float
    ok: bool


@dataclass
class Loss:
    """Where a healthy run's lost efficiency goes: its phase furthest above the baseline's prediction."""
    run: str
    phase: str
    ms_per_step: float
    predicted_ms_per_step: float
    excess_ms_per_step: float
    share_of_step: float
    text: str
    # "overlap_contention": compute grew beside overlapped collectives; "slow_link": comm many times its prediction
    cause: str = ""
    remedies: list[str] = field(default_factory=list)  # advice.REMEDIES keys for that cause
    exposed_comm_ms_per_step: float | None = None

    def evidence(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("text", "remedies") and v not in ("", None, [])}


@dataclass
class Reason:
    """Why the confidence is not higher; `flags`: the diagnose flags that would let the check run."""
    run: str
    cause: str   # warmup_only | few_entries | no_step_time | impossible | suspect | gpu_unknown | model_unknown
                 # | ambiguous | allreduce_unknown | host_unknown
    level: int   # 1: medium at most, 2: low
    text: str
    flags: tuple[str, ...] = ()
    logs: tuple[str, ...] = ()  # what a rerun's log would need to show to settle it (ambiguous)


def devices(run: Run) -> str:
    return "GPUs" if run.device == "cuda" else f"{run.device.upper()} processes"


# which finding a grown phase is
PHASE_KIND = {"data": "data_stall", "compute": "compute_stall", "optimizer": "compute_stall",
              "comm": "communication", "idle": "host_overhead"}

CPU_GBPS = 1.0  # gloo over loopback / shared memory, roughly


def fmt(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.4g}"


def severity(score: float) -> str:
    return "high" if score >= 0.25 else "medium" if score >= 0.10 else "low"


def rel_err(logged: float, expected: float) -> float:
    return abs(logged - expected) / abs(expected) if expected else (0.0 if logged == 0 else float("inf"))


# ------------------------------------------------------------------------------ like for like
def cfg_value(run: Run, key: str):
    c = run.config
    if key == "model":
        name, flavor = c.get("model.name", run.model.get("name")), c.get("model.flavor", run.model.get("flavor"))
        return f"{name}/{flavor}" if name else None
    if key == "hardware":
        return run.hardware.get("name")
    if key == "data_parallel":  # one rank runs the single-device path whatever the mode is
        return None if run.world == 1 else c.get("data_parallel")
    if key in dict(HOST_KEYS):
        return (run.hardware.get("host") or {}).get(key)
    return None if c.get(key) == "" else c.get(key)  # an empty string is a setting left unset


MUST_MATCH = [("model", "model"), ("seq_len", "seq_len"), ("training.mixed_precision_param", "precision"),
              ("compile", "compile"), ("use_cuda_graphs", "CUDA graphs"), ("attention_backend", "attention"),
              ("float8.enable", "float8"), ("activation_checkpoint.mode", "activation checkpointing"),
              ("data_parallel", "parallel mode"), ("training.dataset", "dataset"), ("training.dataset_path", "dataset path"),
              ("hardware", "hardware")]
BATCH_KEYS = [("batch_size", "local batch"), ("gradient_accumulation_steps", "accumulation steps"),
              ("global_batch_size", "global batch")]
# the host side (run log startup_info.hardware.host). On CPU the threads are the compute, so they must
# match; on GPU they only feed the kernels. The CPUs must match anywhere: another machine.
HOST_KEYS = [("threads_per_process", "threads per process"), ("cpus", "CPUs"),
             ("data_workers", "data workers per process")]
HOST_MUST_MATCH = {"cpu": {"threads_per_process", "cpus"}, "cuda": {"cpus"}}


def scaling_mode(runs: list[Run]) -> str:
    """weak: the same work per GPU (per step, or per micro-step when only the accumulation differs,
    whose per-GPU rate is still comparable); strong: the same global batch."""
    base = runs[0]
    if len(runs) == 1:
        return "single_run"
    if all(r.world == base.world for r in runs):
        return "same_world_size"
    if all(r.tokens_per_gpu_step == base.tokens_per_gpu_step for r in runs):
        return "weak"
    if all(r.tokens_per_step == base.tokens_per_step for r in runs):
        return "strong"
    if all(r.micro_batch_tokens == base.micro_batch_tokens for r in runs):
        return "weak"
    return "not_comparable"


def like_for_like(runs: list[Run]) -> tuple[list[Setting], list[Finding]]:
    rows, findings = [], []
    mode = scaling_mode(runs)
    if mode == "single_run":
        return rows, findings
    must = HOST_MUST_MATCH.get(runs[0].device, set())
    for key, name in MUST_MATCH + BATCH_KEYS + HOST_KEYS:
        values = [cfg_value(r, key) for r in runs]
        known = {repr(v) for v in values if v is not None}
        if key in dict(BATCH_KEYS):
            ok = mode != "not_comparable"
        elif key in dict(HOST_KEYS):
            ok = len(known) <= 1 or key not in must
        else:
            ok = len(known) <= 1
        rows.append(Setting(name, key, values, len(known) <= 1, ok))
    bad = [r for r in rows if not r.ok]
    if bad:
        what = "; ".join(f"{r.setting}: " + " vs ".join(str(v) for v in r.values) for r in bad)
        findings.append(Finding(
            "config_mismatch", "high",
            f"The runs differ in more than the world size ({what}): their throughput cannot be compared as scaling.",
            {r.key: r.values for r in bad}, advise("config_mismatch", cause := device_cause(runs[0].device)),
            score=1.0, cause=cause))
    return rows, findings


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


# ------------------------------------------------------------------------------ scaling
def link_gbps(run: Run, override: float | None) -> float:
    if override:
        return override
    if run.device != "cuda":
        return CPU_GBPS
    hw = lookup(str(run.hardware.get("name") or ""))
    return hw.link_gbps if hw else 450.0  # an unknown GPU: an NVLink-class node


def model_params(run: Run) -> int | None:
    """The run's parameter count: what its log prints (or --model gave), else the registered model it
    names; None when neither is known."""
    params = run.model.get("params")
    if not (isinstance(params, (int, float)) and params > 0):
        args = registry_args(run.model, run.config)
        params = args.num_params() if args is not None else None
    return None if params is None else int(params)


def gradient_bytes(run: Run) -> float | None:
    """Bytes of gradients a step reduces (None: the model's size is not known)."""
    params = model_params(run)
    if not params:
        return None
    bf16 = "bfloat16" in (run.config.get("parallelism.fsdp_reduce_dtype"), run.config.get("parallelism.ddp_reduce_dtype"))
    return params * (2 if bf16 or gradients_cross_bf16(run) else 4)


def gradients_cross_bf16(run: Run) -> bool:
    """Did fsdp's bf16 gradients cross the link as they are (parallelism.fsdp_gradient_transport: titanlite's
    fsdp and hsdp with bf16 compute, a float32 reduction and one micro-step a step)? False where the log
    does not say."""
    c = run.config
    if c.get("parallelism.fsdp_gradient_transport") not in ("auto", "bfloat16") or c.get("data_parallel") not in MODES:
        return False
    dp = DataParallelSettings(**{f.name: c.get(f"parallelism.{f.name}") for f in fields(DataParallelSettings)})
    dp = replace(dp, data_parallel=c["data_parallel"])
    precision = PrecisionSettings(c.get("training.mixed_precision_param"), c.get("training.bf16_params"))
    return (bf16_gradients_refusal(dp, precision, run.hardware.get("device", "cpu")) is None
            and c.get("gradient_accumulation_steps", 1) == 1)


def allreduce_ms(run: Run, gbps: float) -> float | None:
    """Ring all-reduce of the gradients: 2 (N-1)/N x bytes over the link, at its nominal bandwidth."""
    size = gradient_bytes(run)
    return None if size is None else 2 * (run.world - 1) / run.world * size / (gbps * 1e9) * 1000


def allreduce_extra_ms(base: Run, run: Run, gbps: float) -> float | None:
    """What the larger world's all-reduce adds over the baseline's (None: the model's size is not known)."""
    a, b = allreduce_ms(run, gbps), allreduce_ms(base, gbps)
    return None if a is None or b is None else max(a - b, 0.0)


def work_ratio(base: Run, run: Run) -> float:
    """Per-GPU tokens per step of `run` over the baseline's."""
    return run.tokens_per_gpu_step / base.tokens_per_gpu_step


def predicted_step_ms(base: Run, run: Run, gbps: float) -> float:
    """The step `run` should take from the baseline's: its per-GPU work at the baseline's speed plus
    the extra all-reduce (none counted where the model's size is unknown)."""
    return base.step_ms * work_ratio(base, run) + (allreduce_extra_ms(base, run, gbps) or 0.0)


def efficiency(runs: list[Run], mode: str) -> dict:
    base = runs[0]
    rows = []
    for r in runs:
        row = {"run": r.label, "world_size": r.world, "tokens_per_step": r.tokens_per_step,
               "step_ms": round(r.step_ms, 3), "tokens_per_sec": round(r.tokens_per_sec, 1),
               "tokens_per_sec_per_gpu": round(r.per_gpu, 1),
               "efficiency": round(r.per_gpu / base.per_gpu, 4) if mode not in ("not_comparable", "single_run")
               else None}
        logged = r.tokens_per_sec_logged
        if logged is not None and base.tokens_per_sec_logged:
            row["efficiency_from_logged_tokens_per_sec"] = round((logged / r.world) / (base.tokens_per_sec_logged / base.world), 4)
        rows.append(row)
    weak = ("same per-GPU work" if all(r.tokens_per_gpu_step == base.tokens_per_gpu_step for r in runs)
            else "same micro-batch per GPU, different accumulation")
    definition = {
        "weak": f"{weak}: efficiency = per-GPU tokens/s / baseline per-GPU tokens/s (1.0 = perfect)",
        "strong": "same global batch: efficiency = (baseline step time x baseline GPUs) / (step time x GPUs) "
                  "= per-GPU tokens/s / baseline per-GPU tokens/s",
        "same_world_size": "same world size: efficiency = tokens/s / baseline tokens/s",
        "not_comparable": "neither per-GPU work nor global batch is the same: no efficiency",
        "single_run": "one run: no scaling claim",
    }[mode]
    basis = "tokens per step from the batch settings over the median step time (not the logged rate)"
    if any(r.accum != r.accum_printed for r in runs):
        basis = basis.replace("the batch settings", "the batch settings as reconstructed")
    if any(not r.has_step_time for r in runs):
        basis += "; a log without a time per iteration: its logged rate, as reconstructed"
    return {"mode": mode, "baseline": base.label, "definition": definition, "basis": basis, "runs": rows}


def predicted(base: Run, run: Run, gbps: float) -> dict[str, float | None]:
    """What each phase of `run` should cost (ms per step, fastest rank) given the baseline."""
    work = work_ratio(base, run)
    out = {}
    for p in PHASES:
        b = base.phase_over_ranks(p)
        if p == "comm":
            out[p] = (b or 0.0) + (allreduce_extra_ms(base, run, gbps) or 0.0)
        elif p == "optimizer":
            out[p] = b
        else:
            out[p] = None if b is None else b * work
    return out


def phase_excess(base: Run, run: Run, gbps: float) -> tuple[list[tuple[str, float, float, float]], dict[str, float]]:
    """(phase, measured, predicted, excess) in ms per step for each phase both logs have, and each
    phase's step-to-step jitter (interquartile ranges of the two runs added)."""
    pred = predicted(base, run, gbps)
    rows, noise = [], {}
    for p in PHASES:
        got, want = run.phase_over_ranks(p), pred[p]
        if got is None or want is None:
            continue
        rows.append((p, got, want, got - want))
        noise[p] = iqr(run.phase_series(p)) + iqr(base.phase_series(p))
    return rows, noise


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
            ev["expected_allreduce_ms"] = round(allreduce_ms(run, gbps), 3)
            ev["link_gbps_assumed"] = gbps
            ev["gradient_bytes"] = gradient_bytes(run)
        if eff is not None:
            ev["scaling_efficiency"] = eff
        cause = device_cause(run.device) if (kind, device_cause(run.device)) in ADVICE else ""
        if kind == "compute_stall":
            cause, readings, why = stall_cause(base, run, th)
            ev.update(readings)
            title += why
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
    what an all-reduce of the gradients can cost, the GPUs themselves are computing slower."""
    comm_extra = allreduce_extra_ms(base, run, gbps)
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
        ev["expected_allreduce_ms"] = round(allreduce_ms(run, gbps), 3)
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
        bound = (f"{excess / comm_extra:,.0f}x what the larger all-reduce of the gradients can add "
                 f"(+{comm_extra:,.1f} ms at {gbps:g} GB/s)" if comm_extra > 0 else
                 "more than the all-reduce can add, which is no larger than the baseline's")
        title = head + f"the {excess:,.1f} ms excess is {bound}, so the {devices(run)} compute slower" + tail
        kind = "compute_stall"
    else:
        title = (f"{run.label} vs {base.label}: the step grows by {excess:,.1f} ms beyond the per-GPU work, about what "
                 f"gradient communication can cost ({comm_extra:,.1f} ms at {gbps:g} GB/s); log a breakdown to confirm.")
        kind = "communication"
    cause = ""
    if kind == "compute_stall":
        cause, readings, why = stall_cause(base, run, th)
        ev.update(readings)
        title += why
    return [Finding(kind, severity(excess / run.step_ms), title, ev, advise(kind, cause),
                    score=max(excess, 0.0) / run.step_ms, run=run.label, cause=cause)]


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
def misreport_finding(runs: list[Run], rec: Reconstruction, scaling: dict, th: Thresholds) -> Finding | None:
    """The logs misreport what ran: say what they really did, whether that explains the scaling the
    user saw, and what to fix in the logger."""
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
    no_loss = multi and eff is not None and eff >= th.efficiency_ok
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


def confidence(runs: list[Run], rec: Reconstruction | None, th: Thresholds,
               findings: list[Finding] = ()) -> tuple[str, list[Reason]]:
    """How far the verdict can be trusted, and why not further: a check that could not run (an unknown
    GPU or model, a host the log does not describe) keeps it below high, and names the flag that
    would let it run."""
    why: list[Reason] = []
    for r in runs:
        n = len(r.entries)
        if r.only_warmup:
            why.append(Reason(r.label, "warmup_only", 2, f"{r.label}: every logged entry is warm-up, so its step "
                                                         "time holds start-up and compilation"))
        elif n < th.min_steady:
            why.append(Reason(r.label, "few_entries", 2 if n == 1 else 1,
                              f"{r.label}: {n} steady log entr{'y' if n == 1 else 'ies'} (fewer than {th.min_steady}): "
                              "too few to weigh a difference against step-to-step jitter"))
        if not r.has_step_time:
            why.append(Reason(r.label, "no_step_time", 1, f"{r.label}: no time per iteration in the log, so its step "
                                                          "time is derived from its logged tokens/s, which no clock can check"))
    on_gpu = {r.label for r in runs if r.device == "cuda"}
    for rr in rec.runs if rec else []:
        if rr.plausibility == "impossible":
            why.append(Reason(rr.label, "impossible", 2, f"{rr.label}: no reading of its log is physically possible "
                                                         f"({rr.why})"))
        elif rr.plausibility == "suspect":
            why.append(Reason(rr.label, "suspect", 1,
                              f"{rr.label}: its figures imply only {100 * rr.dense_peak_share:.1f}% of the dense bf16 "
                              "peak, too little for a GPU that is not starved: a figure may be wrong in a way no "
                              "reading covers"))
        unchecked = rr.plausibility == "unchecked" and rr.gpu != "cpu" and rr.label in on_gpu
        missing = [what for what, known in (("the GPU", rr.peak_tflops_dense), ("the model", rr.flops_per_token))
                   if not known] if unchecked else []
        flags = tuple(f for f, known in ((HARDWARE_FLAG, rr.peak_tflops_dense), (MODEL_FLAG, rr.flops_per_token))
                      if not known) if unchecked else ()
        if unchecked:
            why.append(Reason(rr.label, "gpu_unknown" if not rr.peak_tflops_dense else "model_unknown", 1,
                              f"{rr.label}: {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not known "
                              f"({rr.gpu or 'not in the log'}), so no reading could be checked against the dense "
                              f"peak (pass {' and '.join(f.split()[0] for f in flags)})", flags))
        if rr.ambiguous_with:
            why.append(Reason(rr.label, "ambiguous", 1, f"{rr.label}: another reading fits its log as well "
                                                        f"({'; '.join(rr.ambiguous_with)})",
                              tuple(rec.settle_flags), tuple(rec.settle_logs)))
    top = findings[0].kind if findings else ""
    if top in ("compute_stall", "communication") and len(runs) > 1:
        for r in runs:
            if gradient_bytes(r) is None:
                why.append(Reason(r.label, "allreduce_unknown", 1, f"{r.label}: the model's size is not known, so the "
                                  "all-reduce's cost could not be told apart from compute (pass --model)", (MODEL_FLAG,)))
    if top == "compute_stall" and len(runs) > 1 and all(r.device == "cpu" for r in runs):
        for r in runs:
            if cfg_value(r, "threads_per_process") is None:
                why.append(Reason(r.label, "host_unknown", 1, f"{r.label}: its threads per process are not in the log "
                                  "(torchrun gives each of several processes one), so slower compute per process "
                                  "may be fewer threads, not a stall"))
    level = max((w.level for w in why), default=0)
    return CONFIDENCE[level], why


def settle_flags(reasons: list[Reason]) -> str:
    """The flags that would let the checks behind a lowered confidence run, once each."""
    return " ".join(dict.fromkeys(f for r in reasons for f in r.flags))


def settle_text(flags: str, logs: list[str]) -> str:
    """'rerun diagnose with FLAGS, or give logs that show X and Y': what would settle the checks."""
    parts = ([f"rerun diagnose with {flags}"] if flags else []) + \
        ([f"give logs that show {' and '.join(logs)}"] if logs else [])
    return ", or ".join(parts)


def trusted(r: Run, rec: Reconstruction | None) -> bool:
    """Figures a stall, communication or straggler finding may rest on."""
    if r.only_warmup:
        return False
    rr = next((x for x in rec.runs if x.label == r.label), None) if rec else None
    return rr is None or rr.plausibility != "impossible"


# ------------------------------------------------------------------------------ all together
@dataclass
class Analysis:
    runs: list[Run]
    findings: list[Finding]
    like_for_like: list[Setting]
    consistency: dict[str, list[Check]]
    scaling: dict
    gbps: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    reconstruction: Reconstruction | None = None
    confidence: str = "high"
    reasons: list[Reason] = field(default_factory=list)
    others: list["OtherReading"] = field(default_factory=list)  # the other readings that fit the logs as well

    @property
    def verdict(self) -> str:
        """The top finding under the chosen reading of the logs."""
        return self.findings[0].kind

    @property
    def verdicts(self) -> list[str]:
        """The verdict under each reading that fits the logs as well, the chosen reading's first, once each."""
        return list(dict.fromkeys([self.verdict] + [o.verdict for o in self.others]))

    @property
    def confidence_reasons(self) -> list[str]:
        return [r.text for r in self.reasons]

    @property
    def settle_with(self) -> str:
        """Flags that would let the checks behind a lowered confidence run ('' when none would)."""
        return settle_flags(self.reasons)

    @property
    def settle_logs(self) -> list[str]:
        """What logs would need to show to tell equally fitting readings apart."""
        return list(dict.fromkeys(x for r in self.reasons for x in r.logs))

    @property
    def settle(self) -> str:
        return settle_text(self.settle_with, self.settle_logs)

    def headline(self) -> str:
        """The report's first line: the verdict and its confidence, nothing else that reads like either.
        Where readings that fit the logs as well lead to other verdicts, it names each."""
        if len(self.verdicts) > 1:
            n = len(self.others) + 1
            return (f"Verdict: {' or '.join(self.verdicts)} ({'two' if n == 2 else n} readings fit the logs equally), "
                    f"confidence {self.confidence}")
        return f"Verdict: {self.verdict}, confidence {self.confidence}"


@dataclass
class OtherReading:
    """Another reading that fits the logs as well as the chosen one, and what the logs say under it."""
    verdict: str
    summary: str                 # its top finding's title
    reconstruction: Reconstruction

    def to_json(self) -> dict:
        return {"verdict": self.verdict, "summary": self.summary, **self.reconstruction.to_json()}


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
            if r.has_breakdown and base.has_breakdown:
                findings += phase_growth(base, r, th, gbps[r.label], effs[r.label])
            else:
                findings += step_growth(base, r, th, gbps[r.label], effs[r.label])
        findings += straggler(r, th)
        findings += share_of_step(r, "data", th.data_share)
        findings += share_of_step(r, "idle", th.idle_share)
    findings += [f for f in (insufficient_finding(runs), misreport_finding(runs, rec, scaling, th) if rec else None) if f]
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


def healthy(runs: list[Run], scaling: dict, effs: dict, gbps: dict, mode: str) -> Finding:
    base = runs[0]
    if mode == "single_run":
        title = (f"One run ({base.label}): no fault found in its own figures; no scaling claim (a scaling "
                 "diagnosis needs a second run at another world size).")
        return Finding("healthy", "info", title, {"tokens_per_sec_per_gpu": round(base.per_gpu, 1)}, advise("healthy"))
    worst = min((row["efficiency"] for row in scaling["runs"] if row["efficiency"] is not None), default=None)
    title = ("No fault found: every log is self-consistent, the runs are like for like"
             + (f", and the lowest scaling efficiency is {worst:.0%}" if worst is not None else "") + ".")
    ev, cause, remedies = {"scaling_efficiency": effs}, "", []
    if mode != "not_comparable" and len(runs) > 1:
        lost = largest_loss(base, runs[-1], gbps[runs[-1].label])
        if lost:
            title += " " + lost.text
            ev["largest_loss"] = lost.evidence()
            cause, remedies = lost.cause, lost.remedies
    return Finding("healthy", "info", title, ev, advise("healthy", cause, remedies), cause=cause, remedies=remedies)


# data-parallel modes whose gradient (and, for FSDP, parameter) collectives run while backward computes


SLOW_LINK = 3.0  # a healthy run's communication this many times its prediction is named, however small


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

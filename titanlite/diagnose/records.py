"""Every result of a diagnosis as a typed record, and how a finding is graded and worded.

`Finding` (kind, cause, severity, title, evidence, remedies, misreports; its next check written from
titanlite.diagnose.advice's table, keyed by kind and cause), `Setting` (a like-for-like row), `Check` (a
recomputed figure), `Loss` (where a healthy run's efficiency goes), `Reason` (why the confidence is
lower, with the flags that would settle it), `Analysis` (all of it, with the verdict) and
`OtherReading` (the verdict under another reading of the logs that fits as well). `Thresholds` holds
every limit a detector applies.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from titanlite.diagnose.reconstruct import Reconstruction
from titanlite.diagnose.runs import Run


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
    # without a breakdown: a step this many times beyond its prediction as all the collectives can add (none of
    # their time hidden) is not theirs, even on a link at half the speed assumed
    comm_margin: float = 2.0
    efficiency_ok: float = 0.80  # below this, a phase that stands out least is still named
    # a step beyond the prediction (the baseline's per-GPU work + the collectives with overlap) by more than this
    # share of the step is a scaling loss: the throughput model itself lands within 2% of measured steps
    prediction_margin: float = 0.05
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



def fmt(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.4g}"


def severity(score: float) -> str:
    return "high" if score >= 0.25 else "medium" if score >= 0.10 else "low"


def rel_err(logged: float, expected: float) -> float:
    return abs(logged - expected) / abs(expected) if expected else (0.0 if logged == 0 else float("inf"))



def settle_flags(reasons: list[Reason]) -> str:
    """The flags that would let the checks behind a lowered confidence run, once each."""
    return " ".join(dict.fromkeys(f for r in reasons for f in r.flags))


def settle_text(flags: str, logs: list[str]) -> str:
    """'rerun diagnose with FLAGS, or give logs that show X and Y': what would settle the checks."""
    parts = ([f"rerun diagnose with {flags}"] if flags else []) + \
        ([f"give logs that show {' and '.join(logs)}"] if logs else [])
    return ", or ".join(parts)


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

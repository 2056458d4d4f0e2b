"""What each run really did, when its logger may have misreported it.

A log's figures come from two kinds of source: what the run was set to do (printed local batch,
accumulation, effective batch, tokens per step, tokens seen) and what it measured (step time, and
the tokens/s, TFLOP/s and MFU its logger derived). Loggers get the second kind wrong in a few usual
ways (MISREPORTS): a per-GPU rate logged as the total (or the reverse), accumulation that each GPU
really ran divided by the world size or set somewhere other than the printed config, MFU over all
GPUs' peak for one GPU's FLOP/s, a sparse or fp8 peak in place of the dense bf16 one, FLOPs per token
counting the input embedding.

A *reading* is one choice for each: how the logger writes its figures (`Conventions`, shared by the
logs of one format, since one program wrote them) and how many micro-steps each GPU ran per step
(per log). Under a reading every figure of a log has a predicted value; a figure agrees when it is
within the tolerance of it. The score of a log is the share of agreeing figures within each source
(settings, tokens seen, rates, printed constants), summed over sources, so that three figures one
logger line derives from the same number count as one piece of evidence, not three. A reading is
physically impossible when the per-GPU FLOP/s it implies exceed the GPU's dense bf16 peak (from
titanlite.hardware), and suspect below `suspect_share` of it. The chosen reading is the possible one
whose measured figures (rates, tokens seen) contradict it in the fewest logs, then the one with the
highest total score, then the fewest misreports: a printed setting that agrees never outweighs a
measurement that does not. Readings of equal score needing at most one misreport more that give
other figures fit as well: where the GPU and model are known, the MFU each implies ranks them
(TYPICAL_MFU), and the report says why the first ranks first; those still tied are kept as
`alternatives`, which diagnose analyses too, naming each verdict and what would settle them.

Step time is the measurement the reconstruction trusts: it is a clock, and no misreport above
touches it. A log without one is read through its logged rate instead, with lower confidence.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass, field

from titanlite.diagnose.figures import median
from titanlite.diagnose.readers import registry_args
from titanlite.hardware import lookup
from titanlite.metrics.run_log import LoggedRun, steady
from titanlite.models import MODEL_REGISTRY, get_model_args
from titanlite.models.args import FLOPS_CONVENTION, ModelArgs

# misreport key -> (what it means, what to fix in the logger)
MISREPORTS = {
    "tokens_per_sec_is_one_gpu": ("the logged tokens/s is one GPU's rate, where the log format says all GPUs'",
                                  "log tokens/s over all GPUs (tokens per step x GPUs / step time), or name the "
                                  "per-GPU figure tokens_per_sec_per_gpu"),
    "tokens_per_sec_is_all_gpus": ("the logged tokens/s is all GPUs' rate, where the log format says one GPU's",
                                   "log the per-GPU rate (all GPUs' tokens / step time / GPUs)"),
    "accumulation_split": ("each GPU ran the printed accumulation divided by the world size",
                           "print the micro-steps each GPU runs per step (after the division by the world size) and "
                           "compute tokens per step from them"),
    "accumulation_differs": ("each GPU ran a different number of micro-steps per step than the printed config",
                             "print the accumulation the training loop really runs, and count tokens per step from "
                             "the batches it consumes"),
    "mfu_per_gpu_over_all_gpus": ("MFU divides one GPU's FLOP/s by all GPUs' peak",
                                  "divide one GPU's FLOP/s by one GPU's peak (or all GPUs' FLOP/s by all GPUs' peak)"),
    "mfu_all_gpus_over_one": ("MFU divides all GPUs' FLOP/s by one GPU's peak",
                              "divide all GPUs' FLOP/s by all GPUs' peak (or one GPU's FLOP/s by one GPU's peak)"),
    "peak_2x_dense": ("MFU divides by a sparse or fp8 peak, 2x the dense bf16 one",
                      "divide by the dense bf16 peak (titanlite.hardware), not the sparse or fp8 datasheet figure"),
    "peak_4x_dense": ("MFU divides by the fp8 sparse peak, 4x the dense bf16 one",
                      "divide by the dense bf16 peak (titanlite.hardware), not the fp8 sparse datasheet figure"),
    "flops_with_embedding": ("FLOPs per token count the input embedding (a lookup, no matmul)",
                             "leave the input embedding out of N in 6N (titanlite.models.args.FLOPS_CONVENTION)"),
}
PEAK_MISREPORT = {2: "peak_2x_dense", 4: "peak_4x_dense"}  # sparse = fp8 = 2x dense, fp8 sparse = 4x
RATE_MISREPORT = {"one_gpu": "tokens_per_sec_is_one_gpu", "all_gpus": "tokens_per_sec_is_all_gpus"}
MFU_MISREPORT = {"per_gpu_over_all": "mfu_per_gpu_over_all_gpus", "total_over_one": "mfu_all_gpus_over_one"}
SOURCES = ("settings", "tokens seen", "rates", "constants")
MEASURED = ("tokens seen", "rates")  # sources the run measured or counted, not printed from its settings


@dataclass(frozen=True)
class Conventions:
    """How a logger writes its figures. The defaults are what its log format documents."""
    rate: str = "as_documented"          # | "one_gpu" | "all_gpus": what its tokens/s (and TFLOP/s) really cover
    mfu: str = "right"                   # | "per_gpu_over_all" | "total_over_one"
    peak: int = 1                        # its peak over the dense bf16 peak: 1, 2 (sparse or fp8), 4 (fp8 sparse)
    flops: str = "without_embedding"     # | "with_embedding"
    accumulation: str = "per_gpu"        # | "split": the trainer divides the printed accumulation by the world size

    def misreports(self, world: int) -> list[str]:
        """What these conventions get wrong; those about GPU counts only where there are several."""
        multi = world > 1
        out = [RATE_MISREPORT.get(self.rate) if multi else None, MFU_MISREPORT.get(self.mfu) if multi else None,
               PEAK_MISREPORT.get(self.peak), "flops_with_embedding" if self.flops == "with_embedding" else None,
               "accumulation_split" if self.accumulation == "split" and multi else None]
        return [m for m in out if m]

    def micro_steps(self, accum: int, world: int) -> int | None:
        """The micro-steps per GPU per step these conventions say a printed accumulation means."""
        if self.accumulation == "per_gpu":
            return accum
        return accum // world if accum % world == 0 else None

    def rate_factor(self, world: int) -> float:
        """Logged rate over what the format says it is."""
        return {"as_documented": 1.0, "one_gpu": 1.0 / world, "all_gpus": float(world)}[self.rate]

    def mfu_factor(self, world: int) -> float:
        return {"right": 1.0, "per_gpu_over_all": 1.0 / world, "total_over_one": float(world)}[self.mfu]


@dataclass
class Facts:
    """One log's figures, medians over its steady entries; None where the log lacks them."""
    log: LoggedRun
    label: str
    world: int
    local_batch: int
    seq_len: int
    accum: int
    accum_given: bool                    # the accumulation came from the command line: not in question
    scope: str                           # what the format documents its rate to be: "total" | "per_gpu"
    step_s: float | None
    steady_entries: int
    only_warmup: bool
    logged: dict[str, float]             # tokens_per_sec, tokens_per_sec_per_gpu, tflops, tflops_per_gpu, mfu
    printed: dict[str, float]            # global_batch_size, tokens_per_iteration, tokens_seen_per_step
    gpu: str | None
    peak_dense: float | None             # TFLOP/s, titanlite.hardware
    peak_logged: float | None            # what the logger divided by
    flops: dict[str, float]              # FLOPs per token: {"without_embedding": .., "with_embedding": ..}
    flops_logged: float | None
    flops_basis: str                     # where `flops` came from

    @property
    def flops_dense(self) -> float | None:
        """FLOPs per token in titanlite's convention, for corrected MFU and the plausibility check."""
        return self.flops.get("without_embedding", self.flops_logged)


@dataclass
class Item:
    source: str
    name: str
    logged: float
    predicted: float
    agrees: bool

    def to_json(self) -> dict:
        return {"source": self.source, "figure": self.name, "logged": self.logged,
                "predicted": round(self.predicted, 6), "agrees": self.agrees}


@dataclass
class Evaluation:
    conventions: Conventions
    world: int
    micro_steps: int
    expected: int | None                 # what the conventions make of the printed accumulation
    per_gpu: float                       # corrected tokens/s per GPU
    items: list[Item]
    score: float
    dense_share: float | None            # implied per-GPU FLOP/s over the dense peak
    plausibility: str                    # possible | suspect | impossible | unchecked

    @property
    def differs(self) -> bool:
        """The run did not run what its printed accumulation means under the conventions."""
        return self.micro_steps != self.expected

    def misreports(self) -> list[str]:
        return sorted(self.conventions.misreports(self.world) + (["accumulation_differs"] if self.differs else []))

    @property
    def possible(self) -> bool:
        return self.plausibility != "impossible"

    @property
    def contradicted(self) -> int:
        """How many of the log's measured sources (its rates, its count of tokens seen) disagree with this
        reading somewhere. The printed settings are what a misreport may have got wrong; a measurement
        that contradicts the reading is evidence against it that no score of settings outweighs."""
        return sum(any(not i.agrees for i in self.items if i.source == src) for src in MEASURED)


@dataclass
class RunReading:
    """The reconstruction of one log (report.json `reconstruction.runs[i]`)."""
    label: str
    path: str
    source: str
    gpus: int
    reading: list[str]                   # misreport keys; [] = the log means what it says
    micro_steps_per_step: int
    micro_steps_printed: int
    tokens_per_sec_per_gpu: float
    mfu_dense_pct: float | None
    step_ms: float
    step_time: str                       # "logged" | "derived from the logged rate"
    plausibility: str
    dense_peak_share: float | None
    printed_dense_peak_share: float | None   # what the log as printed would need
    why: str
    facts: list[Item]
    gpu: str | None
    peak_tflops_dense: float | None
    flops_per_token: float | None
    flops_basis: str
    ambiguous_with: list[str] = field(default_factory=list)
    overrides: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    steady_entries: int = 0
    only_warmup: bool = False

    def to_json(self) -> dict:
        return {"run": self.label, "path": self.path, "format": self.source, "gpus": self.gpus,
                "reading": self.reading, "reading_text": [MISREPORTS[m][0] for m in self.reading],
                "micro_steps_per_step": self.micro_steps_per_step, "micro_steps_printed": self.micro_steps_printed,
                "tokens_per_sec_per_gpu": round(self.tokens_per_sec_per_gpu, 2),
                "mfu_dense_pct": None if self.mfu_dense_pct is None else round(self.mfu_dense_pct, 3),
                "step_ms": round(self.step_ms, 3), "step_time": self.step_time, "plausibility": self.plausibility,
                "dense_peak_share": self.dense_peak_share, "printed_dense_peak_share": self.printed_dense_peak_share,
                "why": self.why, "gpu": self.gpu, "peak_tflops_dense": self.peak_tflops_dense,
                "flops_per_token": self.flops_per_token, "flops_basis": self.flops_basis,
                "ambiguous_with": self.ambiguous_with,
                "overrides": {k: {"log": a, "flag": b} for k, (a, b) in self.overrides.items()},
                "notes": self.notes, "steady_entries": self.steady_entries, "only_warmup": self.only_warmup,
                "facts": [i.to_json() for i in self.facts]}


@dataclass
class Reconstruction:
    runs: list[RunReading]               # argument order
    fixes: list[str]                     # what to fix in the logger(s), one sentence per misreport found
    # the other readings that fit the logs as well, each a whole reconstruction (the logs of one format
    # read otherwise, the rest as chosen), in the order they rank
    alternatives: list["Reconstruction"] = field(default_factory=list)
    ranking: list["Ranking"] = field(default_factory=list)  # why the chosen reading ranks first, where the MFU
                                                             # it implies broke a tie between readings that fit as well
    settle_flags: list[str] = field(default_factory=list)  # diagnose flags that would tell the readings apart
    settle_logs: list[str] = field(default_factory=list)   # what a log would need to show to tell them apart

    @property
    def corrected(self) -> bool:
        return any(r.reading for r in self.runs)

    def to_json(self) -> dict:
        """The readings other than the chosen one (report.json `reconstruction.alternatives`)."""
        return {"runs": [{"run": r.label, "reading": r.reading, "micro_steps_per_step": r.micro_steps_per_step,
                          "tokens_per_sec_per_gpu": round(r.tokens_per_sec_per_gpu, 2),
                          "mfu_dense_pct": None if r.mfu_dense_pct is None else round(r.mfu_dense_pct, 3)}
                         for r in self.runs], "logger_fixes": self.fixes}


# ------------------------------------------------------------------------------ facts
def model_args(log: LoggedRun) -> ModelArgs | None:
    """The model from its registry name (registry_args), else the one registry model whose parameter
    count the log prints (the earlier trainer prints only N), which the log is then named as."""
    if (args := registry_args(log.model, log.config)) is not None:
        return args
    n = log.model.get("params")
    if isinstance(n, (int, float)) and n > 0:
        hits = [(m, f, a) for m, spec in MODEL_REGISTRY.items() for f, a in spec.flavors.items()
                if abs(a.num_params() / n - 1) < 0.005]
        if len(hits) == 1:
            (m, f, a), = hits
            log.model.update(name=m, flavor=f)
            log.notes.append(f"model taken to be {m}/{f} ({a.num_params():,} parameters) from the printed N")
            return a
    return None


def flops_variants(log: LoggedRun, seq_len: int) -> tuple[dict[str, float], str]:
    """FLOPs per token of the log's model without and with the input embedding, from the model
    itself (not from the figure the logger printed, which is one of the facts in question)."""
    args = model_args(log)
    if args is None:
        return {}, "as logged (model not known: pass --model)"
    f = float(args.flops_per_token(seq_len))
    out = {"without_embedding": f}
    if args.num_params() != args.num_params(exclude_embedding=True):
        out["with_embedding"] = f + 6 * (args.num_params() - args.num_params(exclude_embedding=True))
    return out, f"{args.num_params():,}-parameter model, {FLOPS_CONVENTION}"


def gather(log: LoggedRun, label: str, scope: str) -> Facts:
    cfg = log.config
    st = steady(log.iterations, cfg)
    entries = st.entries
    seen = [(b["tokens_seen"] - a["tokens_seen"]) / (b["iter"] - a["iter"]) for a, b in zip(entries, entries[1:])
            if isinstance(a.get("tokens_seen"), (int, float)) and isinstance(b.get("tokens_seen"), (int, float))
            and b["iter"] > a["iter"]]
    step_ms = median(e.get("time_ms") for e in entries)
    logged = {k: v for k in ("tokens_per_sec", "tokens_per_sec_per_gpu", "tflops", "tflops_per_gpu", "mfu")
              if (v := median(e.get(k) for e in entries)) is not None}
    printed = {k: float(cfg[k]) for k in ("global_batch_size", "tokens_per_iteration")
               if isinstance(cfg.get(k), (int, float)) and "gradient_accumulation_steps" not in log.overrides}
    if seen:
        printed["tokens_seen_per_step"] = statistics.median(seen)
    gpu = log.hardware.get("name")
    hw = lookup(str(gpu)) if gpu else None
    seq = cfg["seq_len"]
    flops, basis = flops_variants(log, seq)
    flops_logged = log.model.get("flops_per_token")
    if flops_logged is None and "tflops_per_gpu" in logged and "tokens_per_sec_per_gpu" in logged:
        flops_logged = logged["tflops_per_gpu"] * 1e12 / logged["tokens_per_sec_per_gpu"]  # the logger's own
    elif flops_logged is None and "tflops" in logged and "tokens_per_sec" in logged:
        flops_logged = logged["tflops"] * 1e12 / logged["tokens_per_sec"]
    return Facts(log, label, cfg["world_size"], cfg["batch_size"], seq, cfg["gradient_accumulation_steps"],
                 "gradient_accumulation_steps" in log.overrides, scope,
                 step_ms / 1000 if step_ms else None, len(entries), st.only_warmup, logged, printed,
                 gpu, hw.peak_tflops if hw else None, log.hardware.get("peak_tflops_per_gpu"),
                 flops, flops_logged, basis)


# ------------------------------------------------------------------------------ one reading of one log
def evaluate(f: Facts, c: Conventions, k: int, tol: float, suspect_share: float) -> Evaluation | None:
    """Predict every figure of `f` under conventions `c` with `k` micro-steps per GPU per step."""
    W, s = f.world, c.rate_factor(f.world)
    fx = f.flops.get(c.flops) if f.flops else f.flops_logged
    tokens_gpu_step = f.local_batch * k * f.seq_len
    if f.step_s:
        r = tokens_gpu_step / f.step_s
    elif "tokens_per_sec" in f.logged:
        r = f.logged["tokens_per_sec"] / (W * s)
    elif "tokens_per_sec_per_gpu" in f.logged:
        r = f.logged["tokens_per_sec_per_gpu"] / s
    else:
        return None
    items: list[Item] = []

    def add(source, name, logged, predicted, exact=False):
        if logged is None or predicted is None:
            return
        ok = logged == predicted if exact else abs(logged - predicted) <= tol * abs(predicted)
        items.append(Item(source, name, logged, predicted, ok))

    expected = f.accum if f.accum_given else c.micro_steps(f.accum, W)
    if not f.accum_given:
        add("settings", "accumulation", f.accum, f.accum if k == expected else k, exact=True)
    add("settings", "effective batch", f.printed.get("global_batch_size"), f.local_batch * k * W)
    add("settings", "tokens per step", f.printed.get("tokens_per_iteration"), tokens_gpu_step * W)
    add("tokens seen", "tokens seen per step", f.printed.get("tokens_seen_per_step"), tokens_gpu_step * W)
    if f.step_s:  # without a clock the rate defines r and is no check
        add("rates", "tokens/s", f.logged.get("tokens_per_sec"), r * W * s)
        add("rates", "tokens/s per GPU", f.logged.get("tokens_per_sec_per_gpu"), r * s)
    if fx:
        add("rates", "TFLOP/s", f.logged.get("tflops"), r * W * s * fx / 1e12)
        add("rates", "TFLOP/s per GPU", f.logged.get("tflops_per_gpu"), r * s * fx / 1e12)
    peak = c.peak * f.peak_dense if f.peak_dense else f.peak_logged
    if fx and peak:
        add("rates", "MFU", f.logged.get("mfu"), 100 * r * fx * c.mfu_factor(W) / (peak * 1e12))
    if f.peak_dense:
        add("constants", "peak TFLOP/s", f.peak_logged, c.peak * f.peak_dense)
    if f.flops and f.flops_logged:
        add("constants", "FLOPs per token", f.flops_logged, f.flops.get(c.flops))
    score = 0.0
    for src in SOURCES:
        mine = [i for i in items if i.source == src]
        if mine:
            score += sum(i.agrees for i in mine) / len(mine)
    share, plaus = None, "unchecked"
    if f.peak_dense and f.flops_dense:
        share = r * f.flops_dense / (f.peak_dense * 1e12)
        plaus = "impossible" if share > 1.0 else "suspect" if share < suspect_share else "possible"
        if plaus == "suspect":
            score -= 0.5
    return Evaluation(c, W, k, expected, r, items, score, share, plaus)


def proposals(f: Facts, c: Conventions, tol: float) -> list[int]:
    """Micro-steps per step worth trying: what the printed accumulation means under `c`, and whatever
    each figure that is proportional to the work implies under `c`."""
    if f.accum_given:
        return [f.accum]
    ks = [k for k in (c.micro_steps(f.accum, f.world),) if k]
    base = evaluate(f, c, 1, tol, 0.0)
    if base is not None:
        for item in base.items:
            if item.source == "constants" or item.name == "accumulation" or not item.predicted:
                continue
            if item.source == "rates" and not f.step_s:
                continue  # rates do not scale with k without a clock
            x = item.logged / item.predicted
            if x >= 0.5 and abs(x - round(x)) <= tol * x:
                ks.append(int(round(x)))
    return list(dict.fromkeys(k for k in ks if k >= 1))


def best(f: Facts, c: Conventions, tol: float, suspect_share: float) -> Evaluation | None:
    evs = [e for k in proposals(f, c, tol) if (e := evaluate(f, c, k, tol, suspect_share))]
    return max(evs, key=lambda e: (e.possible, -e.contradicted, round(e.score, 9), -e.differs,
                                   -abs(e.micro_steps - f.accum)), default=None)


# ------------------------------------------------------------------------------ all logs
def options(facts: list[Facts]) -> list[Conventions]:
    """Every combination of conventions that can change a prediction for these logs."""
    multi = any(f.world > 1 for f in facts)
    has = lambda key: any(key in f.logged for f in facts)
    scope = facts[0].scope
    rates = ["as_documented"] + ([("one_gpu" if scope == "total" else "all_gpus")] if multi else [])
    mfus = ["right"] + (["per_gpu_over_all", "total_over_one"] if multi and has("mfu") else [])
    peaks = [1] + ([2, 4] if any(f.peak_dense for f in facts) and (has("mfu") or any(f.peak_logged for f in facts))
                   else [])
    flops = ["without_embedding"] + (["with_embedding"] if any("with_embedding" in f.flops for f in facts) else [])
    accums = ["per_gpu"] + (["split"] if any(f.world > 1 and f.accum % f.world == 0 and not f.accum_given
                                             for f in facts) else [])
    return [Conventions(*x) for x in itertools.product(rates, mfus, peaks, flops, accums)]


def choose(facts: list[Facts], tol: float, suspect_share: float) -> tuple[list[Evaluation], list[list[Evaluation]]]:
    """The best reading of a group of logs from one format (shared conventions), and the readings of
    equal standing that differ in what they say the runs did."""
    ranked = []
    for i, conv in enumerate(options(facts)):
        evs = [best(f, conv, tol, suspect_share) for f in facts]
        if any(e is None for e in evs):
            continue
        misreports = len(conv.misreports(max(f.world for f in facts))) + sum(e.differs for e in evs)
        key = (-sum(not e.possible for e in evs), -sum(e.contradicted for e in evs), round(sum(e.score for e in evs), 9),
               -misreports)
        ranked.append((key, -i, evs))
    if not ranked:
        return [], []
    ranked.sort(key=lambda x: (x[0], x[1]), reverse=True)
    top_key, _, chosen = ranked[0]
    differs = lambda a, b: a.micro_steps != b.micro_steps or abs(a.per_gpu - b.per_gpu) > tol * abs(b.per_gpu)
    # as well supported, needing at most one misreport more, yet saying the runs did something else
    same = [evs for key, _, evs in ranked[1:] if key[:3] == top_key[:3] and key[3] >= top_key[3] - 1
            and any(map(differs, evs, chosen))]
    return chosen, same


# MFU on the dense bf16 peak that training runs of these models reach, wide around what docs/performance.md's
# tables measure (compiled, eager, float8). Among readings that fit a log
# equally well, one implying MFU inside this band is the likelier. By the log's compile setting; not logged: either.
TYPICAL_MFU = {True: (0.30, 0.75), False: (0.15, 0.60), None: (0.15, 0.75)}
TYPICAL_MARGIN = 0.02  # readings whose distance from the band differs by less than this rank the same


def typical_band(f: Facts) -> tuple[float, float]:
    compiled = f.log.config.get("compile")
    return TYPICAL_MFU[compiled if isinstance(compiled, bool) else None]


def atypical(evs: list[Evaluation], facts: list[Facts]) -> float | None:
    """How far outside the typical band the MFU a reading implies lies, summed over the logs (0: inside
    for every log); None where a log's GPU or model is not known."""
    total = 0.0
    for e, f in zip(evs, facts):
        if e.dense_share is None:
            return None
        lo, hi = typical_band(f)
        total += max(lo - e.dense_share, e.dense_share - hi, 0.0)
    return total


@dataclass
class Ranking:
    """Why the chosen reading of a format's logs ranks first among readings that fit them equally: the
    MFU on the dense bf16 peak each implies per log (%), against the band training runs reach."""
    text: str
    band_pct: tuple[float, float]
    first_mfu_pct: dict[str, float]
    others_mfu_pct: list[dict[str, float]]

    def to_json(self) -> dict:
        return {"text": self.text, "band_pct": list(self.band_pct), "first_mfu_pct": self.first_mfu_pct,
                "others_mfu_pct": self.others_mfu_pct}


def rank_by_mfu(facts: list[Facts], chosen: list[Evaluation], same: list[list[Evaluation]]
                ) -> tuple[list[Evaluation], list[list[Evaluation]], Ranking | None]:
    """Readings that fit the logs equally, ranked by the MFU each implies (TYPICAL_MFU): the most typical
    first; the others stay as ambiguous only where they are as typical. Returns (chosen, the rest, why
    the first ranks first: None where the MFU could not tell them apart or is not known)."""
    cands = [chosen] + same
    dist = [atypical(evs, facts) for evs in cands]
    if not same or any(d is None for d in dist):
        return chosen, same, None
    order = sorted(range(len(cands)), key=lambda i: dist[i])
    first, best = cands[order[0]], dist[order[0]]
    tied = [cands[i] for i in order[1:] if dist[i] <= best + TYPICAL_MARGIN]
    if len(tied) == len(same):
        return chosen, same, None
    lower = [cands[i] for i in order[1:] if dist[i] > best + TYPICAL_MARGIN]
    mfu = lambda evs: {f.label: round(100 * e.dense_share, 2) for e, f in zip(evs, facts)}
    implies = lambda evs: " and ".join(f"{v:.1f}% ({k})" for k, v in mfu(evs).items())
    los, his = zip(*(typical_band(f) for f in facts))
    band = (100 * max(los), 100 * min(his))
    compiled = {f.log.config.get("compile") for f in facts}
    kind = {True: "compiled ", False: "eager "}.get(compiled.pop(), "") if len(compiled) == 1 else ""
    text = (f"the reading ranked first [{describe_reading(first, facts)}] implies {implies(first)} MFU on the dense "
            f"bf16 peak, {'within' if best == 0 else 'nearest to'} the {band[0]:.0f}-{band[1]:.0f}% that {kind}"
            f"training runs reach; of the {len(cands)} readings that fit the logs equally, "
            + ("the other" if len(lower) == 1 else "the others") + " "
            + ", ".join(f"[{describe_reading(evs, facts)}] implies {implies(evs)}" for evs in lower))
    return first, tied, Ranking(text, band, mfu(first), [mfu(evs) for evs in lower])


def describe_reading(evs: list[Evaluation], facts: list[Facts]) -> str:
    """A reading of several logs in words: per log its misreports (or 'as logged') and micro-steps."""
    return "; ".join(f"{f.label}: {', '.join(e.misreports()) or 'as logged'}, {e.micro_steps} micro-step"
                     f"{'s' if e.micro_steps != 1 else ''} per GPU" for e, f in zip(evs, facts))


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.4g}"


def describe(m: list[str]) -> str:
    return "; ".join(MISREPORTS[k][0] for k in m) if m else "the log means what it says"


def why(f: Facts, e: Evaluation, printed: Evaluation | None) -> str:
    agree = [i.name for i in e.items if i.agrees]
    reject = [f"{i.name} ({_fmt(i.logged)} logged, {_fmt(i.predicted)} expected)" for i in e.items if not i.agrees]
    conv = e.conventions.misreports(f.world)
    parts = [f"{e.micro_steps} micro-step{'s' if e.micro_steps > 1 else ''} per GPU per step"
             + (f" (printed {f.accum})" if e.micro_steps != f.accum else "") + (f"; {describe(conv)}" if conv else "")]
    if agree:
        parts.append("agrees: " + ", ".join(dict.fromkeys(agree)))
    if reject:
        parts.append("does not agree: " + ", ".join(reject))
    if printed is not None and printed is not e and not printed.possible and printed.dense_share:
        parts.append(f"as printed the run would need {printed.dense_share:.1f}x the {f.gpu}'s dense bf16 peak "
                     f"({f.peak_dense:g} TFLOP/s): impossible")
    if e.plausibility == "impossible":
        parts.append(f"no reading is physically possible: this one needs {e.dense_share:.1f}x the dense peak")
    elif e.plausibility == "suspect":
        parts.append(f"suspect: {100 * e.dense_share:.1f}% of the dense peak")
    if not f.step_s:
        parts.append("no time per iteration: step time derived from the logged rate")
    return "; ".join(parts) + "."


def reading_of(f: Facts, e: Evaluation, others: list[Evaluation], tol: float, suspect_share: float) -> RunReading:
    """One log's reconstruction under evaluation `e`; `others`: the other readings that fit it as well."""
    printed = evaluate(f, Conventions(), f.accum, tol, suspect_share)
    mfu = 100 * e.per_gpu * f.flops_dense / (f.peak_dense * 1e12) if f.peak_dense and f.flops_dense else None
    step_ms = 1000 * (f.step_s or f.local_batch * e.micro_steps * f.seq_len / e.per_gpu)
    amb = [f"{', '.join(a.misreports()) or 'as logged'}: {a.micro_steps} micro-steps per GPU, "
           f"{a.per_gpu:,.0f} tokens/s per GPU" for a in others]
    return RunReading(
        f.label, str(f.log.path), f.log.source, f.world, e.misreports(), e.micro_steps, f.accum, e.per_gpu, mfu,
        step_ms, "logged" if f.step_s else "derived from the logged rate", e.plausibility, e.dense_share,
        printed.dense_share if printed else None, why(f, e, printed), e.items, f.gpu, f.peak_dense,
        f.flops_dense, f.flops_basis, amb, dict(f.log.overrides), list(f.log.notes), f.steady_entries,
        f.only_warmup)


def fixes_of(runs: list[RunReading]) -> list[str]:
    """What to fix in the logger(s): one sentence per misreport found, naming the formats when several."""
    sources = {r.source for r in runs}
    found = {m: [r.source for r in runs if m in r.reading] for m in MISREPORTS}
    return [MISREPORTS[m][1] + (f" ({', '.join(dict.fromkeys(where))} logs)" if len(sources) > 1 else "")
            for m, where in found.items() if where]


HARDWARE_FLAG, MODEL_FLAG, ACCUM_FLAG = "--hardware GPU", "--model NAME/FLAVOR", "--accum A"


def settlers(facts: list[Facts], chosen: list[Evaluation], same: list[list[Evaluation]]) -> tuple[list[str], list[str]]:
    """What would tell equally fitting readings apart: the flags that let a check run (the GPU and model
    let the MFU each implies rank them; the accumulation, once given, is not in question), and what a
    log would need to show."""
    flags = [flag for flag, missing in ((HARDWARE_FLAG, any(not f.peak_dense for f in facts)),
                                        (MODEL_FLAG, any(not f.flops for f in facts)),
                                        (ACCUM_FLAG, any(not f.accum_given and any(alt[j].micro_steps != e.micro_steps
                                                                                   for alt in same)
                                                         for j, (f, e) in enumerate(zip(facts, chosen)))))
             if missing]
    logs = [what for what, missing in (("a time per step", any(not f.step_s for f in facts)),
                                       ("the effective batch or the tokens seen",
                                        any(not {"global_batch_size", "tokens_seen_per_step"} & set(f.printed)
                                            for f in facts)))
            if missing]
    return flags, logs


def reconstruct(logs: list[LoggedRun], labels: list[str], scopes: list[str], tol: float = 0.03,
                suspect_share: float = 0.05) -> Reconstruction:
    """Choose a reading per log (argument order kept); logs of one format share its conventions. Readings
    that fit as well are ranked by the MFU they imply where the GPU and model are known; those still
    tied are kept as alternatives, with what would settle them."""
    facts = [gather(log, label, scope) for log, label, scope in zip(logs, labels, scopes)]
    chosen: dict[int, Evaluation] = {}
    others: dict[int, list[Evaluation]] = {}
    groups, ranking, flags, needs = [], [], [], []
    for source in dict.fromkeys(log.source for log in logs):
        idx = [i for i, log in enumerate(logs) if log.source == source]
        group = [facts[i] for i in idx]
        evs, same = choose(group, tol, suspect_share)
        evs, same, why_first = rank_by_mfu(group, evs, same)
        ranking += [why_first] if why_first else []
        distinct: dict[tuple, list[Evaluation]] = {}  # one per different answer, the fewest misreports first
        for alt in sorted(same, key=lambda a: sum(len(e.misreports()) for e in a)):
            distinct.setdefault(tuple((e.micro_steps, round(e.per_gpu, -1)) for e in alt), alt)
        same = list(distinct.values())[:3]
        if same:
            f_, l_ = settlers(group, evs, same)
            flags, needs = flags + f_, needs + l_
        groups.append((idx, same))
        for j, i in enumerate(idx):
            chosen[i] = evs[j]
            alts: dict[tuple, Evaluation] = {}
            for alt in (a[j] for a in same):
                if alt.micro_steps != evs[j].micro_steps or abs(alt.per_gpu - evs[j].per_gpu) > tol * evs[j].per_gpu:
                    alts.setdefault((alt.micro_steps, round(alt.per_gpu, -1)), alt)
            others[i] = list(alts.values())
    runs = [reading_of(f, chosen[i], others[i], tol, suspect_share) for i, f in enumerate(facts)]
    alternatives = []
    for idx, same in groups:
        for alt in same:
            evs = dict(chosen) | {i: alt[j] for j, i in enumerate(idx)}
            alt_runs = [reading_of(f, evs[i], [], tol, suspect_share) for i, f in enumerate(facts)]
            alternatives.append(Reconstruction(alt_runs, fixes_of(alt_runs)))
    return Reconstruction(runs, fixes_of(runs), alternatives, ranking, list(dict.fromkeys(flags)),
                          list(dict.fromkeys(needs)))

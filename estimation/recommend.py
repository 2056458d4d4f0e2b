"""`python -m estimation --estimate.recommend`: what to run for a target global batch.

For a model, a GPU, a GPU count and a target global batch (estimate.target_tokens, or
training.global_batch_size sequences) it searches local batch x accumulation, activation
checkpointing, data-parallel mode, float8, bf16 parameters / moments and CUDA graphs where the mode
allows them, prints the best predicted configurations that fit and writes the best as a TOML that
`--job.config_file` loads.

Memory is near-linear in the local batch within one configuration class (everything but the batch
fixed), so each class is measured by two fake steps (local batch 1 and 2, two micro-steps each, which
shows the peak with and without held gradients) and its peak and work are interpolated to every
local batch that divides the per-GPU share of the target. The best candidates are then verified with
a fake step at their own batch before they are printed.

Activation checkpointing trades recomputation for memory. Accumulation reaches any target batch
from local batch 1, but each micro-step repeats the parameter gathers and per-step kernels that a
larger micro-batch shares (LLaMA-3.1-8B under fsdp on 2 x H200 ran 1.06x faster at local batch 2
with selective checkpointing than at local batch 1 without). So a class is measured again with the
next level of checkpointing where without it no local batch fits, or where its own prediction at a
local batch that does not fit beats its best that does by more than `AC_WORTH`
(checkpointing only adds work, so that is the most it could gain); it is offered only at the
batches the class, verified, cannot hold with less.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
import sys
import time

from titanlite.config import ConfigError, load_config, to_toml
from titanlite.config.manager import check_combination, set_key
from titanlite.models import get_model_args
from titanlite.optim import fitting_warmup
from titanlite.parallel.modes import MODES

from estimation import DoesNotFit
from estimation.estimate import GIB, _Fits, check_nodes, floor_bytes, headroom, size, usable_bytes, what_could_fit
from estimation.hardware import GPUS_PER_NODE, auto_attention, get_hardware, gpus_per_node, launch_on_nodes
from estimation.throughput import assumptions, predict
from estimation.tracker import PhaseWork

# The numerics trade-off of each opt-in setting, in one phrase (docs/performance.md has the runs).
TRADE_OFFS = {
    "float8": "float8 matmuls in the blocks (tensorwise scales): lower-precision GEMMs, watch the loss",
    "autocast": "autocast over fp32 weights instead of the default's bf16 copies: weight gradients rounded "
                "to bf16 each micro-step",
    "bf16_moments": "bf16 AdamW moments (beta2 <= 0.99): 200-step runs inside autocast's range",
    "ac": "recomputes activations in backward: same numerics, more compute",
    "cuda_graphs": "replays the captured step: same numerics",
}
AC_CHOICES = ("none", "selective", "full")
# the least gain over a class's best fitting batch, bounded by its own prediction at a batch that does not fit,
# worth measuring the class again with the next level of activation checkpointing
AC_WORTH = 0.01


@dataclasses.dataclass(frozen=True)
class Knobs:
    """One configuration class: everything but the local batch and accumulation."""
    mode: str
    ac: str
    float8: bool
    bf16_params: bool
    bf16_moments: bool

    def settings(self) -> dict:
        """The config keys this class sets (with one GPU the mode is not a setting)."""
        out = {"activation_checkpoint.mode": self.ac, "float8.enable": self.float8,
               "training.bf16_params": self.bf16_params,
               "optimizer.moments_dtype": "bfloat16" if self.bf16_moments else "float32"}
        if self.mode != "none":
            out["parallelism.data_parallel"] = self.mode
        return out

    @property
    def autocast(self) -> bool:
        """Autocast where the mode would take the default bf16 copies (fsdp/hsdp get bf16 from FSDP)."""
        return not self.bf16_params and MODES[self.mode].bf16_params == "copies"

    def label(self) -> str:
        parts = [self.mode, f"AC {self.ac}" if self.ac != "none" else ""]
        parts += ["float8" if self.float8 else "", "autocast" if self.autocast else "",
                  "bf16 moments" if self.bf16_moments else ""]
        return ", ".join(p for p in parts if p)


@dataclasses.dataclass
class Candidate:
    knobs: Knobs
    local: int
    accum: int
    cuda_graphs: bool
    peak_bytes: float
    tokens_per_sec_per_gpu: float
    mfu_pct: float
    dominant: str
    verified: bool = False

    def trade_offs(self) -> list[str]:
        k = self.knobs
        keys = [n for n, on in (("float8", k.float8), ("autocast", k.autocast), ("bf16_moments", k.bf16_moments),
                                ("ac", k.ac != "none"), ("cuda_graphs", self.cuda_graphs)) if on]
        return [TRADE_OFFS[n] for n in keys]


def target_sequences(cfg) -> int:
    est, seq = cfg.estimate, cfg.training.seq_len
    if est.target_tokens:
        if est.target_tokens % seq:
            raise ConfigError(f"estimate.target_tokens ({est.target_tokens:,}) is not a whole number of sequences of "
                              f"training.seq_len {seq}")
        return est.target_tokens // seq
    if cfg.training.global_batch_size > 0:
        return cfg.training.global_batch_size
    raise ConfigError("estimate.recommend needs a target global batch: set estimate.target_tokens or "
                      "training.global_batch_size")


def classes(cfg, world: int, hw) -> list[Knobs]:
    """Every class the GPU and the mode records allow, without activation checkpointing first."""
    node = gpus_per_node(cfg.estimate)  # hsdp: sharded inside a node, replicated across whole nodes
    modes = ["none"] if world == 1 else ["ddp", "zero1", "fsdp"] + (["hsdp"] if world > node and not world % node else [])
    out = []
    opt_in = cfg.estimate.recommend_opt_in
    for mode, f8, (bf16p, bf16m) in itertools.product(
            modes, (False, True) if hw.capability >= 9 and opt_in else (False,),
            ((False, False), (True, False)) + (((True, True),) if opt_in else ())):
        refuses = MODES[mode].refuses
        if (bf16p and MODES[mode].bf16_params != "copies") or (bf16m and "optimizer.moments_dtype=bfloat16" in refuses):
            continue  # fsdp/hsdp take bf16 from FSDP's policy: bf16_params would be the same class again
        out.append(Knobs(mode, "none", f8, bf16p, bf16m))
    return out


def _config(cfg, knobs: Knobs, local: int, accum: int, world: int, cuda_graphs: bool = False):
    """The training config of a candidate: the user's, with the searched settings applied through the
    config's own setter and checks."""
    c = copy.deepcopy(cfg)
    for key, value in {**knobs.settings(), "parallelism.data_parallel": knobs.mode, "training.local_batch_size": local,
                       "training.global_batch_size": local * accum * world, "training.cuda_graphs": cuda_graphs}.items():
        set_key(c, key, value)
    c.estimate.recommend = False
    check_combination(c, world, launch_on_nodes(c.estimate, world).ranks_per_host)  # hsdp: sharded inside a node
    return c


def _interp(w1: PhaseWork, w2: PhaseWork, b: int) -> PhaseWork:
    """A phase's work at local batch b, on the line through its work at batches 1 and 2."""
    out = PhaseWork(collectives=w2.collectives)
    for f in ("matmul_flops", "float8_flops", "attention_flops", "memory_bytes", "fused_bytes"):
        v1, v2 = getattr(w1, f), getattr(w2, f)
        setattr(out, f, max(0.0, v1 + (v2 - v1) * (b - 1)))
    out.ops = w2.ops
    return out


def _peak_on_line(r1, r2, b: int, accum: int) -> float:
    """A class's peak at local batch b, on the line through its fake steps at batches 1 and 2 (two
    micro-steps each): with the gradients they hold between micro-steps where accum > 1, without them
    where the batch is one micro-step."""
    p1, p2 = (r1.peak_bytes, r2.peak_bytes) if accum > 1 else (r1.peak_without_accumulation(),
                                                               r2.peak_without_accumulation())
    return p1 + (p2 - p1) * (b - 1)


def _progress(msg: str) -> None:
    print(f"[recommend] {msg}", file=sys.stderr, flush=True)


def recommend(cfg, progress=_progress) -> dict:
    from estimation.fake_run import FakeRun

    t0 = time.perf_counter()
    est = cfg.estimate
    hw = get_hardware(est.hardware)
    world = est.ngpu
    check_nodes(est, world)
    seqs = target_sequences(cfg)
    if seqs % world:
        raise ConfigError(f"a global batch of {seqs} sequences cannot be split evenly over {world} GPUs")
    per_rank = seqs // world
    seq = cfg.training.seq_len
    args = get_model_args(cfg.model.name, cfg.model.flavor, cfg.model.vocab_size)
    attention = auto_attention(hw) if cfg.model.attention_backend == "auto" else cfg.model.attention_backend
    usable = usable_bytes(est, hw, world)
    locals_ = [b for b in range(1, per_rank + 1) if per_rank % b == 0]
    flops_per_token = args.flops_per_token(seq)
    budget = lambda mode, n=world: _Fits(usable_bytes(est, hw, n), headroom(est.fragmentation, mode),
                                         keep_headroom=True).budget
    # a class whose model state and one sequence's block inputs exceed the budget is never built
    todo = [k for k in classes(cfg, world, hw)
            if floor_bytes(args, seq, k.mode, world, k.bf16_moments) <= budget(k.mode)]
    if not todo:
        least, k = min(((floor_bytes(args, seq, k.mode, world, k.bf16_moments), k) for k in classes(cfg, world, hw)),
                       key=lambda fk: fk[0])
        raise DoesNotFit(
            f"{cfg.model.name}/{cfg.model.flavor} cannot fit on {world} x {est.hardware} in any configuration: its "
            f"model state and one sequence's block inputs take at least {size(least)} per GPU ({k.label()}), "
            f"over the {size(budget(k.mode))} usable; what could: "
            f"{what_could_fit(cfg, args, world, lambda n: budget('fsdp', n))}")
    # each class is measured without checkpointing, then with the next level where a batch it cannot hold might pay
    most = len(todo) * len(AC_CHOICES)
    progress(f"{cfg.model.name}/{cfg.model.flavor} on {world} x {est.hardware}, {seqs} sequences of {seq} tokens "
             f"({per_rank} per GPU): {len(todo)} configuration classes, each measured by 2 fake steps without "
             f"activation checkpointing and again with it where a local batch that does not fit might be faster "
             f"(at most {most} measurements)")

    candidates: list[Candidate] = []
    measured = 0
    while todo:
        knobs = todo.pop(0)
        fits = _Fits(usable, headroom(est.fragmentation, knobs.mode), keep_headroom=True)
        c1 = _config(cfg, knobs, 1, per_rank, world)
        run = FakeRun(c1, world, attention, int(hw.memory_gib * GIB))
        try:
            r1, r2 = run.step(1, micro_steps=2), run.step(2, micro_steps=2) if per_rank > 1 else None
        finally:
            run.close()
        measured += 1
        one = r1.peak_without_accumulation() if per_rank == 1 else r1.peak_bytes
        progress(f"{knobs.label()}: peak at local batch 1 {one / GIB:.2f} GiB "
                 f"[{measured} of at most {most} measurements, {time.perf_counter() - t0:.0f}s]")
        a = assumptions(est, hw, world, attention, seq_len=cfg.training.seq_len)
        graphs_ok = "training.cuda_graphs" not in MODES[knobs.mode].refuses
        best_fitting = best_not_fitting = 0.0
        for b in locals_:  # the whole share in one micro-step may fit where local 1 with accumulation does not
            accum = per_rank // b
            if r2 is None:
                peak, work = one, r1.work
            else:
                peak = _peak_on_line(r1, r2, b, accum)
                work = {ph: _interp(r1.work[ph], r2.work[ph], b) for ph in r2.work if ph in r1.work}
            tokens = b * accum * world * seq
            p = predict(work, a, accum, tokens, flops_per_token, world)["overlap"]
            graphs = False
            if graphs_ok:  # a captured step launches no kernels from the host: worth it only where that binds
                g = predict(work, a.replayed(), accum, tokens, flops_per_token, world)["overlap"]
                graphs = g["tokens_per_sec_per_gpu"] > 1.01 * p["tokens_per_sec_per_gpu"]
                p = g if graphs else p
            if not fits(peak):
                best_not_fitting = max(best_not_fitting, p["tokens_per_sec_per_gpu"])
                continue
            best_fitting = max(best_fitting, p["tokens_per_sec_per_gpu"])
            candidates.append(Candidate(knobs, b, accum, graphs, peak, p["tokens_per_sec_per_gpu"], p["mfu_pct"], ""))
        if knobs.ac != "full" and best_not_fitting > (1 + AC_WORTH) * best_fitting:  # also where nothing fits
            todo.insert(0, dataclasses.replace(knobs, ac=AC_CHOICES[AC_CHOICES.index(knobs.ac) + 1]))
    if not candidates:
        raise DoesNotFit(f"{cfg.model.name}/{cfg.model.flavor} fits no configuration on {world} x {est.hardware} at "
                         f"seq_len {seq}, even at local batch 1 with full activation checkpointing; what could: "
                         f"{what_could_fit(cfg, args, world, lambda n: budget('fsdp', n))}")
    candidates.sort(key=lambda c: -c.tokens_per_sec_per_gpu)
    best = _verify(cfg, candidates, world, usable, hw, attention, est.recommend_top, progress)
    return {"target_sequences": seqs, "seq_len": seq, "ngpu": world, "hardware": est.hardware,
            "classes_measured": measured, "best": best, "elapsed_s": round(time.perf_counter() - t0, 1)}


def _verify(cfg, candidates, world, usable, hw, attention, top, progress) -> list[Candidate]:
    """Re-measure the leading candidates at their own batch (one fake step each; one fake run per
    class) and keep those that still fit, with their measured peak and throughput, until `top` are
    verified."""
    from estimation.fake_run import FakeRun

    est, seq = cfg.estimate, cfg.training.seq_len
    flops_per_token = get_model_args(cfg.model.name, cfg.model.flavor, cfg.model.vocab_size).flops_per_token(seq)

    def held_with_less(c, verified) -> bool:
        """Its batch is verified with less checkpointing: the same step, less recomputed."""
        kept = {(d.knobs, d.local) for d in verified}
        return any((dataclasses.replace(c.knobs, ac=less), c.local) in kept
                   for less in AC_CHOICES[:AC_CHOICES.index(c.knobs.ac)])

    out, pending = [], list(candidates)
    while pending and len(out) < top:
        pending = [c for c in pending if not held_with_less(c, out)]
        batch = pending[:top - len(out)]  # the next best, verified class by class
        pending = pending[len(batch):]
        for knobs in dict.fromkeys(c.knobs for c in batch):
            group = [c for c in batch if c.knobs == knobs]
            run = FakeRun(_config(cfg, knobs, group[0].local, group[0].accum, world), world, attention,
                          int(hw.memory_gib * GIB))
            try:
                measured = [(c, run.step(c.local, micro_steps=2 if c.accum > 1 else 1)) for c in group]
            finally:
                run.close()
            fits = _Fits(usable, headroom(est.fragmentation, knobs.mode), keep_headroom=True)
            a = assumptions(est, hw, world, attention, seq_len=cfg.training.seq_len)
            for c, r in measured:
                ok = fits(r.peak_bytes)
                progress(f"verify {knobs.label()} local {c.local} x accum {c.accum}: peak {r.peak_bytes / GIB:.2f} GiB "
                         f"({'fits' if ok else 'does not fit'})")
                if not ok:
                    continue
                p = predict(r.work, a.replayed(c.cuda_graphs), c.accum,
                            c.local * c.accum * world * seq, flops_per_token, world)
                c.peak_bytes, c.verified, c.dominant = r.peak_bytes, True, p["dominant"]
                c.tokens_per_sec_per_gpu, c.mfu_pct = p["overlap"]["tokens_per_sec_per_gpu"], p["overlap"]["mfu_pct"]
                out.append(c)
        out = [c for c in out if not held_with_less(c, out)]
    out.sort(key=lambda c: -c.tokens_per_sec_per_gpu)
    return out[:top]


def format_table(r: dict) -> str:
    lines = [f"best predicted configurations for {r['target_sequences']} x {r['seq_len']} tokens per step on "
             f"{r['ngpu']} x {r['hardware']} ({r['classes_measured']} classes measured, {r['elapsed_s']} s):",
             f"  {'#':<2} {'configuration':<44} {'local x accum':>13} {'graphs':>6} {'peak GiB':>9} "
             f"{'tok/s/GPU':>10} {'MFU %':>6}"]
    for i, c in enumerate(r["best"], 1):
        lines.append(f"  {i:<2} {c.knobs.label():<44} {f'{c.local} x {c.accum}':>13} {'yes' if c.cuda_graphs else 'no':>6} "
                     f"{c.peak_bytes / GIB:>9.2f} {c.tokens_per_sec_per_gpu:>10,.0f} {c.mfu_pct:>6.1f}")
        for t in c.trade_offs():
            lines.append(f"     - {t}")
    return "\n".join(lines)


def launch_line(world: int, path: str, node: int = GPUS_PER_NODE) -> str:
    """How to run the written file: run_train.sh (config check, allocator setting) with its processes,
    on nodes of `node` GPUs; several nodes through the SLURM batch script, or run_train.sh on each."""
    nodes = -(-world // node)
    if world == 1:
        return f"./run_train.sh --job.config_file {path}"
    if nodes == 1:
        return f"NGPU={world} ./run_train.sh --job.config_file {path}"
    rdzv = f'TORCHRUN_ARGS="--nnodes {nodes} --node-rank R --rdzv-backend c10d --rdzv-endpoint HOST:29500"'
    return (f"sbatch --nodes {nodes} --gpus-per-node {world // nodes} scripts/slurm/train.sbatch --job.config_file "
            f"{path}; without SLURM, on each node: NGPU={world // nodes} {rdzv} ./run_train.sh --job.config_file {path}")


def write_toml(cfg, c: Candidate, world: int, path: str) -> str:
    best = _config(cfg, c.knobs, c.local, c.accum, world, c.cuda_graphs)
    s, steps = best.lr_scheduler, best.training.steps
    s.warmup_steps = fitting_warmup(s.warmup_steps, steps)  # the lr peaks within the run, then decays
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    header = (f"# Recommended by python -m estimation --estimate.recommend for {world} x {cfg.estimate.hardware}: "
              f"{c.knobs.label()}, local batch {c.local} x accumulation {c.accum}"
              + (", CUDA graphs" if c.cuda_graphs else "") + "\n"
              + f"# predicted: peak {c.peak_bytes / GIB:.2f} GiB, {c.tokens_per_sec_per_gpu:,.0f} tokens/s per GPU, "
                f"MFU {c.mfu_pct:.1f}%\n"
              + "".join(f"# {t}\n" for t in c.trade_offs())
              + f"# schedule: warm-up {s.warmup_steps} of {steps} steps, then {s.decay_type} decay to "
                f"{s.min_lr_factor:g} x the peak lr\n"
              + f"# launch: {launch_line(world, path, gpus_per_node(cfg.estimate))}\n")
    # every setting written out, so the file says what runs; a config file does not name another one
    body = "\n".join(line for line in to_toml(best).splitlines() if not line.startswith("config_file ="))
    with open(path + ".tmp", "w") as fh:
        fh.write(header + "\n" + body + "\n")
    os.replace(path + ".tmp", path)
    load_config(["--job.config_file", path])  # it must load as written
    return path


def main(cfg) -> None:
    r = recommend(cfg)
    print(format_table(r))
    path = write_toml(cfg, r["best"][0], cfg.estimate.ngpu,
                      cfg.estimate.recommend_output or os.path.join(cfg.job.dump_folder, "recommended.toml"))
    print(f"best: {path}")

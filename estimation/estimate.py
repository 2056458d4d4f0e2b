"""The dry run: memory at the configured batch, the largest batch that fits, and the throughput model."""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

from titanlite.config import ConfigError, data_parallel_mode, resolve_batch, to_dict
from titanlite.config.manager import check_combination
from titanlite.models import MODEL_REGISTRY, get_model_args
from titanlite.parallel.modes import MODES
from titanlite.models.args import FLOPS_CONVENTION

from estimation import DoesNotFit, EstimateWarning
from estimation.fake_run import FakeRun, StepResult
from estimation.hardware import auto_attention, get_hardware, gpus_per_node, launch_on_nodes
from estimation.throughput import assumptions, predict

GIB = 2**30


def _progress(msg: str) -> None:
    print(f"[estimate] {msg}", file=sys.stderr, flush=True)


def largest_batch(peak_of, fits, start: int, limit: int) -> int:
    """Largest local batch in [1, limit] whose fake step fits (0 if none), probing as few as possible.

    Peak memory grows almost linearly with the batch, so each probe aims where the line through the
    two nearest probes crosses the limit; the answer is always bracketed by a probe that fits and
    one that does not (or the limit), and a probe aimed at a bracket end falls back to bisection.
    """
    probes: dict[int, int] = {}

    def probe(b):
        if b not in probes:
            probes[b] = peak_of(b)
        return probes[b]

    lo, hi = 0, limit + 1  # lo fits (0: nothing yet), hi does not (limit + 1: not probed)
    b = start
    while True:
        if fits(probe(b)):
            lo = b
        else:
            hi = b
        if hi - lo <= 1:
            return lo
        b = min(max(_aim(probes, lo, fits.budget), lo + 1), hi - 1)
        if b in probes:
            b = (lo + hi) // 2


def _aim(probes: dict[int, int], lo: int, budget: float) -> int:
    """Batch where the line through the two probes nearest the fitting end reaches the budget."""
    if len(probes) < 2:
        return 2 * lo if lo else 1
    (b0, p0), (b1, p1) = sorted(probes.items(), key=lambda bp: abs(bp[0] - lo))[:2]
    slope = (p1 - p0) / (b1 - b0)
    return b0 + int((budget - p0) // slope) if slope > 0 else 2 * max(lo, 1)


def batch_for_global(measure, fits, global_batch: int, world: int, largest: int, progress) -> dict:
    """{local batch: StepResult} of the local batches at most `largest` (the search's answer) that divide
    `global_batch` over `world` ranks, measured from the largest down until one fits, each by
    `measure(batch, micro_steps)` at its own accumulation (two micro-steps where it accumulates). The
    search's probes ran with the configured batch's micro-steps, and a batch that accumulates holds the
    first micro-step's gradients through the second (fp32, 4 bytes a parameter: more than 4 GiB for a
    1B model), which a probe without accumulation does not show."""
    out = {}
    for b in range(min(largest, global_batch // world), 0, -1):
        if global_batch % (b * world):
            continue
        accum = global_batch // (b * world)
        r = out[b] = measure(b, 2 if accum > 1 else 1)
        progress(f"local batch {b} x accumulation {accum}: peak {r.peak_bytes / GIB:.2f} GiB "
                 f"({'fits' if fits(r.peak_bytes) else 'does not fit'})")
        if fits(r.peak_bytes):
            break
    return out


def headroom(configured: float, mode: str) -> float:
    """estimate.fragmentation, or (-1) the measured headroom of this data-parallel mode."""
    return MODES[mode].headroom if configured < 0 else configured


# Memory outside the allocator's tensors, mostly the CUDA context (about half a GiB): on 1 x H100 with
# torch 2.11 a step of 78.28 GiB max allocated ran on the 79.19 GiB GPU, so it is at most 0.91 GiB there.
RESERVED_ONE_GPU_GIB = 0.6
# More outside the allocator with several ranks (NCCL, and whatever else a multi-GPU job holds there): on H200
# nvidia-smi's used memory less the peak reserved was 2.53 GiB with 2 ranks under fsdp (LLaMA-3.1-8B, three runs), so
# the one-GPU figure above plus this (benchmarks/results/2026-11-29_2xh200_8b-local-batch-selective.md, call 5).
RESERVED_NCCL_GIB = 1.95


def usable_bytes(est, hw, world: int) -> float:
    """The GPU's memory less estimate.reserved_gib, or (-1) less the reserve above for this many ranks."""
    reserved = est.reserved_gib if est.reserved_gib >= 0 else (
        RESERVED_ONE_GPU_GIB + (RESERVED_NCCL_GIB if world > 1 else 0.0))
    return (hw.memory_gib - reserved) * GIB


class _Fits:
    """A peak fits when it is at most the usable memory: before it reports out of memory the caching
    allocator releases its cache and retries, so the headroom it keeps over allocated memory at ease
    (the mode's measured reserved / allocated) is not needed to run. A peak inside that headroom runs
    with cache releases, which can slow the step: `comfortable` is the budget that avoids them, and with
    keep_headroom (the recommender) the budget itself."""

    def __init__(self, usable_bytes: float, fragmentation: float, keep_headroom: bool = False):
        self.fragmentation = fragmentation
        self.comfortable = usable_bytes / (1 + fragmentation)
        self.budget = self.comfortable if keep_headroom else usable_bytes  # largest peak that fits

    def __call__(self, peak: int) -> bool:
        return peak <= self.budget

    def tight(self, peak: int) -> bool:
        """Fits, but only by using the allocator's headroom."""
        return self.comfortable < peak <= self.budget


def activation_floor(args, seq_len: int) -> int:
    """Bytes per sequence that every configuration keeps through the forward: each block's input,
    at two bytes an element (activation checkpointing keeps at least that). A batch whose floor alone
    exceeds the budget is never run: the search stays bounded and the answer comes at once."""
    return args.n_layers * seq_len * args.dim * 2


def size(nbytes: float) -> str:
    return f"{nbytes / GIB:,.1f} GiB" if nbytes >= GIB / 10 else f"{nbytes / 2**20:,.1f} MiB"


def model_state_floor(num_params: int, mode: str, world: int, bf16_moments: bool = False) -> int:
    """Bytes per rank the model state takes at the least in `mode`: fp32 parameters and fp32 gradients
    (a bf16 run keeps fp32 masters, and its weight gradients come out fp32) and AdamW's two moments,
    divided over the ranks where the mode shards them. bf16 copies, buffers and activations come on
    top, so a configuration whose floor exceeds the budget cannot fit whatever its batch."""
    m = MODES[mode]
    params_and_grads = 8 / world if m.shards_params else 8
    moments = (4 if bf16_moments else 8) / (world if m.optimizer != "local" else 1)
    return int(num_params * (params_and_grads + moments))


def floor_bytes(args, seq_len: int, mode: str, world: int, bf16_moments: bool = False) -> int:
    """The least a rank holds at local batch 1: its model state and one sequence's block inputs."""
    return model_state_floor(args.num_params(), mode, world, bf16_moments) + activation_floor(args, seq_len)


def what_could_fit(cfg, args, world: int, budget_of) -> str:
    """Advice for a configuration that cannot fit: only steps that change the answer. `budget_of(n)`:
    the bytes a rank may use with n GPUs. Where the model state alone exceeds the budget, neither
    checkpointing nor a shorter sequence helps: more GPUs with a sharded mode, or a smaller model."""
    seq, sharded = cfg.training.seq_len, "fsdp"
    moments = cfg.optimizer.moments_dtype == "bfloat16"
    here = model_state_floor(args.num_params(), data_parallel_mode(cfg, world), world, moments)
    out = []
    if world > 1 and not MODES[data_parallel_mode(cfg, world)].shards_params \
            and floor_bytes(args, seq, sharded, world) <= budget_of(world):
        out.append(f"parallelism.data_parallel={sharded} (shards the model state over the {world} GPUs)")
    if here + activation_floor(args, seq) <= budget_of(world):  # the state fits: activations are the problem
        if cfg.activation_checkpoint.mode != "full":
            out.append("activation_checkpoint.mode=full")
        out.append("a shorter training.seq_len")
    elif here < budget_of(world):  # the state fits, one sequence does not: the sequence length is the setting
        longest = int((budget_of(world) - here) // activation_floor(args, 1))
        out.append(f"training.seq_len {longest:,} or less (one sequence of {seq:,} tokens keeps "
                   f"{size(activation_floor(args, seq))} of block inputs through the forward, with any activation "
                   f"checkpointing, beside the model state's {size(here)})")
    n = next((n for n in (2 ** k for k in range(1, 11)) if n > world
              and floor_bytes(args, seq, sharded, n) <= budget_of(n)), None)
    if n:
        out.append(f"at least {n} GPUs with {sharded} (model state {size(model_state_floor(args.num_params(), sharded, n))} "
                   f"per GPU there)")
    # other flavors with this run's vocabulary (a tokenizer's size stays); never the flavor refused here
    name, mode, vocab = cfg.model.name, data_parallel_mode(cfg, world), cfg.model.vocab_size
    fits_here = lambda a: floor_bytes(a, seq, mode, world, moments) <= budget_of(world)
    others = {f: get_model_args(name, f, vocab) for f in MODEL_REGISTRY[name].flavors if f != cfg.model.flavor}
    smaller = [f for f, a in sorted(others.items(), key=lambda fa: -fa[1].num_params())
               if a.num_params() < args.num_params() and fits_here(a)]
    if smaller:
        out.append(f"a smaller model ({name}/{smaller[0]}" + (f" with model.vocab_size {vocab}" if vocab else "")
                   + " fits the same setup)")
    own = get_model_args(name, cfg.model.flavor)
    if vocab > own.vocab_size and fits_here(own):
        out.append(f"model.vocab_size {own.vocab_size} or less (the flavor's own; the model state then fits)")
    return "; ".join(out) if out else "nothing in titanlite's registry fits this GPU"


def check_nodes(est, world: int) -> None:
    """Refuse a layout of `world` GPUs over nodes that the GPUs per node do not divide: torchrun starts the
    same number of ranks on every node of a job, so such a layout cannot run."""
    node = gpus_per_node(est)
    if world > node and world % node:
        given = f"estimate.gpus_per_node {node}" if est.gpus_per_node else f"nodes of {node} GPUs (estimate.gpus_per_node 0)"
        raise ConfigError(f"estimate.ngpu {world} over {given}: {world // node} node(s) of {node} and one of {world % node}, "
                          f"where every node of a job runs the same number of ranks; set estimate.ngpu to a multiple of "
                          f"{node} or estimate.gpus_per_node to a divisor of {world}")


class RowwiseFloat8(EstimateWarning):
    """The throughput of float8's rowwise recipe is predicted high (docs/estimation.md, known limits)."""


ROWWISE_NOTE = ("float8.recipe rowwise: tokens/s predicted about 40% high. Its GEMMs hold the float8 rate, but its "
                "casts' generated kernels (scales along columns as well as rows) ran about 3x the time this model "
                "gives their traffic (LLaMA 1.36B, one H200; docs/estimation.md, known limits)")


def estimate(cfg, progress=_progress) -> dict:
    """Memory at the configured batch, the largest batch that fits, and (for a run that fits) the
    throughput model. `report["memory"]["fits"]` False: the configured run cannot exist, and the
    report holds no throughput. Raises ConfigError for a combination the trainer refuses at
    estimate.ngpu ranks, DoesNotFit where the batch search finds not even local batch 1 fits; any
    other error is a failed estimate."""
    t0 = time.perf_counter()
    est = cfg.estimate
    hw = get_hardware(est.hardware)
    world = est.ngpu
    check_nodes(est, world)
    # the run estimated is one of estimate.ngpu ranks, laid out on its nodes: refused as the trainer refuses it
    check_combination(cfg, world, launch_on_nodes(est, world).ranks_per_host)
    accum = resolve_batch(cfg, world)
    local = cfg.training.local_batch_size
    args = get_model_args(cfg.model.name, cfg.model.flavor, cfg.model.vocab_size)
    seq = cfg.training.seq_len
    attention = auto_attention(hw) if cfg.model.attention_backend == "auto" else cfg.model.attention_backend
    micro_steps = 2 if accum > 1 else 1  # two micro-steps show both the accumulating and the syncing one
    usable = usable_bytes(est, hw, world)
    mode = data_parallel_mode(cfg, world)
    fits = _Fits(usable, headroom(est.fragmentation, mode))
    floor = activation_floor(args, seq)
    state = model_state_floor(args.num_params(), mode, world, cfg.optimizer.moments_dtype == "bfloat16")
    bound = max(int((fits.budget - state) // floor), 0)  # no batch above this can fit
    limit = min(max(est.max_local_batch, local if local <= bound else 0), bound)
    if state > fits.budget:
        progress(f"does not fit: the model state alone takes at least {state / GIB:,.1f} GiB per rank ({mode}) of "
                 f"{fits.budget / GIB:.1f} GiB (not run)")
    elif local > bound:
        progress(f"local batch {local} does not fit: its blocks' inputs alone take {local * floor / GIB:,.1f} GiB "
                 f"of {fits.budget / GIB:.1f} GiB (not run)")

    results: dict[int, StepResult] = {}
    for_global: dict[int, StepResult] = {}  # local batches that divide the global batch, at their own accumulation
    largest = 0
    if limit >= 1 and (est.search or local <= bound):
        progress(f"building {cfg.model.name}/{cfg.model.flavor} on {world} fake rank(s), {mode}"
                 + (", compiled" if cfg.compile.enable else ""))
        run = FakeRun(cfg, world, attention, int(hw.memory_gib * GIB))
        try:
            def peak_of(b: int) -> int:
                results[b] = r = run.step(b, micro_steps)
                verdict = "tight" if fits.tight(r.peak_bytes) else "fits" if fits(r.peak_bytes) else "does not fit"
                progress(f"local batch {b}: peak {r.peak_bytes / GIB:.2f} GiB ({verdict}) "
                         f"[{time.perf_counter() - t0:.0f}s]")
                return r.peak_bytes

            if est.search:
                # a configured batch beyond the bound is not probed: start from the bottom instead. The
                # answer keeps clear of the allocator's headroom: at the edge of the GPU a tight batch runs
                # in one process and runs out of memory in the next (docs/estimation.md, the OOM search).
                clear = _Fits(usable, fits.fragmentation, keep_headroom=True)
                largest = largest_batch(peak_of, clear, local if local <= limit else 1, limit)
                if largest < limit and (largest + 1) not in results:
                    peak_of(largest + 1)  # the batch above: tight, or out of memory
                if cfg.training.global_batch_size != -1:  # a probe with the same micro-steps is the measurement
                    measure = lambda b, n: results[b] if b in results and n == micro_steps else run.step(b, n)
                    for_global = batch_for_global(measure, clear, cfg.training.global_batch_size, world, largest,
                                                  progress)
            elif fits(peak_of(local)):
                largest = local
        finally:
            run.close()
    # no batch fits: said as an error with what could fit, and so without a search where the state fits
    # and one sequence does not (the configured batch is not what to lower then, the sequence length is)
    too_long = state <= fits.budget < state + floor
    if (est.search or too_long) and largest == 0 and not any(fits(r.peak_bytes) for r in results.values()):
        r1 = results.get(1)
        need = (f"peak {r1.peak_bytes / GIB:.1f} GiB" if r1 else
                f"its model state alone {state / GIB:.1f} GiB" if state > fits.budget else
                f"its model state and one sequence's block inputs (training.seq_len {seq:,}) "
                f"{(state + floor) / GIB:,.1f} GiB")
        budget_of = lambda n: _Fits(usable_bytes(est, hw, n), headroom(est.fragmentation, "fsdp")).budget
        ac = cfg.activation_checkpoint.mode  # named where a fake step's peak says it: the floors hold for any
        with_ac = f" with activation_checkpoint.mode={ac}" if ac != "none" and r1 else ""
        where = f"{world} x {est.hardware}" + (f", {mode}" if world > 1 else "")  # "none" would read as an AC mode
        why = (f"{cfg.model.name}/{cfg.model.flavor} ({where}) does not fit even at local batch 1{with_ac}: {need} > "
               f"{usable / GIB:.2f} GiB usable of {hw.memory_gib} GiB")
        raise DoesNotFit(f"{why}; what could: {what_could_fit(cfg, args, world, budget_of)}", why=why)

    res = results.get(local)
    fits_configured = res is not None and fits(res.peak_bytes)
    tokens_per_step = local * world * accum * seq
    flops_per_token = args.flops_per_token(seq)
    a = assumptions(est, hw, world, attention, seq_len=seq).replayed(cfg.training.cuda_graphs)

    def rate(b: int, r: StepResult) -> float:
        """Predicted tokens/s per GPU of local batch b (fake step r) at the accumulation keeping the global batch."""
        n = cfg.training.global_batch_size // (b * world)
        return predict(r.work, a, n, b * world * n * seq, flops_per_token, world)["overlap"]["tokens_per_sec_per_gpu"]

    report = {
        "config": {
            "model": f"{cfg.model.name}/{cfg.model.flavor}", "params": args.num_params(), "ngpu": world,
            "hardware": est.hardware, "device_name": hw.device_name, "gpus_per_node": gpus_per_node(est),
            "inter_node_gbps": est.inter_node_gbps, "data_parallel": mode,
            "local_batch_size": local, "seq_len": seq, "gradient_accumulation_steps": accum,
            "global_batch_size": local * world * accum, "activation_checkpoint": cfg.activation_checkpoint.mode,
            "float8": cfg.float8.enable, "compile": cfg.compile.enable, "attention_backend": attention,
            "mixed_precision_param": cfg.training.mixed_precision_param,
            "bf16_params": cfg.training.bf16_params, "moments_dtype": cfg.optimizer.moments_dtype,
        },
        "memory": _memory(res, hw, usable, fits, local * floor + state),
        "batch_search": _search(results, largest, cfg, world, fits, for_global, rate) if est.search else None,
        "throughput": None,
        "notes": [
            "memory is per rank (rank 0); with compile.enable the compiled blocks keep what torch.compile's "
            "partitioner saves",
            "fake tensors run on CPU with CUDA's choices made explicit: bf16 autocast / FSDP bf16 params, "
            "fused AdamW, fused RMSNorm saved tensors outside compiled code, flash-style attention "
            "(output + logsumexp saved)",
        ],
        "resolved_config": to_dict(cfg),
    }
    if fits_configured:
        if cfg.float8.enable and cfg.float8.recipe == "rowwise":
            warnings.warn(RowwiseFloat8(ROWWISE_NOTE))
        report["throughput"] = {"flops_per_token": flops_per_token,
                                **predict(res.work, a, accum, tokens_per_step, flops_per_token, world)}
    report["elapsed_s"] = round(time.perf_counter() - t0, 1)
    return report


def _gib(d: dict) -> dict:
    return {k: round(v / GIB, 3) for k, v in d.items()}


def _memory(res: StepResult | None, hw, usable: float, fits, least_bytes: int) -> dict:
    """The configured batch's memory; None figures where it was not run (its floor alone is too large)."""
    if res is None:
        return {"peak_gib": None, "floor_gib": round(least_bytes / GIB, 3), "gpu_memory_gib": hw.memory_gib,
                "usable_gib": round(usable / GIB, 2), "allocator_headroom": fits.fragmentation, "fits": False}
    return {
        "peak_gib": round(res.peak_bytes / GIB, 3),
        "gpu_memory_gib": hw.memory_gib,
        "share_of_gpu_pct": round(100 * res.peak_bytes / (hw.memory_gib * GIB), 1),
        "usable_gib": round(usable / GIB, 2),
        "allocator_headroom": fits.fragmentation,
        "fits": fits(res.peak_bytes),
        "tight": fits.tight(res.peak_bytes),
        "at_peak_gib": _gib(res.breakdown),
        "model_state_gib": _gib(res.model_state),
    }


def _search(results: dict, largest: int, cfg, world: int, fits, for_global: dict, rate=None) -> dict:
    """The search's answers; `rate(b, step)`: the predicted tokens/s per GPU of the batch keeping the global batch."""
    gb = cfg.training.global_batch_size
    above = results.get(largest + 1)
    out = {"largest_local_batch": largest, "peak_gib_at_largest": round(results[largest].peak_bytes / GIB, 3)
           if largest else None,
           "tight_local_batch": largest + 1 if above is not None and fits.tight(above.peak_bytes) else None,
           "probes": [{"local_batch": b, "peak_gib": round(r.peak_bytes / GIB, 3), "fits": r.peak_bytes <= fits.comfortable,
                       "tight": fits.tight(r.peak_bytes)} for b, r in sorted(results.items())]}
    if gb == -1:
        out["global_batch_size"] = "local x ranks (no accumulation)"
        out["gradient_accumulation_steps"] = 1
    else:
        # The largest local batch that divides the configured global batch over the ranks and fits, clear
        # of the headroom, at its own accumulation (batch_for_global).
        b = next((b for b, r in for_global.items() if r.peak_bytes <= fits.comfortable), None)
        out["global_batch_size"] = gb
        out["local_batch_for_global"] = b
        out["gradient_accumulation_steps"] = gb // (b * world) if b else None
        out["peak_gib_for_global"] = round(for_global[b].peak_bytes / GIB, 3) if b else None
        out["tokens_per_sec_per_gpu_for_global"] = round(rate(b, for_global[b])) if b and rate else None
        out["probes_for_global"] = [{"local_batch": b, "gradient_accumulation_steps": gb // (b * world),
                                     "peak_gib": round(r.peak_bytes / GIB, 3), "fits": r.peak_bytes <= fits.comfortable}
                                    for b, r in for_global.items()]
    return out


def format_report(r: dict) -> str:
    c, m, t = r["config"], r["memory"], r["throughput"]
    lines = [
        f"{c['model']} ({c['params']:,} params) | {c['ngpu']} x {c['hardware']} ({c['device_name']}) | "
        f"{c['data_parallel']} | local batch {c['local_batch_size']} x seq {c['seq_len']} x accum "
        f"{c['gradient_accumulation_steps']} | AC {c['activation_checkpoint']} | float8 {c['float8']} | "
        f"compile {c['compile']}" + (" | bf16_params" if c.get("bf16_params") else "")
        + (f" | moments {c['moments_dtype']}" if c.get("moments_dtype", "float32") != "float32" else ""),
    ]
    if not m["fits"]:
        need = (f"peak {m['peak_gib']:.2f} GiB" if m["peak_gib"] is not None else
                f"at least {m['floor_gib']:,.1f} GiB (model state and blocks' inputs)")
        lines.append(f"DOES NOT FIT: local batch {c['local_batch_size']} needs {need} > {m['usable_gib']} GiB "
                     f"usable; no throughput for a run that cannot start")
    if m["peak_gib"] is not None:
        lines += ["", "memory per rank (GiB)      at peak   after backward"]
        for k in m["at_peak_gib"]:
            lines.append(f"  {k:<24} {m['at_peak_gib'][k]:>8.2f}   {m['model_state_gib'][k]:>8.2f}")
        lines.append(f"  {'peak':<24} {m['peak_gib']:>8.2f}   = {m['share_of_gpu_pct']}% of {m['gpu_memory_gib']} GiB "
                     f"({'fits' if m['fits'] else 'DOES NOT FIT'} in {m['usable_gib']} GiB usable"
                     + (f"; tight: inside the allocator's {m['allocator_headroom']:.0%} headroom, its cache is "
                        f"released and refilled during the step, which slows it, and it can run out of memory)"
                        if m.get("tight") else
                        f", with the allocator's {m['allocator_headroom']:.0%} headroom)"))
    s = r.get("batch_search")
    if s:
        probes = ", ".join(f"{p['local_batch']}{'' if p['fits'] else '~' if p.get('tight') else '!'}"
                           for p in s["probes"])
        head = (f"largest local batch that fits: {s['largest_local_batch']} (peak {s['peak_gib_at_largest']:.2f} GiB; "
                if s["largest_local_batch"] else "largest local batch that fits: none clear of the allocator's "
                                                 "headroom (")
        lines.append(f"{head}probes: {probes}; ~ tight, ! does not fit)")
        if s.get("tight_local_batch"):
            t_peak = next(p["peak_gib"] for p in s["probes"] if p["local_batch"] == s["tight_local_batch"])
            lines.append(f"local batch {s['tight_local_batch']} is tight ({t_peak:.2f} GiB, inside the allocator's "
                         f"{m['allocator_headroom']:.0%} headroom): it may run, slowed by cache releases, or run out "
                         f"of memory")
        if s.get("local_batch_for_global"):
            lines.append(f"global batch {s['global_batch_size']}: local batch {s['local_batch_for_global']} x "
                         f"{c['ngpu']} ranks x {s['gradient_accumulation_steps']} accumulation steps (peak "
                         f"{s['peak_gib_for_global']:.2f} GiB with its accumulation"
                         + (f", {s['tokens_per_sec_per_gpu_for_global']:,} tokens/s per GPU)"
                            if s.get("tokens_per_sec_per_gpu_for_global") else ")"))
        elif s["global_batch_size"] != "local x ranks (no accumulation)":
            lines.append(f"global batch {s['global_batch_size']}: " + (
                f"no local batch <= {s['largest_local_batch']} that divides it over {c['ngpu']} ranks fits with its "
                f"accumulation" if s["largest_local_batch"] else "no local batch fits clear of the allocator's headroom"))
    if t is None:
        return "\n".join(lines)
    a, w = t["assumptions"], t["work"]
    lines += [
        "",
        f"throughput: {t['flops_per_token'] / 1e9:.2f} GFLOP/token ({FLOPS_CONVENTION})",
        f"  {'':<12} {'step ms':>9} {'tokens/s':>11} {'tok/s/GPU':>10} {'MFU %':>6}",
    ]
    for k in ("overlap", "no_overlap"):
        v = t[k]
        lines.append(f"  {k:<12} {v['step_ms']:>9.1f} {v['tokens_per_sec']:>11,.0f} "
                     f"{v['tokens_per_sec_per_gpu']:>10,.0f} {v['mfu_pct']:>6.1f}")
    lines.append("  terms (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in t["terms_ms"].items())
                 + f" -> dominant: {t['dominant']}")
    lines.append(f"  work: GEMM {w['gemm_flops'] / 1e12:.1f} TFLOP"
                 + (f" + float8 {w['float8_flops'] / 1e12:.1f}" if w["float8_flops"] else "")
                 + f", attention {w['attention_flops'] / 1e12:.1f} TFLOP (causal), element-wise "
                 f"{w['elementwise_bytes'] / 1e9:.1f} GB + compiled kernels {w['fused_bytes'] / 1e9:.1f} GB, "
                 f"optimizer {w['optimizer_bytes'] / 1e9:.1f} GB, "
                 f"{w['kernels']:,.0f} kernels, link {w['comm_bytes'] / 1e9:.2f} GB")
    network = (f" inside a node of {a['gpus_per_node']}, across nodes {c['inter_node_gbps']:g} Gb/s per GPU"
               if c["ngpu"] > a["gpus_per_node"] else "")
    lines.append(f"  rates: GEMM {a['gemm_efficiency']:.2f} of {a['peak_tflops']:g} TFLOP/s; attention "
                 f"{a['attention_backend']} {a['attention_efficiency']:.3f}; element-wise {a['elementwise_efficiency']:.2f} "
                 f"(eager) / {a['fused_efficiency']:.2f} (compiled) and optimizer {a['optimizer_efficiency']:.2f} of "
                 f"{a['hbm_tbps']:g} TB/s; link {a['link_efficiency']:.2f} of {a['link_gbps']:g} GB/s{network}; launch "
                 f"{a['launch_us']:g} us/kernel (estimation/calibration.json)")
    return "\n".join(lines)


def write_report(report: dict, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(report, fh, indent=2)
    os.replace(tmp, path)
    return path
